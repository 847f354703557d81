"""Ray clusters that the ``ray`` launcher joins rather than starts: a head
that ``ray start`` started outside phalanx, and two Ray nodes on two hosts
of the network-namespace test bed (:mod:`phalanx_core.testing.hosts`).

Every Ray node is a ``ray start --block`` process that a fixture starts,
tagged (:mod:`phalanx_core.testing.processes`), and stops by its pid with
SIGTERM, as ``ray stop`` does: it drains its node and ends every process
it started, in 2 to 4 s here. The fixture fails if it had to kill
anything: ``ray start`` still running after the grace, or a process of the
node left behind. Each node keeps its files in a ``TMPDIR`` of its own
(Ray's temp dir is ``$TMPDIR/ray``): ``ray start`` writes its address to
``ray/ray_current_cluster`` there, where any ``ray.init()`` without an
address on this machine would find it, and leaves it there when stopped
by a signal.

Ray 2.60 enables token authentication by default on a head, and a
process given the address of a cluster, a worker node's ``ray start
--address`` or a driver's ``ray.init(address=)``, sends its token only
under ``RAY_AUTH_MODE=token``, set before ``import ray`` (Ray reads its
configuration then). conftest.py sets that, and the token's file
(``RAY_AUTH_TOKEN_PATH``, made for the run), for this process, and so for
every node, driver and ``ray list`` the tests start, as a user of such a
cluster sets them. The drivers are ``jobs/join.py`` in processes of their
own, which these variables reach.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ft_job import Job, kill_one_of_two_groups_and_check_it_heals

from phalanx_core.testing.hosts import Host, TestBed, missing
from phalanx_core.testing.processes import (
    TAG_VAR,
    as_a_terminal_starts_it,
    is_alive,
    new_tag,
    reap,
    run_tagged,
    scheduler_free_environment,
    tagged_processes,
)

JOBS = Path(__file__).resolve().parent / "jobs"
#: The ``ray`` command of this interpreter's environment.
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
#: What ``ray start`` prints once its node is registered with the GCS (it
#: waits for that before printing it): a job may be placed there.
STARTED = "Ray runtime started."
START_TIMEOUT = 90.0
#: ``ray start`` drains its node for up to 30 s on SIGTERM.
STOP_GRACE = 45.0
#: Seconds within which a launch that cannot run must say so.
AT_ONCE = 30.0
#: Seconds a driver may take in all.
DRIVER_TIMEOUT = 180.0
#: The head's GCS port on the test bed, where each host has its own ports.
BED_PORT = 6379


# -- Ray nodes: `ray start --block`, started and stopped by pid ----------------------------


@dataclass
class RayNode:
    """One ``ray start --block`` process and what it printed."""

    process: subprocess.Popen[str]
    tag: str
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def printed(self, pattern: str) -> str:
        found = re.search(pattern, "".join(self.lines))
        assert found, f"`ray start` did not print {pattern!r}:\n{''.join(self.lines)}"
        return found.group(1)


def start_node(flags: list[str], *, temp: Path, host: Host | None = None) -> RayNode:
    """``ray start --block FLAGS`` (on ``host``, else here), its files under
    ``temp``; returns once its node is registered."""
    tag = new_tag()
    argv = [*RAY, "start", "--block", "--disable-usage-stats", "--log-color", "false", *flags]
    options = dict(
        env=scheduler_free_environment(**{TAG_VAR: tag, "TMPDIR": str(temp)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=as_a_terminal_starts_it,  # stopped with SIGTERM
    )
    process = host.popen(argv, **options) if host is not None else subprocess.Popen(argv, **options)
    node = RayNode(process, tag)
    node.reader = threading.Thread(target=lambda: node.lines.extend(process.stdout), daemon=True)
    node.reader.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not any(STARTED in line for line in node.lines):
        if process.poll() is not None or time.monotonic() > deadline:
            problems = stop_node(node)
            output = "".join(node.lines)
            pytest.fail(f"`{' '.join(argv)}` did not start in {START_TIMEOUT:g} s {problems}:\n{output}")
        time.sleep(0.1)
    return node


def stop_node(node: RayNode) -> list[str]:
    """SIGTERM to ``ray start``; SIGKILL to its process group if it still
    runs :data:`STOP_GRACE` seconds later, and to every process of the node
    still there. Returns what had to be killed (nothing: it cleaned up)."""
    problems = []
    pid = node.process.pid
    if node.process.poll() is None:
        node.process.terminate()
        try:
            node.process.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            problems.append(f"`ray start` (pid {pid}) still ran {STOP_GRACE:g} s after SIGTERM; killed")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            node.process.wait(10)
    left = reap(node.tag, grace=10)
    if left:
        problems.append(f"processes of the node left behind (killed now): {left}")
    if node.reader is not None:
        node.reader.join(10)
    return problems


def free_ports(count: int) -> list[int]:
    """Ports the kernel gives now, for a node here (``ray start`` takes no 0
    for its fixed ones). Another program may take one meanwhile: unlikely."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def job_processes(node: RayNode) -> dict[int, str]:
    """The node's processes that are a rank's or the output's actor."""
    return {
        pid: cmd
        for pid, cmd in tagged_processes(node.tag).items()
        if cmd.startswith(("ray::Rank", "ray::Outbox"))
    }


def wait_until_none(check, timeout: float = 20.0):
    """``check()`` until it gives nothing (``ray.kill`` does not wait), at
    most ``timeout`` seconds; its last value."""
    deadline = time.monotonic() + timeout
    while (value := check()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


# -- drivers: jobs/join.py --------------------------------------------------------------------


def driver_environment(**extra: str) -> dict[str, str]:
    env = scheduler_free_environment()
    env.pop("RAY_ADDRESS", None)  # which cluster a driver joins is the test's to say
    return {**env, **extra}


class Driver:
    """``jobs/join.py OPTIONS`` in a process of its own (on ``host``, else
    here), tagged, its output collected; as a context manager, ended
    whatever happens, and checked for processes left behind."""

    def __init__(self, options: list[str], *, env: dict[str, str], host: Host | None = None) -> None:
        self.tag = new_tag()
        #: Seconds after which :meth:`end` killed it, still running; None if it ended.
        self.killed_after: float | None = None
        argv = [sys.executable, str(JOBS / "join.py"), *options]
        popen = dict(
            env={**env, TAG_VAR: self.tag}, cwd=JOBS, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        self.process = host.popen(argv, **popen) if host is not None else subprocess.Popen(argv, **popen)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=lambda s=stream, into=lines: into.extend(s), daemon=True)
            for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.end(timeout=10)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    def describe(self) -> str:
        stderr = "".join(self.err)
        code = f"exit code {self.process.returncode}"
        if self.killed_after is not None:  # else a -9 reads as a crash
            code += f" (killed by the test: still running {self.killed_after:g} s after its stdin closed)"
        return f"{code}\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{stderr[-6000:]}"

    def records(self, marker: str) -> list[dict]:
        prefix = marker + " "
        return [json.loads(line[len(prefix) :]) for line in list(self.out) if line.startswith(prefix)]

    def wait_for(self, marker: str, timeout: float = DRIVER_TIMEOUT) -> dict:
        """The first ``MARKER {json}`` line, once it is printed."""
        deadline = time.monotonic() + timeout
        while not (found := self.records(marker)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the driver printed no {marker} line in {timeout:g} s\n{self.describe()}")
            time.sleep(0.1)
        return found[0]

    def end(self, timeout: float = DRIVER_TIMEOUT) -> int:
        """Close its stdin and wait for it (killed after ``timeout``)."""
        if self.process.returncode is None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.killed_after = timeout
                self.process.kill()
                self.process.wait(30)
            for reader in self.readers:
                reader.join(10)
            left = reap(self.tag)
            assert not left, f"processes left behind (killed now): {left}\n{self.describe()}"
        return self.process.returncode


# -- a head that `ray start` started ---------------------------------------------------------


@dataclass
class Head:
    node: RayNode
    #: The GCS address, as ``ray start`` prints it for other nodes.
    address: str
    node_ip: str
    temp: Path


@pytest.fixture(scope="class")
def head() -> Iterator[Head]:
    """A one-node cluster of 4 CPUs, with the dashboard (``ray list``
    reads the state API there), on ports of its own: another Ray on this
    machine keeps the default ones."""
    temp = Path(tempfile.mkdtemp(prefix="phx-ray-"))  # short: Ray's socket paths are under it
    gcs, client, dashboard, agent = free_ports(4)
    flags = [
        "--head", "--port", str(gcs), "--num-cpus", "4", "--include-dashboard", "true",
        "--ray-client-server-port", str(client), "--dashboard-port", str(dashboard),
        "--dashboard-agent-listen-port", str(agent),
    ]  # fmt: skip
    node = None
    try:
        node = start_node(flags, temp=temp)
        yield Head(
            node,
            address=node.printed(r"ray start --address='([^']+)'"),
            node_ip=node.printed(r"Local node IP: (\S+)"),
            temp=temp,
        )
    finally:
        problems = stop_node(node) if node is not None else []
        shutil.rmtree(temp, ignore_errors=True)
    assert not problems, f"`ray start --block` did not clean up after itself on SIGTERM: {problems}"


def ray_list(head: Head, kind: str, key: str, value: str) -> list[dict]:
    """``ray list KIND --filter KEY=VALUE`` on the head's cluster."""
    where = ["--address", head.address, "--filter", f"{key}={value}", "--format", "json"]
    done = run_tagged([*RAY, "list", kind, *where], timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class TestAClusterStartedOutside:
    def test_launch_joins_it_and_leaves_it_running(self, head):
        options = ["--address", head.address, "--devices", "2", "--launches", "2"]
        with Driver(options, env=driver_environment()) as driver:
            assert driver.end() == 0, driver.describe()
        launches = driver.records("PHALANX-RESULT")
        assert len(launches) == 2, driver.describe()
        for launch in launches:
            assert not launch["connected"]  # the launcher left the cluster after the job
            results = launch["results"]
            assert [r["rank"] for r in results] == [0, 1]
            assert {r["gcs"] for r in results} == {head.address}  # that cluster, not one of its own
            (job,) = {r["job"] for r in results}
            for rank in (0, 1):
                line = f"[rank{rank}]: rank {rank} on {socket.gethostname()} in job {job}: all_reduce 3\n"
                assert line in driver.stdout, driver.describe()
        assert launches[0]["results"][0]["job"] != launches[1]["results"][0]["job"]
        assert head.node.process.poll() is None and is_alive(head.node.process.pid)
        assert not wait_until_none(lambda: job_processes(head.node)), "rank actors still running"

    @pytest.mark.parametrize("connected", [False, True], ids=["joined-by-address", "connected-before"])
    def test_a_failed_job_leaves_no_actor_and_no_placement_group(self, head, connected):
        # Joined by address, the launcher leaves the cluster after the job,
        # and then Ray ends the job's actors itself; connected before (the
        # launcher uses that connection and keeps it), the driver is still
        # there while the test looks: only the launcher's kill ended them.
        options = ["--address", head.address, "--devices", "2", "--fail"]
        if connected:
            options.append("--connect-first")
        with Driver(options, env=driver_environment()) as driver:
            error = driver.wait_for("PHALANX-ERROR")
            assert error["connected"] == connected
            jobs = set(re.findall(r"^\[rank\d\]: job (\w+)$", driver.stdout, re.MULTILINE))
            assert len(jobs) == 1, driver.describe()
            job = jobs.pop()

            def alive() -> list[dict]:
                listed = ray_list(head, "actors", "job_id", job)
                assert sorted(a["class_name"] for a in listed) == ["Outbox", "Rank", "Rank"], listed
                return [a for a in listed if a["state"] != "DEAD" or is_alive(a["pid"])]

            assert not wait_until_none(alive), "actors of the job still alive"
            groups = ray_list(head, "placement-groups", "creator_job_id", job)
            assert [g["state"] for g in groups] == ["REMOVED"], groups
            assert driver.end() == 1, driver.describe()
        host = socket.gethostname()
        assert error["type"] == "WorkerFailedError", error
        assert (error["rank"], error["node"], error["host"]) == (1, 0, host), error
        assert f"rank 1 of 2 on node 0 (host {host}) (launcher 'ray')" in error["message"], error["message"]
        assert "ValueError: rank 1 gave up" in error["traceback"]

    @pytest.mark.parametrize(
        ("devices", "num_nodes", "asked", "could"),
        [
            (8, 1, "1 node(s) with 8 CPU each (8 rank(s) per node, 1 CPU per rank)", "0 of its 1 node(s)"),
            (1, 2, "2 node(s) with 1 CPU each (1 rank(s) per node, 1 CPU per rank)", "1 of its 1 node(s)"),
        ],
    )
    def test_a_placement_group_it_can_never_hold_is_refused_at_once(
        self, head, devices, num_nodes, asked, could
    ):
        options = [
            "--address", head.address, "--devices", str(devices), "--num-nodes", str(num_nodes),
            "--placement-timeout", "600",
        ]  # fmt: skip
        with Driver(options, env=driver_environment()) as driver:
            assert driver.end() == 1, driver.describe()
        error = driver.wait_for("PHALANX-ERROR", timeout=0)
        assert error["type"] == "UnavailableError" and not error["connected"], error
        assert error["seconds"] < AT_ONCE, error  # not placement_timeout
        assert f"the job asks for {asked}, and the Ray cluster can never hold it" in error["message"], error
        assert f"{could} could ({head.node_ip}: 4 CPU)" in error["message"], error

    def test_a_launch_without_address_starts_its_own_instance_beside_it(self, head):
        # As on a machine where someone ran `ray start --head`: its address
        # is where ray.init() looks first.
        with Driver(["--devices", "2"], env=driver_environment(TMPDIR=str(head.temp))) as driver:
            assert driver.end() == 0, driver.describe()
        (launch,) = driver.records("PHALANX-RESULT")
        assert [r["rank"] for r in launch["results"]] == [0, 1]
        assert head.address not in {r["gcs"] for r in launch["results"]}


def test_an_address_where_nothing_answers_is_refused_at_once():
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    with Driver(["--address", address], env=driver_environment()) as driver:
        code = driver.end()
    assert code == 1, driver.describe()
    error = driver.wait_for("PHALANX-ERROR", timeout=0)
    assert error["type"] == "UnavailableError", error
    # The launch's own time (not the driver's start, whose imports alone
    # may take longer than that on a loaded machine): ray.init would retry
    # for ~14 minutes.
    assert error["seconds"] < AT_ONCE, error
    assert f"no Ray cluster answers at address={address!r}" in error["message"], error


# -- two Ray nodes on two hosts --------------------------------------------------------------


@dataclass
class TwoHosts:
    bed: TestBed
    #: The head's GCS address, on node0.
    address: str


@pytest.fixture(scope="class")
def two_hosts() -> Iterator[TwoHosts]:
    """A head on node0 and a worker node on node1, one CPU each."""
    yield from ray_hosts(2)


@pytest.fixture
def three_hosts() -> Iterator[TwoHosts]:
    """A head on node0 and worker nodes on node1 and node2, one CPU each."""
    yield from ray_hosts(3)


def ray_hosts(count: int) -> Iterator[TwoHosts]:
    """A head on node0 and a worker node on each other host of a test bed
    of ``count``, one CPU each; every node stopped by pid after."""
    if (why := missing()) is not None:
        pytest.fail(f"Ray nodes on several hosts need network namespaces: {why}")
    temp = Path(tempfile.mkdtemp(prefix="phx-ray-"))  # every node's files: one machine
    bed = TestBed(count)
    nodes: list[RayNode] = []
    try:
        bed.open()
        node0 = bed.hosts[0]
        address = f"{node0.address}:{BED_PORT}"
        # --node-ip-address on both: a host of the bed has no route out,
        # so Ray's probe of 8.8.8.8 fails and the head falls back to its
        # host name, which maps to 127.0.1.1 there; it then gives the other
        # node and the ranks an address they cannot reach, and a job across
        # both hangs. (The worker node would find its own from its route to
        # the head.) Ray's default ports do: every host has its own.
        head_flags = [
            "--head", "--port", str(BED_PORT), "--include-dashboard", "false",
            "--node-ip-address", node0.address, "--num-cpus", "1",
        ]  # fmt: skip
        nodes.append(start_node(head_flags, temp=temp, host=node0))
        for host in bed.hosts[1:]:
            worker_flags = ["--address", address, "--node-ip-address", host.address, "--num-cpus", "1"]
            nodes.append(start_node(worker_flags, temp=temp, host=host))
        yield TwoHosts(bed, address)
    finally:
        problems = [problem for node in reversed(nodes) for problem in stop_node(node)]
        bed.close()
        shutil.rmtree(temp, ignore_errors=True)
    assert not problems, f"`ray start --block` did not clean up after itself on SIGTERM: {problems}"


class TestTwoHosts:
    def test_the_ranks_run_on_both_nodes_and_reduce_across_them(self, two_hosts):
        node0, node1 = two_hosts.bed.hosts
        options = ["--address", two_hosts.address, "--num-nodes", "2"]
        with Driver(options, env=driver_environment(), host=node0) as driver:
            assert driver.end() == 0, driver.describe()
        (launch,) = driver.records("PHALANX-RESULT")
        results = launch["results"]
        assert [(r["rank"], r["node"]) for r in results] == [(0, 0), (1, 1)], launch
        # Which node holds which bundle of the group is Ray's choice.
        assert sorted((r["address"], r["host"]) for r in results) == [
            (node0.address, "node0"),
            (node1.address, "node1"),
        ]
        assert [r["all_reduce"] for r in results] == [3.0, 3.0]
        for r in results:
            line = f"[rank{r['rank']}]: rank {r['rank']} on {r['host']} in job {r['job']}: all_reduce 3\n"
            assert line in driver.stdout, driver.describe()

    def test_phalanx_run_ships_the_working_directory_and_marks_each_rank(self, two_hosts, tmp_path):
        node0, _ = two_hosts.bed.hosts
        shutil.copy(JOBS / "per_rank.py", tmp_path / "per_rank.py")
        (tmp_path / "data.txt").write_text("shipped with the script\n")
        command = [
            sys.executable, "-m", "phalanx", "run", "--launcher", "ray", "--strategy", "ddp",
            "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2", "per_rank.py", str(tmp_path),
        ]  # fmt: skip
        # The cluster to join from RAY_ADDRESS, as Ray's own tools take it.
        env = driver_environment(RAY_ADDRESS=two_hosts.address)
        tag = new_tag()
        try:
            done = node0.run(command, env={**env, TAG_VAR: tag}, cwd=tmp_path, timeout=DRIVER_TIMEOUT)
        finally:
            left = reap(tag)
        assert not left, f"processes left behind (killed now): {left}"
        assert done.returncode == 0, done.stdout + done.stderr
        # Each rank's line, marked with its rank; one rank on each host.
        lines = re.findall(
            r"^\[rank(\d)\]: rank (\d) of 2 on (node\d): all_reduce 3, "
            r"data\.txt 'shipped with the script', shipped True$",
            done.stdout,
            re.MULTILINE,
        )
        assert sorted((marked, rank) for marked, rank, _ in lines) == [("0", "0"), ("1", "1")], done.stdout
        assert sorted(host for *_, host in lines) == ["node0", "node1"], done.stdout


class TestALostNode:
    def test_with_max_restarts_the_job_goes_on_on_the_nodes_left(self, three_hosts, tmp_path):
        """Three Ray nodes on three hosts, a job of one rank on each of two
        (``STRICT_SPREAD``) with ``max_restarts=1``: every process of a host
        that runs a rank, not the head's (its raylet, its workers, its ``ray
        start``), is killed with SIGKILL mid-training. The launcher places the job
        anew on the two nodes left, it resumes from its last checkpoint and
        finishes; nothing of it is left running."""
        bed = three_hosts.bed
        options = ["--address", three_hosts.address, "--num-nodes", "2", "--max-restarts", "1"]
        options += ["--train", str(tmp_path / "checkpoints"), "--placement-timeout", "120"]
        with Driver(options, env=driver_environment(), host=bed.hosts[0]) as driver:
            deadline = time.monotonic() + DRIVER_TIMEOUT
            while not [r for r in rank_steps(driver) if r["step"] >= 6 and r["rank"] == 1]:
                assert driver.process.poll() is None and time.monotonic() < deadline, driver.describe()
                time.sleep(0.2)
            # The host of a rank, not the head's (node0, where the driver
            # and Ray's control store run): one rank per node, so one of
            # the two ranks runs elsewhere.
            hosts = {r["host"] for r in rank_steps(driver)} - {bed.hosts[0].name}
            assert len(hosts) >= 1, driver.describe()
            lost = next(h for h in bed.hosts if h.name in hosts)
            assert bed.kill_all(lost) > 0
            code = driver.end()
        assert code == 0, driver.describe()
        (launch,) = driver.records("PHALANX-RESULT")
        assert [r["restart"] for r in launch["results"]] == [1, 1], driver.describe()
        assert [r["step"] for r in launch["results"]] == [30, 30], driver.describe()
        assert all(r["start"] >= 6 for r in launch["results"]), driver.describe()  # resumed, not from 0
        after = [r for r in rank_steps(driver) if r["restart"] == 1]
        assert after and all(r["host"] != lost.name for r in after), driver.describe()
        assert sorted({r["host"] for r in after}) == sorted(h.name for h in bed.hosts if h is not lost)
        assert launch["results"][0]["weights"] == launch["results"][1]["weights"]


def rank_steps(driver: Driver) -> list[dict]:
    """The ``STEP {...}`` lines the ranks printed, as the driver passed them
    on (``[rankN]: STEP {...}``)."""
    found = re.findall(r"^\[rank\d+\]: STEP (\{.*\})$", driver.stdout, re.MULTILINE)
    return [json.loads(text) for text in found]


# -- ddp_ft's groups under launcher ray_replica_groups (phalanx-torchft) ----------------------
#
# Ray places an actor on each node, which runs that node's replica groups;
# a group's rank killed is started again by its node, alone, and heals from
# the other group: on a local Ray instance the launcher starts, and on two
# Ray nodes on two hosts of the test bed.


def test_on_a_local_ray_instance_a_killed_group_is_restarted_alone_and_heals(tmp_path):
    job = Job(
        tmp_path, "--launcher", "ray_replica_groups", "--devices", "1", "--replica-groups", "2",
        "--max-restarts", "1", park_at=6,
    )  # fmt: skip
    kill_one_of_two_groups_and_check_it_heals(job, park_at=6)


@pytest.fixture
def two_ray_hosts():
    yield from ray_hosts(2)


def namespace_of(pid: int) -> str:
    return subprocess.run(
        ["ip", "netns", "identify", str(pid)], capture_output=True, text=True
    ).stdout.strip()


def test_on_two_ray_nodes_each_runs_its_group_and_a_killed_one_heals_across_them(two_ray_hosts, tmp_path):
    bed = two_ray_hosts.bed
    job = Job(
        tmp_path, "--launcher", "ray_replica_groups", "--devices", "1", "--replica-groups", "2",
        "--num-nodes", "2", "--max-restarts", "1", park_at=6,
        env=driver_environment(RAY_ADDRESS=two_ray_hosts.address), where=bed.hosts[0],
    )  # fmt: skip
    victim_file = job.out / "victim"
    job.wait_for(victim_file.exists, "group 1 at step 6", timeout=240)
    job.wait_for(lambda: job.pids(0), "group 0's steps, relayed")  # the nodes' lines come through Ray
    # One group on each host (which node holds which is Ray's choice).
    spots = {namespace_of(job.pids(0)[0]), namespace_of(int(victim_file.read_text()))}
    assert spots == {host.namespace for host in bed.hosts}, (spots, job.output)
    kill_one_of_two_groups_and_check_it_heals(job, park_at=6)
    assert not any(pid for host in bed.hosts for pid in bed.pids(host) if _is_the_jobs(pid, job))


def _is_the_jobs(pid: int, job: Job) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as found:
            return str(job.out).encode() in found.read()
    except OSError:
        return False
