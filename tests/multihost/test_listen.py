"""Where a job of the ``subprocess`` launcher listens when its nodes are on
different hosts: node 0's agent (the rendezvous store) and every rank's
gloo listen on their host's address on the bridge, the one that reaches
node 0, never on every interface or on loopback; a one-node job given
``listen_on`` listens there.
"""

from __future__ import annotations

import json
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "plugins" / "torch" / "tests" / "launch_scripts"


def test_each_node_listens_on_the_address_that_reaches_node_0(bed, run_nodes, python):
    main = bed.hosts[0].address
    runs = run_nodes(
        bed.hosts,
        [[python, "launch_job.py", "world_listening", "--processes", "2", "--nodes", "2"]] * 2,
        env={"MASTER_ADDR": main, "MASTER_PORT": "29731"},
        node_env=[{"NODE_RANK": "0"}, {"NODE_RANK": "1"}],
        cwd=SCRIPTS,
    )
    for node, run in enumerate(runs):
        assert run.returncode == 0, run.describe()
        line = next(x for x in run.stdout.splitlines() if x.startswith("PHALANX-RESULT "))
        [results] = json.loads(line.removeprefix("PHALANX-RESULT "))
        mine = [r for r in results if r is not None]
        assert len(mine) == 2, results
        address = bed.hosts[node].address
        for result in mine:
            assert result["rank"] and set(result["rank"]) == {address}, result  # gloo
            if node == 0:  # the agent hosts the store
                assert main in result["launcher"], result
            assert not set(result["launcher"]) - {address}, result  # nothing on * or loopback


def test_one_node_listens_on_the_address_it_is_given(bed, run_nodes, python):
    # listen_on: a one-node job other hosts can reach (each replica group of
    # ddp_ft on several hosts is one), on that address only.
    address = bed.hosts[1].address
    [run] = run_nodes(
        bed.hosts[1:],
        [[python, "launch_job.py", "world_listening", "--processes", "2", "--listen-on", address]],
        cwd=SCRIPTS,
    )
    assert run.returncode == 0, run.describe()
    line = next(x for x in run.stdout.splitlines() if x.startswith("PHALANX-RESULT "))
    [results] = json.loads(line.removeprefix("PHALANX-RESULT "))
    assert len(results) == 2, results
    for result in results:
        assert set(result["rank"]) == {address}, result  # gloo
        assert set(result["launcher"]) == {address}, result  # the store, on nothing else
