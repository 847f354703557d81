"""Jobs that survive a lost host, on three hosts: ``phalanx run
--num-nodes 2:3 --max-restarts 3``. Every process of one host is killed
with SIGKILL mid-training (as if the host was lost); the two others stop
their ranks, meet in a new round and go on from the newest checkpoint; the
host started again joins at the next round. With the rendezvous in etcd
(one member on each host), the host lost may be node 0; with node 0's
store, losing node 0 ends the job on every node with an error that names
it.

Each job counts what it trained on: in every epoch every sample exactly
once, the steps after the newest checkpoint that a lost round did not
keep aside. Also: fsdp on two hosts with a rank killed ends with the very
weights of a run without the failure; a node that never comes, or whose
``phalanx run`` fails before the rendezvous, is named on every other node
after ``rendezvous_timeout``, with lines saying what they wait for.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from phalanx_core.testing.processes import TAG_VAR, new_tag, reap, scheduler_free_environment
from phalanx_core.testing.samples import sample_finding

JOB = str(Path(__file__).resolve().parent / "elastic_job.py")
PORT = "29621"
SAMPLES, EPOCHS = 120, 2
PAUSE = "0.25"


ELASTIC = ("--num-nodes", "2:3", "--max-restarts", "3")


#: Where the nodes meet: node 0's store at host 0's address, each node given its rank.
PLACED = ("--main-address", "192.168.77.1", "--main-port", PORT)


def command(
    node: int, out: Path, *flags: str, nodes: tuple[str, ...] = ELASTIC, ranked: bool = True
) -> list[str]:
    where = ("--node-rank", str(node), *PLACED) if ranked else ()
    return [
        sys.executable, "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu",
        "--devices", "1", *nodes, *where, *flags,
        JOB, str(out), str(SAMPLES), PAUSE,
    ]  # fmt: skip


class Job:
    """One node's ``phalanx run`` per host, started and watched one by one."""

    def __init__(
        self,
        bed,
        out: Path,
        flags: tuple[str, ...] = (),
        nodes: tuple[str, ...] = ELASTIC,
        *,
        ranked: bool = True,
    ) -> None:
        self.bed, self.out, self.flags, self.nodes, self.ranked = bed, out, flags, nodes, ranked
        self.tag = new_tag()
        self.runs: dict[str, list[subprocess.Popen]] = {}
        self.logs: list[Path] = []

    def start(self, index: int) -> subprocess.Popen:
        host = self.bed.hosts[index]
        log = self.out.parent / f"{host.name}-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "w") as file:
            process = host.popen(
                command(index, self.out, *self.flags, nodes=self.nodes, ranked=self.ranked),
                env=scheduler_free_environment(**{TAG_VAR: self.tag}),
                cwd=Path(__file__).resolve().parents[2],
                stdout=file,
                stderr=subprocess.STDOUT,
            )
        self.runs.setdefault(host.name, []).append(process)
        return process

    def kill_host(self, index: int) -> int:
        """SIGKILL every process of the host; how many there were."""
        return self.bed.kill_all(self.bed.hosts[index])

    def wait_for(self, what, seconds: float = 300) -> None:
        deadline = time.monotonic() + seconds
        while not what():
            if time.monotonic() > deadline:
                pytest.fail(f"waited {seconds} s for {what.__doc__}\n{self.describe()}")
            time.sleep(0.1)

    def wait(self, seconds: float = 300) -> dict[str, int]:
        """Wait for every node; their exit codes (the last run of each host)."""
        deadline = time.monotonic() + seconds
        codes = {}
        for name, processes in self.runs.items():
            try:
                codes[name] = processes[-1].wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        left = reap(self.tag)
        assert None not in codes.values(), f"still running after {seconds} s: {codes}\n{self.describe()}"
        assert not left, f"processes left behind (killed now): {left}\n{self.describe()}"
        return codes

    def describe(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in self.logs if log.exists())

    def steps(self, world: int | None = None) -> int:
        """The last step trained (in a round of ``world`` ranks)."""
        last = 0
        for log in self.out.glob("seen-*.txt"):
            for line in log.read_text().splitlines():
                fields = line.split()
                if len(fields) > 5 and (world is None or int(fields[2]) == world):
                    last = max(last, int(fields[4]))
        return last


def assert_every_sample_once(out: Path) -> None:
    """Every sample of every epoch trained on exactly once, but for the
    repeats ``DistributedSampler`` adds (as the loader documents) where a
    round on another number of ranks took over the rest of an epoch that
    does not split evenly over them: at most ``ranks - 1`` per such round."""
    finding = sample_finding(out, SAMPLES, EPOCHS)
    assert finding is None, finding


def worlds(out: Path) -> list[int]:
    """The world size of every round, in order."""
    found = {}
    for log in out.glob("seen-*.txt"):
        for line in log.read_text().splitlines():
            restarts, resumed, world = map(int, line.split()[:3])
            found[(restarts, resumed)] = world
    return [found[key] for key in sorted(found)]


@pytest.fixture
def out(tmp_path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


def test_a_lost_host_leaves_the_job_on_two_and_a_host_started_again_joins(make_bed, out):
    bed = make_bed(3)
    job = Job(bed, out)
    for index in range(3):
        job.start(index)
    job.wait_for(lambda: job.steps(world=3) >= 6)
    assert job.kill_host(2) > 0
    lost_at = time.monotonic()
    job.wait_for(lambda: job.steps(world=2) > 0)
    recovered = time.monotonic() - lost_at
    job.wait_for(lambda: job.steps(world=2) >= job.steps(world=3) + 4)
    # The host comes back. The job is held between steps until the two
    # others have seen it ask to join: on a loaded machine its start (a
    # fresh Python, torch) took longer than the rest of the job, which then
    # ended first, and a node that arrives at an ended job exits 1 (as
    # torchrun's agent does on a closed rendezvous), where this test wants
    # the join.
    (out / "hold").touch()
    job.start(2)

    def asked():
        """node 0 to see host 2 ask to join"""
        said = "asked to join; every rank is stopped and the nodes meet in a new round"
        return said in job.logs[0].read_text()

    job.wait_for(asked)
    (out / "hold").unlink()
    codes = job.wait()
    assert codes == {"node0": 0, "node1": 0, "node2": 0}, job.describe()
    done = json.loads((out / "done.json").read_text())
    assert done["restarts"] == 1, done  # the lost host; a join is no restart
    assert done["world"] == 3, done
    assert worlds(out)[:2] == [3, 2] and worlds(out)[-1] == 3, worlds(out)
    assert_every_sample_once(out)
    text = job.describe()
    assert "every rank is stopped and started again (restart 1 of 3)" in text, text
    assert "asked to join; every rank is stopped and the nodes meet in a new round" in text, text
    assert_named_lost(text, bed, 2)
    print(f"from the kill to the first step on two hosts: {recovered:.1f} s")


def assert_named_lost(text: str, bed: Any, lost: int) -> None:
    """The nodes left say that their ranks lost a peer, not that one failed,
    and, once they meet again, which node of the round before did not come:
    by its node rank, host name and address."""
    said = re.findall(
        r"rank \d+ lost a peer \(exit code 1: .*\); no rank of this node failed of itself", text
    )
    assert said, text
    assert not [line for line in said if "gloo/" in line or "GLHF" in line], said  # what happened, only
    assert re.search(
        rf"node {lost} \(host node{lost}, address {re.escape(bed.hosts[lost].address)}\) of round \d+ did not join "
        r"round \d+: it was lost \(the host, its network, or its phalanx run ended\); the job goes on with 2 nodes",
        text,
    ), text


def test_a_host_lost_without_a_word_is_seen_by_its_heartbeat_and_the_job_goes_on_on_two(make_bed, out):
    """Host 2's link to the others is cut, then its processes are killed:
    nothing it had open is closed toward them (no FIN, no RST), as when a
    host loses its power or its network. The ranks of the others wait in a
    collective for it (gloo's timeout is 30 minutes; they waited 150 s and
    more, and no node said anything); the node that watches host 2's
    heartbeat sees it stop, the round fails, and the job goes on on two."""
    bed = make_bed(3)
    job = Job(bed, out)
    for index in range(3):
        job.start(index)
    job.wait_for(lambda: job.steps(world=3) >= 6)
    bed.cut(bed.hosts[2])
    assert job.kill_host(2) > 0
    lost_at = time.monotonic()
    job.wait_for(lambda: job.steps(world=2) > 0, 120)
    recovered = time.monotonic() - lost_at
    codes = job.wait()
    assert codes["node0"] == 0 and codes["node1"] == 0, job.describe()
    done = json.loads((out / "done.json").read_text())
    assert done == {**done, "restarts": 1, "world": 2}, done
    assert_every_sample_once(out)
    text = job.describe()
    assert "node 2 (host node2) is lost: its launching process stopped beating" in text, text
    assert "(restart 1 of 3)" in text, text
    print(f"from the loss to the first step on two hosts: {recovered:.1f} s")


def test_a_host_cut_off_in_a_job_of_fixed_nodes_ends_the_job_naming_it(make_bed, out):
    """``--num-nodes 2``, no restarts (no rounds): host 1 is cut off the
    network. Node 0's rank would wait in its collective until gloo's
    timeout (30 minutes); node 0 watches node 1's heartbeat, sees it stop,
    and ends naming the lost host. Node 1, whose requests to node 0's store
    go unanswered, ends saying node 0 is lost. Nothing is left running."""
    bed = make_bed(2)
    job = Job(bed, out, nodes=("--num-nodes", "2"))
    for index in range(2):
        job.start(index)
    job.wait_for(lambda: job.steps(world=2) >= 4)
    bed.cut(bed.hosts[1])
    cut_at = time.monotonic()
    codes = job.wait(120)
    took = time.monotonic() - cut_at
    assert codes == {"node0": 1, "node1": 1}, job.describe()
    first, second = (log.read_text() for log in job.logs)
    lost = (
        "phalanx run: node 1 (host node1) is lost: its launching process stopped beating in the job's store"
    )
    assert lost in first, first[-3000:]
    assert "node 0 is lost" in second, second[-3000:]
    assert took < 60, (took, job.describe())  # the heartbeat's 15 s, not gloo's 30 minutes
    print(f"from the cut to the end of both nodes: {took:.1f} s")


@pytest.mark.parametrize("how", ["killed", "lost-without-a-word"])
def test_losing_node_zero_with_its_store_ends_every_node_naming_it(make_bed, out, how):
    # lost-without-a-word: every request to node 0's store waits for TCP to
    # give up, elastic's agent's too (still running 240 s later); the
    # heartbeat's request unanswered for 15 s ends the node.
    bed = make_bed(3)
    job = Job(bed, out)
    for index in range(3):
        job.start(index)
    job.wait_for(lambda: job.steps(world=3) >= 4)
    if how == "lost-without-a-word":
        bed.cut(bed.hosts[0])
    job.kill_host(0)
    lost_at = time.monotonic()
    codes = job.wait()
    took = time.monotonic() - lost_at
    assert codes["node0"] != 0
    assert codes["node1"] == codes["node2"] == 1, job.describe()
    text = job.describe()
    for log in job.logs[1:]:
        said = log.read_text()
        assert "node 0 is lost" in said and "192.168.77.1:" + PORT in said, said[-3000:]
        assert "--rendezvous etcd://" in said, said[-3000:]
    assert took < 60, (took, text)
    print(f"from losing node 0 to the end of every node: {took:.1f} s")


def etcd_cluster(bed, folder: Path) -> str:
    """One etcd member on each host; the rendezvous URL."""
    if shutil.which("etcd") is None:
        pytest.fail("the multihost session installs etcd-server (Debian's etcd 3.4); it is missing")
    return "etcd://" + bed.start_etcd(folder) + "/elastic-test"


@pytest.mark.parametrize("how", ["killed", "lost-without-a-word"])
def test_with_the_rendezvous_in_etcd_losing_node_zero_leaves_the_job_on_two(make_bed, out, tmp_path, how):
    # lost-without-a-word: host 0 is cut off the network before its
    # processes are killed (its etcd member, maybe the leader, with it):
    # only node 2's look at node 0's heartbeat sees it.
    bed = make_bed(3)
    url = etcd_cluster(bed, tmp_path)
    job = Job(bed, out, ("--rendezvous", url))
    for index in range(3):
        job.start(index)
    job.wait_for(lambda: job.steps(world=3) >= 6)
    # Host 0's etcd member goes with it: two of three live on, a majority.
    if how == "lost-without-a-word":
        bed.cut(bed.hosts[0])
    job.kill_host(0)
    job.wait_for(lambda: job.steps(world=2) > 0)
    del job.runs["node0"]
    codes = job.wait()
    assert codes == {"node1": 0, "node2": 0}, job.describe()
    done = json.loads((out / "done.json").read_text())
    assert done["restarts"] == 1 and done["world"] == 2, done
    assert_every_sample_once(out)
    if how == "lost-without-a-word":
        assert "(host node0) is lost: its launching process stopped beating" in job.describe(), job.describe()
    else:
        assert_named_lost(job.describe(), bed, 0)


@pytest.mark.parametrize("where", ["etcd", "node 0's store"])
def test_nodes_md_commands_run_as_written_without_node_ranks(make_bed, out, tmp_path, where):
    """nodes.md's two commands for a job in rounds, as written: no
    --node-rank (both failed on every host: "needs NODE_RANK set on each
    node"). In etcd, no --main-address either; on node 0's store
    (torchrun's form) the node on the host whose address is the main
    address hosts the store, whatever order the hosts start in (host 2
    first, host 0 last here). The rendezvous numbers the nodes; a host is
    killed whole mid-training, and the job goes on on two."""
    bed = make_bed(3)
    flags = ("--rendezvous", etcd_cluster(bed, tmp_path)) if where == "etcd" else PLACED
    job = Job(bed, out, flags, ranked=False)
    for index in (2, 1, 0):
        job.start(index)
    job.wait_for(lambda: job.steps(world=3) >= 6)
    lost = 1 if where == "etcd" else 2  # in etcd any host; else not the store's
    assert job.kill_host(lost) > 0
    job.wait_for(lambda: job.steps(world=2) > 0)
    del job.runs[f"node{lost}"]
    codes = job.wait()
    assert set(codes.values()) == {0} and len(codes) == 2, job.describe()
    done = json.loads((out / "done.json").read_text())
    assert done["restarts"] == 1 and done["world"] == 2, done
    assert_every_sample_once(out)
    assert "every rank is stopped and started again (restart 1 of 3)" in job.describe(), job.describe()


def test_a_job_whose_etcd_is_lost_trains_on_and_ends_well(bed, run_nodes, tmp_path):
    """The nodes need etcd to meet, not to train: with its one member
    killed (SIGKILL) by rank 0 once the job runs, the job trains on, each
    node says once that etcd does not answer, and it ends with exit 0 when
    its ranks do. (It ended 4 minutes late with a traceback and exit 1:
    the agent's look for joining nodes, its heartbeats, its exit barrier
    and the node watch's last post each waited out 60 s of retries.)"""
    etcd = shutil.which("etcd")
    if etcd is None:
        pytest.fail("the multihost session installs etcd-server (Debian's etcd 3.4); it is missing")
    host = bed.hosts[0]
    data = tmp_path / "etcd-lost"
    host.popen(
        [
            etcd, "--name", "solo", "--data-dir", str(data), "--log-level", "error",
            "--listen-client-urls", f"http://{host.address}:2379",
            "--advertise-client-urls", f"http://{host.address}:2379",
            "--listen-peer-urls", f"http://{host.address}:2380",
            "--initial-advertise-peer-urls", f"http://{host.address}:2380",
            "--initial-cluster", f"solo=http://{host.address}:2380",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:  # the member's own pid (the bed starts it through a shell)
        found = subprocess.run(
            ["pgrep", "-f", f"data-dir {data}"], capture_output=True, text=True
        ).stdout.split()
        if found:
            break
        assert time.monotonic() < deadline, "etcd did not start"
        time.sleep(0.1)
    url = f"etcd://{host.address}:2379/lost"
    job = str(Path(__file__).resolve().parent / "job.py")
    started = time.time()
    runs = run_nodes(
        bed.hosts,
        [
            [*two_host_run(n, tmp_path, "--strategy", "ddp", "--rendezvous", url)[:-2], job, "lose", found[0]]
            for n in (0, 1)
        ],
        timeout=180,
    )
    for run in runs:
        assert run.returncode == 0, run.describe()
        assert run.stderr.count("does not answer") == 1, run.describe()
        assert "the ranks train on, but no node can join" in run.stderr, run.describe()
        assert "Traceback" not in run.stderr, run.describe()
        # From its ranks' end to its own, the node waited out none of the 60 s
        # of retries (measured from there: a loaded machine may take long to start).
        [result] = run.results
        assert started + run.ended - result["ended_at"] < 30, run.describe()
    assert len({r["weights"] for run in runs for r in run.results}) == 1


RESUMABLE = str(Path(__file__).resolve().parents[1] / "run_scripts" / "resumable.py")


def two_host_run(
    node: int, out: Path, *flags: str, script: tuple[str, ...] = (), nodes: int = 2
) -> list[str]:
    return [
        sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", "--devices", "1",
        "--num-nodes", str(nodes), "--node-rank", str(node), "--main-address", "192.168.77.1", "--main-port", PORT,
        *flags, RESUMABLE, str(out), *script,
    ]  # fmt: skip


def final_model(out: Path) -> dict:
    import warnings

    from phalanx_torch.checkpoint_io import TorchDistributedCheckpointIO

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        return TorchDistributedCheckpointIO().load(out / "final.pt")["model"]


def test_fsdp_on_two_hosts_ends_with_the_weights_of_a_run_without_the_failure(bed, run_nodes, tmp_path):
    import torch

    finals = {}
    for name, script in (("uninterrupted", ()), ("killed", ("7",))):
        out = tmp_path / name
        out.mkdir()
        flags = ("--strategy", "fsdp", "--max-restarts", "1")
        runs = run_nodes(
            bed.hosts, [two_host_run(n, out, *flags, script=script) for n in (0, 1)], timeout=240
        )
        for run in runs:
            assert run.returncode == 0, run.describe()
        done = json.loads((out / "done.json").read_text())
        assert done == {"restarts": len(script), "world": 2, "steps": 12}, done
        finals[name] = final_model(out)
    said = "".join(run.stderr for run in runs)
    assert "failed (killed by SIGKILL); every rank is stopped and started again (restart 1 of 1)" in said, (
        said
    )
    a, b = finals["uninterrupted"], finals["killed"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (a, b)


@pytest.mark.parametrize("restarts", [False, True], ids=["one meeting", "rounds"])
def test_a_node_that_never_comes_is_named_on_every_node_after_the_timeout(make_bed, run_nodes, out, restarts):
    bed = make_bed(3)
    flags = [
        "--strategy",
        "ddp",
        "-o",
        "rendezvous_timeout=12",
        *(["--max-restarts", "1"] if restarts else []),
    ]
    commands = [two_host_run(n, out, *flags, nodes=3) for n in (0, 1)]  # node 2 never starts
    runs = run_nodes(bed.hosts[:2], commands, timeout=90)
    for run in runs:
        assert run.returncode == 1, run.describe()
        assert run.ended < 120, run.describe()  # rendezvous_timeout=12, and start-up under load: not 900
        if restarts:
            assert "waiting for the nodes to meet: 2 joined (192.168.77.1, 192.168.77.2)" in run.stderr
            assert "did not meet within rendezvous_timeout=12 s: 2 joined" in run.stderr, run.describe()
        else:
            assert "node 2 of 3 never arrived at node 0's store (192.168.77.1:" in run.stderr, run.describe()
    if not restarts:
        assert "node 0 waits at 192.168.77.1:29621 for node 2 (2 of 3 arrived)" in runs[0].stderr, runs[
            0
        ].stderr


def test_a_node_that_fails_before_the_rendezvous_is_named_by_the_others(bed, run_nodes, out):
    flags = ("--strategy", "ddp", "-o", "rendezvous_timeout=10")
    broken = [*two_host_run(1, out, *flags)[:-2], "/no/such/script.py", str(out)]
    runs = run_nodes(bed.hosts, [two_host_run(0, out, *flags), broken], timeout=90)
    assert runs[1].returncode != 0 and "no script at '/no/such/script.py'" in runs[1].stderr, runs[
        1
    ].describe()
    assert runs[0].returncode == 1, runs[0].describe()
    assert "node 1 of 2 never arrived at node 0's store" in runs[0].stderr, runs[0].describe()
    assert runs[0].ended < 120, runs[0].describe()  # rendezvous_timeout=10, and start-up under load


def test_out_of_restarts_every_node_ends_with_the_rank_that_failed(bed, run_nodes):
    job = str(Path(__file__).resolve().parent / "job.py")
    command = [
        sys.executable, "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "1",
        "--num-nodes", "2", "--max-restarts", "1", "--main-address", "192.168.77.1", "--main-port", PORT,
    ]  # fmt: skip
    runs = run_nodes(bed.hosts, [[*command, "--node-rank", str(n), job, "fail", "1"] for n in (0, 1)])
    for run in runs:
        assert run.returncode == 1, run.describe()
        # The job's one restart, said on both nodes; then both name the cause.
        assert run.stderr.count("every rank is stopped and started again (restart 1 of 1)") == 1, (
            run.describe()
        )
        assert "phalanx run: rank 1 (node 1, host node1) raised first" in run.stderr, run.describe()


def test_an_etcd_cluster_that_does_not_answer_is_named_at_once(tmp_path):
    """``--rendezvous etcd://...`` where no member answers: one clear line
    naming the members and what to do, not a traceback, and nothing left
    running."""
    from phalanx_core.testing.processes import run_tagged

    script = tmp_path / "job.py"
    script.write_text("import phalanx\nphalanx.resolve().launch()\n")
    command = [
        sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", "--devices", "1",
        "--num-nodes", "2", "--node-rank", "0", "--main-address", "127.0.0.1", "--main-port", "29655",
        "--rendezvous", "etcd://127.0.0.1:1/job", "-o", "rendezvous_timeout=10", str(script),
    ]  # fmt: skip
    done = run_tagged(command, timeout=120, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert (
        "phalanx run: error: rendezvous in etcd (127.0.0.1:1): no member of the etcd cluster answered"
        in output
    )
    assert "within 10 s" in output and "Start etcd there (3.4 or later)" in output, output
    assert "--rendezvous c10d" in output and "Traceback" not in output, output
