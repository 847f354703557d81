"""phalanx's own agent loop (``_launch/rank_loop.py``) against torch's:
a rank that ``phalanx run`` starts sees the variables a ``torchrun`` rank
sees, each with the same value where the two can agree."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_torch._launch.rank_loop import rank_env

pytestmark = pytest.mark.subprocess

#: Each rank writes the variables its launcher gave it (those its launching
#: process did not have) to a file named after its rank.
SCRIPT = """
import json, os, sys
from pathlib import Path
out = Path(sys.argv[1])
parent = json.loads((out / "parent.json").read_text())
given = {k: v for k, v in os.environ.items() if parent.get(k) != v}
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(given))
"""

#: What a rank of each may see that the other does not give: phalanx's
#: own variables, the node's rank and gloo's listening address; torchrun's file-based
#: watchdog's and health check's switches (elastic's agent features the
#: loop does not have: no phalanx part used them).
OWN = ("PHALANX_", "NODE_RANK", "GLOO_", "TP_", "TORCH_GLOO_")
NOT_IN_THE_LOOP = {
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
}
#: Values that differ by nature: the store's port, the run's name, the
#: error file's path (under each launch's own folder), the role's name
#: (torchrun's ``default``; ``phalanx`` as ever).
PER_RUN = {"MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "ROLE_NAME"}


#: A rank's variables (besides TORCHELASTIC_*), as torchrun gives them.
KEYS = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)  # fmt: skip


def ranks_variables(tmp_path: Path, name: str, launcher: list[str]) -> dict[int, dict[str, str]]:
    out = tmp_path / name
    out.mkdir()
    (tmp_path / "report.py").write_text(SCRIPT)
    # Without what a test run before may have left in this process's
    # environment (a rank's variables), so that the ranks' are theirs.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_"))}
    for name in (*KEYS, "NODE_RANK"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    (out / "parent.json").write_text(json.dumps(env))
    job = subprocess.run(
        [*launcher, str(tmp_path / "report.py"), str(out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)}


def test_a_rank_of_phalanx_run_sees_the_variables_of_a_torchrun_rank(tmp_path):
    torchrun = ranks_variables(
        tmp_path, "torchrun",
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    )  # fmt: skip
    phalanx = ranks_variables(
        tmp_path, "phalanx",
        [sys.executable, "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2"],
    )  # fmt: skip
    for rank in range(2):
        theirs = {k: v for k, v in torchrun[rank].items() if k not in NOT_IN_THE_LOOP}
        ours = {k: v for k, v in phalanx[rank].items() if not k.startswith(OWN)}
        assert set(theirs) == set(ours), (sorted(set(theirs) ^ set(ours)), theirs, ours)
        for name in set(theirs) - PER_RUN:
            assert theirs[name] == ours[name], (name, theirs[name], ours[name])
        assert ours["RANK"] == str(rank) and ours["LOCAL_RANK"] == str(rank)
        assert ours["ROLE_NAME"] == "phalanx"
        assert Path(ours["TORCHELASTIC_ERROR_FILE"]).name == "error.json"


def test_rank_env_numbers_the_ranks_node_by_node():
    env = rank_env(
        local_rank=1, num_processes=2, group_rank=1, group_world_size=3, first_rank=2, world_size=6,
        master=("10.0.0.1", 29500),
        restart_count=2, max_restarts=3, run_id="job", use_agent_store=True,
    )  # fmt: skip
    assert env["RANK"] == env["ROLE_RANK"] == "3"
    assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "6"
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "3", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "3")
    assert (env["TORCHELASTIC_RUN_ID"], env["TORCHELASTIC_USE_AGENT_STORE"]) == ("job", "True")


def keywords(function: object) -> set[str]:
    return set(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_public_parts_of_elastic_the_loop_uses_are_as_it_calls_them():
    # The loop's only contact with torch's launch machinery; CI runs this
    # on each end of the supported range (torch_range).
    from torch.distributed.elastic.multiprocessing import (
        DefaultLogsSpecs,
        SignalException,
        Std,
        start_processes,
    )
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
        RendezvousStoreInfo,
    )

    used = {"name", "entrypoint", "args", "envs", "logs_specs", "log_line_prefixes", "start_method"}
    assert used <= keywords(start_processes)
    assert {"log_dir", "redirects", "tee"} <= keywords(DefaultLogsSpecs.__init__)
    assert {"ALL", "NONE"} <= set(Std.__members__)
    assert {"timeout"} <= keywords(PContext.wait) and {"death_sig", "timeout"} <= keywords(PContext.close)
    assert {"name", "failures"} <= keywords(ChildFailedError.__init__)
    assert {"local_rank", "exitcode", "error_file", "timestamp"} <= {
        f.name for f in dataclasses.fields(ProcessFailure)
    }
    assert "sigval" in keywords(SignalException.__init__)
    info = RendezvousInfo(None, 1, 2, RendezvousStoreInfo("10.0.0.1", 29500))  # type: ignore[arg-type]
    assert (info.rank, info.world_size) == (1, 2)
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == (
        "10.0.0.1",
        29500,
    )
    parameters = RendezvousParameters(
        backend="b", endpoint="", run_id="r", min_nodes=1, max_nodes=2, local_addr=None, ledger=1
    )
    assert (parameters.config["ledger"], parameters.min_nodes, parameters.max_nodes) == (1, 1, 2)
    abstract = RendezvousHandler.__abstractmethods__
    assert {"next_rendezvous", "num_nodes_waiting", "get_run_id", "shutdown"} <= abstract
