"""A real Slurm cluster across the hosts of a test bed: slurmctld on
``node0``, a slurmd on each host (``slurmd -N node0``, ``-N node1``), each
daemon in its host's namespace with its host's name; munged once, on this
machine, its socket on the filesystem every host shares. ``srun -N2`` on
``node0`` starts the tasks of ``slurm/rank.py`` on both hosts; phalanx
detects ``slurm``, reads the ranks and the main address from Slurm's
variables, and the tasks make one gloo group across the hosts.

Each host's own name maps to ``127.0.1.1`` (Debian's hosts file). The bed
comes in two address ranges, because gloo connects each pair of ranks from
the one whose address sorts higher: on ``10.77.0.x`` a node-0 rank that
wrongly listens on ``127.0.1.1`` still connects out to node 1 and the job
passes; on ``192.168.77.x`` node 1 must connect to it, and cannot.

Collected only in the ``multihost`` session; needs root, iproute2 and the
Debian packages ``slurmd slurmctld slurm-client munge`` (a missing one fails
the tests, never skips them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx_core.testing.hosts import Host, TestBed, missing
from phalanx_core.testing.processes import as_a_terminal_starts_it, scheduler_free_environment
from phalanx_torch._launch.scheduler_vars import expand_hostlist

pytestmark = pytest.mark.subprocess

HERE = Path(__file__).resolve().parent / "slurm"
SCRIPT = "tests/multihost/slurm/rank.py"
INSTALL = "apt-get install -y slurmd slurmctld slurm-client munge"
#: Where Debian puts the daemons, not always on PATH.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
#: Seconds the daemons get to come up, and to go on TERM before KILL.
START_TIMEOUT = 30
STOP_TIMEOUT = 10


def _tool(name: str) -> str:
    found = shutil.which(name, path=SEARCH_PATH)
    assert found, f"{name} not found; install Slurm and munge: {INSTALL}"
    return found


@dataclass
class Cluster:
    """A running cluster: ``SLURM_CONF=conf`` for its commands."""

    bed: TestBed
    folder: Path
    conf: Path
    #: Seconds from munged's start to every node idle.
    start_seconds: float = 0.0

    def env(self, **extra: str) -> dict[str, str]:
        return scheduler_free_environment(SLURM_CONF=str(self.conf), **extra)

    def states(self) -> dict[str, str]:
        """``sinfo``'s state of each node, asked on the controller's host."""
        done = self.bed.hosts[0].run([_tool("sinfo"), "-h", "-N", "-o", "%N %t"], env=self.env(), timeout=10)
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)

    def logs(self, lines: int = 30) -> str:
        """The last lines of every daemon's log and output."""
        found = []
        for log in sorted([*self.folder.glob("*/*.log"), *self.folder.glob("*/*.out")]):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            found.append(f"--- {log.relative_to(self.folder)}\n" + "\n".join(tail))
        return "\n".join(found)


def _config(folder: Path, hosts: list[Host]) -> str:
    nodes = "\n".join(
        f"NodeName={h.name} NodeAddr={h.address} CPUs=2 CoresPerSocket=2 State=UNKNOWN" for h in hosts
    )
    template = (HERE / "slurm.conf.in").read_text()
    controller = f"{hosts[0].name}({hosts[0].address})"
    return (
        template.replace("@DIR@", str(folder)).replace("@CONTROLLER@", controller).replace("@NODES@", nodes)
    )


def _start_munged(folder: Path, output) -> subprocess.Popen:
    """munged in the foreground as user munge, with a key of its own."""
    munge = folder / "munge"
    key = munge / "munge.key"
    subprocess.run([_tool("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True, timeout=30)
    for path in (munge, key):
        shutil.chown(path, "munge", "munge")
    munge.chmod(0o711)  # munged refuses a socket folder that others can write or cannot enter
    return subprocess.Popen(
        [_tool("munged"), "--foreground", f"--key-file={key}", f"--socket={munge / 'munge.socket.2'}",
         f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
         f"--seed-file={munge / 'munged.seed'}"],
        user="munge", group="munge", extra_groups=[], stdin=subprocess.DEVNULL, stdout=output, stderr=output,
        preexec_fn=as_a_terminal_starts_it,  # stopped with SIGTERM
    )  # fmt: skip


def _wait(
    what: str, ready: Callable[[], bool], processes: dict[str, subprocess.Popen], cluster: Cluster
) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        dead = {name: p.returncode for name, p in processes.items() if p.poll() is not None}
        if dead or time.monotonic() > deadline:
            why = f"exited: {dead}" if dead else f"not after {START_TIMEOUT} s"
            pytest.fail(f"{what}: {why}\n{cluster.logs()}")
        time.sleep(0.1)


def _stop(processes: dict[str, subprocess.Popen]) -> list[str]:
    """TERM each in turn, KILL it after STOP_TIMEOUT; the names of those killed."""
    killed = []
    for name, process in processes.items():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT)
                killed.append(name)
    return killed


@pytest.fixture(params=["10.77.0", "192.168.77"], ids=["10.77.0.x", "192.168.77.x"])
def bed(request):
    """Two hosts whose own names map to loopback, on the subnet asked for."""
    if missing() is not None:
        pytest.fail(f"the multihost session needs network namespaces: {missing()}")
    with TestBed(2, subnet=request.param) as made:
        yield made


@pytest.fixture
def slurm(bed: TestBed):
    """munged, slurmctld on the first host and a slurmd on each, every node
    idle; at the end every daemon is stopped by its pid, and nothing runs on
    any host any more (checked; also when the test failed)."""
    for tool in ("sinfo", "srun", "slurmctld", "slurmd", "munged", "mungekey"):
        _tool(tool)
    # A short path: munged's socket lives under it (socket paths are limited to 107 bytes).
    folder = Path(tempfile.mkdtemp(prefix="phx-slurm-"))
    folder.chmod(0o755)  # munged (user munge) must reach its socket under it
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, bed.hosts))
    shutil.copy(HERE / "cgroup.conf", folder)  # read from SLURM_CONF's folder
    for name in ("munge", "slurmctld/state", *(f"{h.name}/spool" for h in bed.hosts)):
        (folder / name).mkdir(parents=True)
    cluster = Cluster(bed, folder, conf)
    processes: dict[str, subprocess.Popen] = {}
    outputs = []
    started = time.monotonic()
    try:
        outputs.append((folder / "munge" / "munged.out").open("wb"))
        processes["munged"] = _start_munged(folder, outputs[-1])
        _wait("munged", (folder / "munge" / "munge.socket.2").exists, processes, cluster)
        # Each daemon through host.popen: in its host's namespace, with its host's name;
        # in the foreground (-D), so that the process started is the daemon.
        daemons = [(bed.hosts[0], "slurmctld", [_tool("slurmctld"), "-D", "-f", str(conf)])]
        daemons += [(h, h.name, [_tool("slurmd"), "-D", "-f", str(conf), "-N", h.name]) for h in bed.hosts]
        for host, name, argv in daemons:
            outputs.append((folder / name / f"{argv[0].rsplit('/', 1)[-1]}.out").open("wb"))
            out = outputs[-1]
            processes[name] = host.popen(
                argv,
                env=cluster.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                preexec_fn=as_a_terminal_starts_it,  # stopped with SIGTERM
            )
        want = {h.name: "idle" for h in bed.hosts}
        _wait(f"the nodes {', '.join(want)} idle", lambda: cluster.states() == want, processes, cluster)
        cluster.start_seconds = time.monotonic() - started
        print(f"slurm cluster up in {cluster.start_seconds:.1f} s")
        yield cluster
    finally:
        # the slurmds, the controller, then munged: the reverse of their start
        killed = _stop(dict(reversed(processes.items())))
        left = {h.name: pids for h in bed.hosts if (pids := bed.pids(h))}
        for pids in left.values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for output in outputs:
            output.close()
        logs = cluster.logs()
        shutil.rmtree(folder, ignore_errors=True)
        assert not killed, f"daemons still running {STOP_TIMEOUT} s after TERM (killed): {killed}\n{logs}"
        assert not left, f"processes left on the hosts after the daemons stopped (killed now): {left}\n{logs}"


@pytest.mark.parametrize("per_node", [1, 2])
def test_srun_runs_one_job_across_two_hosts(slurm, bed, run_nodes, python, per_node):
    node0 = bed.hosts[0]
    # Each task runs the script through `phalanx run`, in place: it ends the
    # task without Python's finalization, where torch's gloo threads can
    # abort a finished process (SIGABRT, "terminate called without an
    # active exception": 2 tasks in about 40 here with `python SCRIPT`).
    flags = ["--strategy", "ddp", "--accelerator", "cpu", "--devices", str(per_node), "--num-nodes", "2"]
    command = [
        "srun",
        "-N2",
        f"--ntasks-per-node={per_node}",
        "--kill-on-bad-exit=1",
        python,
        "-m",
        "phalanx",
        "run",
        *flags,
        SCRIPT,
        str(per_node),
    ]
    [run] = run_nodes([node0], [command], env={"SLURM_CONF": str(slurm.conf)}, timeout=120)
    assert run.returncode == 0, f"{run.describe()}\n{slurm.logs()}"
    results = sorted(run.results, key=lambda r: r["rank"])
    world = 2 * per_node
    assert [r["rank"] for r in results] == list(range(world)), run.describe()
    for r in results:
        slurm_vars = r["slurm"]
        # the ranks are Slurm's, and every rank is in the one group of them all
        assert r["environment"] == "slurm", r
        assert r["world_size"] == world and r["group"] == [r["rank"], world], r
        assert (r["rank"], r["local_rank"]) == (
            int(slurm_vars["SLURM_PROCID"]),
            int(slurm_vars["SLURM_LOCALID"]),
        ), r
        # the node rank is SLURM_NODEID, and the node is the host it ran on (block distribution)
        assert r["node_rank"] == int(slurm_vars["SLURM_NODEID"]) == r["rank"] // per_node, r
        assert r["host"] == slurm_vars["SLURMD_NODENAME"] == bed.hosts[r["node_rank"]].name, r
        # the main address is the first node of Slurm's node list, by its address on the
        # bridge, the same on every rank (node 0 included: not loopback, not 127.0.1.1)
        for nodelist in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
            assert expand_hostlist(slurm_vars[nodelist]) == [h.name for h in bed.hosts], r
        assert r["main_address"] == r["master_addr"] == node0.address, r
        assert r["main_port"] == 10000 + int(slurm_vars["SLURM_JOB_ID"][-4:]), r
        # the collectives went across the hosts
        assert r["all_reduce"] == world * (world + 1) / 2, r
        assert r["ddp_grad"] == [float(world + 1)] * 4 and r["ddp_grads"] == [r["ddp_grad"]] * world, r
    assert {r["host"] for r in results} == {h.name for h in bed.hosts}, "the job did not span both hosts"
    assert len({r["slurm"]["SLURM_JOB_ID"] for r in results}) == 1, results


@pytest.mark.parametrize("bed", ["192.168.77"], indirect=True)
def test_ddp_ft_under_srun_on_two_hosts_restarts_a_killed_group_on_its_host(slurm, bed, tmp_path):
    # srun -N2 starts one phalanx run per host: node 0's hosts the
    # lighthouse and group 0, node 1's group 1. Group 1's rank killed: node
    # 1's phalanx run starts it again (not Slurm), and it heals from group 0
    # across the hosts.
    from ft_job import Job, kill_one_of_two_groups_and_check_it_heals

    srun = ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    job = Job(
        tmp_path, "--devices", "1", "--replica-groups", "2", "--num-nodes", "2", "--max-restarts", "1",
        park_at=6, launch=srun, env=slurm.env(), where=bed.hosts[0],
    )  # fmt: skip
    kill_one_of_two_groups_and_check_it_heals(job, park_at=6)
    assert "[group0" in job.output and "[group1" in job.output, job.output
