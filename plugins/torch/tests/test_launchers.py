"""The launchers, with real processes: spawn and fork (called here), the
subprocess launcher (script mode: launch_scripts/launch_job.py, run as a
real script), the rank protocol, return values by global rank, and the
failure contract: a rank that raises, is killed, dies first, fails once
under max_restarts, or never arrives at a collective.

Every test is bounded in time (SIGALRM for what runs here, a timeout on
every script) and ends with a check for processes left behind: none of the
test process's children (recursively, through /proc) may be alive, and no
process anywhere may carry this test's tag in its environment (a rank
orphaned by a dead launcher is no longer anyone's child). multiprocessing's
own resource tracker, one per session, is not a process of any job.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import phalanx
from phalanx_core import MisconfigurationError, WorkerFailedError
from phalanx_core.testing.processes import (
    TAG_VAR,
    as_a_terminal_starts_it,
    is_alive,
    new_tag,
    reap,
    scheduler_free_environment,
)
from phalanx_torch.environments import LocalEnvironment
from phalanx_torch.launchers import (
    RESULTS_DIR_VAR,
    STOP_GRACE,
    InProcessLauncher,
    MultiprocessingLauncher,
    SubprocessLauncher,
)

SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
if str(SCRIPTS) not in sys.path:  # spawned ranks get this sys.path too
    sys.path.insert(0, str(SCRIPTS))

import rank_fns  # noqa: E402 - from SCRIPTS, just put on the path

pytestmark = pytest.mark.subprocess

#: Seconds any test may take before it is interrupted.
LIMIT = 90
#: Seconds a launch may take from a rank's failure to the caller's error,
#: including starting the ranks: "every rank is stopped within seconds".
PROMPT = 30
METHODS = ["spawn", "fork"]


class _TimedOut(BaseException):
    """Raised in the test by SIGALRM; a BaseException so no ``except
    Exception`` on the way swallows it."""


@pytest.fixture(autouse=True)
def bounded_and_clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test: at most LIMIT seconds, a tag every process it starts
    inherits, and afterwards no process of it left anywhere."""
    tag = new_tag()
    monkeypatch.setenv(TAG_VAR, tag)

    def interrupt(signum: int, frame: Any) -> None:
        raise _TimedOut(f"the test ran past {LIMIT} s")

    previous = signal.signal(signal.SIGALRM, interrupt)  # pytest runs tests in the main thread
    signal.setitimer(signal.ITIMER_REAL, LIMIT)
    try:
        yield tag
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    left = reap(tag, grace=5, children_of=os.getpid())  # killed processes take a moment to go
    assert not left, f"processes left behind (killed now): {left}"


# -- running scripts ------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    return scheduler_free_environment(**{TAG_VAR: os.environ[TAG_VAR], **extra})


class Job:
    def __init__(self, command: list[str], returncode: int, stdout: str, stderr: str, seconds: float):
        self.command, self.returncode, self.stdout, self.stderr = command, returncode, stdout, stderr
        self.seconds = seconds

    def line(self, marker: str) -> Any:
        for line in self.stdout.splitlines():
            if line.startswith(marker + " "):
                return json.loads(line[len(marker) + 1 :])
        raise AssertionError(f"no {marker} line in the output of {self.describe()}")

    @property
    def results(self) -> Any:
        assert self.returncode == 0, self.describe()
        return self.line("PHALANX-RESULT")

    @property
    def failure(self) -> dict[str, Any]:
        assert self.returncode == 3, self.describe()
        return self.line("PHALANX-FAILED")  # type: ignore[no-any-return]

    def describe(self) -> str:
        return (
            f"{' '.join(self.command)} -> {self.returncode} in {self.seconds:.1f} s\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-6000:]}"
        )


def start(args: list[str], *, cwd: Path = SCRIPTS, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=clean_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_terminal_starts_it,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> Job:
    """Wait for a script; past ``timeout``, SIGTERM it (the agent loop then
    stops its ranks), SIGKILL it 10 s later, and fail."""
    began = time.monotonic()
    command = [str(arg) for arg in proc.args]  # type: ignore[union-attr]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        exited = proc.poll()
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # processes it left hold its output open
                out, err = "", ""
        job = Job(command, proc.wait(), out, err, time.monotonic() - began)
        if exited is not None:
            pytest.fail(f"the script exited, but processes it started kept running: {job.describe()}")
        pytest.fail(f"did not finish within {timeout} s: {job.describe()}")
    return Job(command, proc.returncode, out, err, time.monotonic() - began)


def run_job(*args: str, timeout: float = 60, **env: str) -> Job:
    return finish(start(["launch_job.py", *args], **env), timeout)


# -- spawn and fork: results and the rank protocol ----------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_results_by_global_rank(method, size):
    environment = LocalEnvironment()
    results = MultiprocessingLauncher(
        environment=environment, num_processes=size, start_method=method
    ).launch(rank_fns.whoami, "a")
    assert [r["RANK"] for r in results] == [str(rank) for rank in range(size)]
    assert [r["LOCAL_RANK"] for r in results] == [str(rank) for rank in range(size)]
    # A process per rank, none of them this one.
    assert len({r["pid"] for r in results} | {os.getpid()}) == size + 1
    for r in results:
        assert r["tags"] == ["a"]
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["NODE_RANK"]) == (str(size), str(size), "0")
        assert r["MASTER_ADDR"] == "127.0.0.1"
    # Every rank joins the one store this launch hosts.
    assert len({r["MASTER_PORT"] for r in results}) == 1


@pytest.mark.parametrize("method", METHODS)
def test_a_real_group_over_the_launchers_store(method):
    assert MultiprocessingLauncher(num_processes=3, start_method=method).launch(rank_fns.world) == [
        [rank, 3, 0, 3.0] for rank in range(3)
    ]


def test_a_rank_killed_while_exiting_after_its_result_is_a_warning_not_a_failure():
    # Its result was handed back: the launch returns every result and says
    # how the rank died, rather than losing every rank's work.
    launcher = MultiprocessingLauncher(num_processes=2, start_method="spawn")
    with pytest.warns(
        RuntimeWarning,
        match=r"rank \d of 2 \(launcher 'spawn'\) returned its result, then was killed by SIGABRT",
    ):
        assert launcher.launch(rank_fns.aborts_while_exiting, "done") == ["done", "done"]


def test_ddp_spawn_end_to_end():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2)
    assert strategy.launch(rank_fns.strategy_all_reduce) == [
        [rank, 2, 3.0, "MultiprocessingLauncher", "LocalEnvironment"] for rank in range(2)
    ]


# -- spawn and fork: the failure contract --------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_a_rank_that_raises(method):
    began = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        MultiprocessingLauncher(num_processes=3, start_method=method).launch(rank_fns.raises_on, 1)
    assert time.monotonic() - began < PROMPT  # the other ranks sleep for 600 s: they were stopped
    error = info.value
    assert (error.rank, error.exitcode, error.signal) == (1, 1, None)
    assert "ValueError: rank 1 refuses" in error.traceback
    assert "in raises_on" in error.traceback
    message = str(error)
    assert message.startswith(
        f"the launched job failed: rank 1 of 3 (launcher {method!r}) failed first, with exit code 1."
    )
    assert "ValueError: rank 1 refuses" in message
    assert "Every other rank was stopped. Fix the error rank 1 raised" in message


@pytest.mark.parametrize("method", METHODS)
def test_a_rank_killed_by_sigkill(method):
    began = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        MultiprocessingLauncher(num_processes=2, start_method=method).launch(rank_fns.killed_on, 0)
    assert time.monotonic() - began < PROMPT
    error = info.value
    assert (error.rank, error.exitcode, error.signal, error.traceback) == (0, -9, "SIGKILL", None)
    assert "rank 0 of 2" in str(error)
    assert "failed first, killed by SIGKILL (exit code -9)." in str(error)
    assert "out-of-memory killer" in str(error)


@pytest.mark.parametrize("method", METHODS)
def test_a_rank_that_exits_without_raising(method):
    with pytest.raises(WorkerFailedError) as info:
        MultiprocessingLauncher(num_processes=2, start_method=method).launch(rank_fns.exits_on, 1, 7)
    error = info.value
    assert (error.rank, error.exitcode, error.signal, error.traceback) == (1, 7, None, None)
    assert "rank 1 of 2" in str(error)
    assert "failed first, with exit code 7." in str(error)
    assert "It left no Python traceback: it exited without raising" in str(error)


@pytest.mark.parametrize("method", METHODS)
def test_rank_0_failing_first_does_not_hang_the_others(method):
    with pytest.raises(WorkerFailedError) as info:
        MultiprocessingLauncher(num_processes=2, start_method=method).launch(rank_fns.raises_on, 0)
    assert info.value.rank == 0
    assert "ValueError: rank 0 refuses" in info.value.traceback


@pytest.mark.parametrize("method", METHODS)
def test_a_result_that_cannot_be_pickled_is_that_ranks_failure(method):
    with pytest.raises(WorkerFailedError) as info:
        MultiprocessingLauncher(num_processes=2, start_method=method).launch(rank_fns.unpicklable)
    assert "cannot be pickled to carry it back to the launching process" in info.value.traceback


@pytest.mark.parametrize("name", ["ddp_spawn", "ddp_fork"])
def test_a_rank_that_never_arrives_times_the_others_out(name):
    # rank 1 never reaches rank 0's all_reduce: rank 0 times out after 3 s
    # with the collective's error, and the launcher stops rank 1.
    strategy = phalanx.resolve(name, accelerator="cpu", devices=2, timeout=3)
    began = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        strategy.launch(rank_fns.never_arrives)
    assert 3 <= time.monotonic() - began < 3 + PROMPT
    assert info.value.rank == 0
    assert "CollectiveTimeoutError: all_reduce() on the 'torch' collective" in info.value.traceback
    assert "did not complete within 3 s" in info.value.traceback


# -- spawn and fork: what is refused ----------------------------------------------------------------


def test_start_methods_and_interactivity():
    assert MultiprocessingLauncher(start_method="fork").is_interactive_compatible
    assert not MultiprocessingLauncher(start_method="spawn").is_interactive_compatible
    assert not SubprocessLauncher().is_interactive_compatible
    assert InProcessLauncher().is_interactive_compatible
    refused = (
        r"start_method='vfork': this platform cannot start processes that way \(its start methods: .*spawn"
    )
    with pytest.raises(MisconfigurationError, match=refused):
        MultiprocessingLauncher(start_method="vfork")
    # Through the registry, the option reaches the launcher.
    with pytest.raises(MisconfigurationError, match="start_method='threads'"):
        phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, start_method="threads")


def test_several_nodes_are_refused_with_what_to_use():
    with pytest.raises(MisconfigurationError, match=r"num_nodes=2 .* use launcher='subprocess'"):
        MultiprocessingLauncher(num_processes=2, num_nodes=2, start_method="spawn")


def test_spawn_refuses_what_it_cannot_pickle():
    with pytest.raises(MisconfigurationError, match=r"cannot be pickled .* or use launcher='fork'"):
        MultiprocessingLauncher(num_processes=1, start_method="spawn").launch(lambda: None)


def test_fork_refuses_once_cuda_is_initialised():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 1:
        pytest.skip("needs CUDA: fork is refused only once CUDA is initialised")
    code = (
        "import torch\n"
        "from phalanx_torch.launchers import MultiprocessingLauncher\n"
        "torch.cuda.init()\n"
        "try:\n"
        "    MultiprocessingLauncher(num_processes=2, start_method='fork')\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', type(exc).__name__, exc)\n"
    )
    job = finish(start(["-c", code]))
    assert job.returncode == 0, job.describe()
    assert "REFUSED MisconfigurationError launcher 'fork' cannot fork this process: CUDA" in job.stdout
    assert "Use the 'spawn' launcher" in job.stdout


def test_importing_and_making_launchers_imports_no_torch():
    code = (
        "import sys\n"
        "from phalanx_torch.launchers import InProcessLauncher, MultiprocessingLauncher, SubprocessLauncher\n"
        "InProcessLauncher(); SubprocessLauncher(num_processes=2)\n"
        "MultiprocessingLauncher(num_processes=2, start_method='fork')\n"
        "print('TORCH IMPORTED' if 'torch' in sys.modules else 'NO TORCH')\n"
    )
    job = finish(start(["-c", code]))
    assert job.stdout.strip() == "NO TORCH", job.describe()


# -- in_process: what the subprocess launcher's ranks leave behind ------------------------------------


def test_in_process_leaves_its_result_and_its_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULTS_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("PHALANX_LAUNCH_INDEX", raising=False)
    assert InProcessLauncher().launch(rank_fns.whoami, "x")[0]["tags"] == ["x"]
    assert pickle.loads((tmp_path / "3.pkl").read_bytes())["tags"] == ["x"]
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="rank 1 refuses"):  # unchanged
        InProcessLauncher().launch(rank_fns.raises_on, 1)
    recorded = json.loads(error_file.read_text())["message"]
    assert "ValueError: rank 1 refuses" in recorded["extraInfo"]["py_callstack"]


# -- subprocess (script mode) ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3])
def test_script_mode_results_by_global_rank(size):
    job = run_job("whoami", "--arg", "a", "--processes", str(size))
    [results] = job.results
    assert [r["RANK"] for r in results] == [str(rank) for rank in range(size)]
    assert [r["LOCAL_RANK"] for r in results] == [str(rank) for rank in range(size)]
    assert {r["NODE_RANK"] for r in results} == {"0"}
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) for r in results} == {(str(size), str(size))}
    assert {r["MASTER_ADDR"] for r in results} == {"127.0.0.1"}
    assert {tuple(r["tags"]) for r in results} == {("a",)}
    assert len({r["pid"] for r in results}) == size


def test_script_mode_as_a_module_with_interpreter_options():
    # python -X dev -m launch_job ...: re-run the same way, options included.
    job = finish(start(["-X", "dev", "-m", "launch_job", "whoami", "--processes", "2"]))
    [results] = job.results
    assert [r["RANK"] for r in results] == ["0", "1"]
    assert [r["dev_mode"] for r in results] == [True, True]
    assert [r["main"] for r in results] == ["launch_job", "launch_job"]


def test_script_mode_refuses_a_second_launch_in_the_script():
    # The ranks re-run the whole script: a second launch there would run
    # its function again in every rank of every launch.
    job = run_job("whoami", "--launches", "2")
    failure = job.failure
    assert failure["exitcode"] == 1
    assert (
        "MisconfigurationError: launch() number 2 of a script that launcher 'subprocess'"
        in failure["traceback"]
    )
    assert "Call launch once per script" in failure["traceback"]


def test_script_mode_through_the_registry():
    # Re-run, the script detects torchelastic and runs fn in each rank.
    job = run_job("strategy_all_reduce", "--strategy", "ddp", "--processes", "2")
    [results] = job.results
    assert results == [[rank, 2, 3.0, "InProcessLauncher", "TorchElasticEnvironment"] for rank in range(2)]


def test_script_mode_a_rank_that_raises():
    job = run_job("raises_on", "--arg", "1", "--processes", "3")
    failure = job.failure
    assert (failure["rank"], failure["exitcode"], failure["signal"]) == (1, 1, None)
    assert "ValueError: rank 1 refuses" in failure["traceback"]
    assert "in raises_on" in failure["traceback"]
    assert failure["message"].startswith(
        "the launched job failed: rank 1 of 3 (launcher 'subprocess') failed first, with exit code 1."
    )
    assert job.seconds < PROMPT


def test_script_mode_a_rank_killed_by_sigkill():
    job = run_job("killed_on", "--arg", "1")
    failure = job.failure
    assert (failure["rank"], failure["exitcode"], failure["signal"]) == (1, -9, "SIGKILL")
    assert failure["traceback"] is None
    assert "killed by SIGKILL" in failure["message"]
    assert job.seconds < PROMPT


def test_script_mode_rank_0_dying_first_does_not_hang_the_others():
    job = run_job("rank0_dies_in_barrier", "--processes", "3")
    failure = job.failure
    assert failure["rank"] == 0
    assert "RuntimeError: rank 0 dies first" in failure["traceback"]
    assert job.seconds < PROMPT


def test_a_ranks_error_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    # Elastic's agent stops the other ranks once one failed; a rank stopped
    # while torch's ErrorHandler wrote its error file left it cut short, and
    # elastic's monitor raised JSONDecodeError parsing it (CI, torch 2.14.1,
    # rank0_dies_in_barrier). The file is written beside, then renamed.
    from phalanx_torch._launch.ranks import record_exception

    path = tmp_path / "attempt_0" / "1" / "error.json"
    path.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("rank one broke")
    except ValueError as exc:
        record_exception(exc)
    assert json.loads(path.read_text())["message"]["message"] == "ValueError: rank one broke"
    assert os.environ["TORCHELASTIC_ERROR_FILE"] == str(path)
    assert [p.name for p in path.parent.iterdir()] == ["error.json"]  # nothing left beside it


def test_script_mode_a_rank_that_never_arrives_times_the_others_out():
    job = run_job("never_arrives", "--strategy", "ddp", "--processes", "2", "--timeout", "3")
    failure = job.failure
    assert failure["rank"] == 0
    assert "CollectiveTimeoutError: all_reduce() on the 'torch' collective" in failure["traceback"]
    assert 3 <= job.seconds < 3 + PROMPT


def test_script_mode_a_rank_that_fails_once_is_restarted(tmp_path):
    marker = tmp_path / "failed-once"
    job = run_job("fails_once", "--arg", str(marker), "--max-restarts", "1")
    assert marker.exists()
    # Both ranks of the second attempt (restart 1) made a group and reduced over it.
    assert job.results == [[[0, 1, 4.0], [1, 1, 4.0]]]


def test_script_mode_without_restarts_fails(tmp_path):
    job = run_job("fails_once", "--arg", str(tmp_path / "failed-once"))
    assert job.failure["rank"] == 1


# -- where a job listens ----------------------------------------------------------------------------


def only_loopback(results: list[dict[str, list[str]]]) -> None:
    for result in results:
        assert result["launcher"], result  # the store
        assert result["rank"], result  # gloo
        assert {*result["launcher"], *result["rank"]} == {"127.0.0.1"}, result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_one_node_listens_on_loopback_only_spawn():
    # The launcher's store and every rank's gloo: nothing of a one-node job
    # can be reached from another machine (torch's own choices: the store
    # on every interface, gloo on the address of this host's name).
    only_loopback(phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2).launch(rank_fns.listening))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_one_node_listens_on_loopback_only_script_mode():
    [results] = run_job("listening", "--strategy", "ddp", "--processes", "2").results
    only_loopback(results)


def test_the_address_a_node_listens_on():
    from phalanx_core.launching import LOOPBACK, listen_variables
    from phalanx_torch._launch.listen import interface_of, listen_address

    assert listen_address("192.0.2.1", 29500, num_nodes=1) == LOOPBACK
    # Several nodes with a loopback main address (node 0's name mapped to
    # 127.0.1.1): nothing better is known, so every interface, as torch.
    assert listen_address("127.0.0.1", 29500, num_nodes=2) == ""
    assert interface_of("") is None
    if sys.platform.startswith("linux"):
        assert interface_of(LOOPBACK) is not None
        assert listen_variables(LOOPBACK) == {"GLOO_SOCKET_IFNAME": interface_of(LOOPBACK)}


def test_a_gloo_interface_the_user_chose_is_kept(monkeypatch):
    from phalanx_core.launching import LOOPBACK, listen_variables

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert listen_variables(LOOPBACK) == {}


def test_two_nodes_of_two_processes_make_one_world_of_four():
    with socket.socket() as probe:  # the port the user would choose for node 0
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    nodes = [
        start(
            ["launch_job.py", "world", "--processes", "2", "--nodes", "2"],
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            NODE_RANK=str(node),
        )
        for node in range(2)
    ]
    jobs = [finish(node) for node in nodes]
    world = [[0, 4, 0, 4.0], [1, 4, 0, 4.0], [2, 4, 1, 4.0], [3, 4, 1, 4.0]]
    # Each node's launching process has its own node's ranks' values.
    assert jobs[0].results == [[*world[:2], None, None]]
    assert jobs[1].results == [[None, None, *world[2:]]]


def start_waiting_ranks(launcher: str, folder: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """Start launch_job.py with two ranks that wait for ever; return it and
    the ranks' pids once both have started."""
    job = start(["launch_job.py", "waits_forever", "--arg", str(folder), "--launcher", launcher])

    def started() -> list[Path]:
        return [path for path in folder.iterdir() if path.name.isdigit()]

    deadline = time.monotonic() + 30
    while len(started()) < 2 and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    ranks = [int(path.read_text()) for path in started()]
    if len(ranks) != 2:
        pytest.fail(f"the ranks did not start: {finish(job, timeout=1).describe()}")
    return job, ranks


def gone_soon(pids: list[int]) -> bool:
    deadline = time.monotonic() + STOP_GRACE + 5
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(is_alive(pid) for pid in pids)


@pytest.mark.parametrize("launcher", ["subprocess", "spawn", "fork"])
def test_ctrl_c_in_the_launching_process_stops_every_rank(launcher, tmp_path):
    job, ranks = start_waiting_ranks(launcher, tmp_path)
    job.send_signal(signal.SIGINT)
    ended = finish(job, timeout=STOP_GRACE + 10)
    assert ended.returncode != 0
    assert "KeyboardInterrupt" in ended.stderr, ended.describe()
    assert gone_soon(ranks)


@pytest.mark.parametrize("launcher", ["subprocess", "spawn", "fork"])
def test_a_launching_process_killed_by_sigkill_takes_its_ranks_with_it(launcher, tmp_path):
    # The launcher has no chance to stop anyone: the kernel kills the ranks
    # (PR_SET_PDEATHSIG).
    job, ranks = start_waiting_ranks(launcher, tmp_path)
    job.kill()
    job.wait()  # not its output: a rank left alive would hold it open
    for pipe in (job.stdout, job.stderr):
        pipe.close()  # type: ignore[union-attr]
    assert gone_soon(ranks)


def test_script_mode_refuses_what_is_not_a_script():
    code = (
        "from phalanx_torch.launchers import SubprocessLauncher\n"
        "try:\n"
        "    SubprocessLauncher(num_processes=2).launch(print)\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    job = finish(start(["-c", code]))
    assert "REFUSED launcher 'subprocess' re-runs this process's script" in job.stdout, job.describe()
    assert "python -c, a notebook or a REPL" in job.stdout
    assert "use launcher='spawn' or launcher='fork'" in job.stdout


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (
            "cacert=/nonexistent/ca.pem",
            "cacert='/nonexistent/ca.pem': no file to read at /nonexistent/ca.pem",
        ),
        (
            "password=x",
            "password='x' is not a parameter; its parameters are cacert=..., cert=..., key=..., user=...",
        ),
        ("user=a&user=b", "'user' is given twice"),
        ("key=/etc/hostname", "key= without cert="),
        ("cacert=", "cacert='' is not a parameter"),
    ],
)
def test_bad_tls_and_user_parameters_of_an_etcd_rendezvous_are_named(query, message):
    with pytest.raises(MisconfigurationError, match=re.escape(message)):
        SubprocessLauncher(num_nodes=2, node_rank=0, rendezvous=f"etcd+https://127.0.0.1:2379/job?{query}")
    with pytest.raises(
        MisconfigurationError, match=re.escape("cacert are TLS's; reach the members over TLS")
    ):
        SubprocessLauncher(
            num_nodes=2, node_rank=0, rendezvous="etcd://127.0.0.1:2379/job?cacert=/etc/hostname"
        )


def test_an_etcd_rendezvous_over_tls_as_a_user_is_parsed(tmp_path, monkeypatch):
    (tmp_path / "ca.pem").write_text("")
    # A password no temporary path can contain by chance ("pw" was found in
    # a random folder name of the repr's cacert once).
    secret = "s3cret-Etcd-Password"
    monkeypatch.setenv("PHALANX_ETCD_PASSWORD", secret)
    monkeypatch.chdir(tmp_path)
    launcher = SubprocessLauncher(
        num_nodes=2, node_rank=0, rendezvous="etcd+https://a:1,b/job?cacert=ca.pem&user=me"
    )
    place = launcher._place()
    assert place.endpoints == (("a", 1), ("b", 2379)) and place.name == "job"
    access = place.access
    assert access.tls and access.cacert == str(tmp_path / "ca.pem")  # made absolute
    assert (access.user, access.password) == ("me", secret) and secret not in repr(access)


def test_subprocess_options_are_checked(monkeypatch):
    with pytest.raises(MisconfigurationError, match=r"node_rank=2 is not a node of num_nodes=2"):
        SubprocessLauncher(num_nodes=2, node_rank=2)
    assert SubprocessLauncher(num_nodes=2, node_rank=0, max_restarts=1).elastic  # restarts on every node
    assert not SubprocessLauncher(num_nodes=2, node_rank=0).elastic
    assert SubprocessLauncher(num_nodes=3, node_rank=0, min_nodes=2).elastic
    with pytest.raises(MisconfigurationError, match=r"min_nodes=4; expected an int from 1 to num_nodes=3"):
        SubprocessLauncher(num_nodes=3, node_rank=0, min_nodes=4)
    with pytest.raises(MisconfigurationError, match=r"rendezvous='zk://a:1'; give 'c10d'.* or 'etcd://"):
        SubprocessLauncher(num_nodes=2, node_rank=0, rendezvous="zk://a:1")
    with pytest.raises(MisconfigurationError, match=r"rendezvous='etcd://a:1/x' with num_nodes=1"):
        SubprocessLauncher(rendezvous="etcd://a:1/x")
    etcd = SubprocessLauncher(num_nodes=2, node_rank=1, rendezvous="etcd://a,b:2400/job7")
    assert etcd.elastic
    assert etcd._place().endpoints == (("a", 2379), ("b", 2400)) and etcd._place().name == "job7"
    with pytest.raises(MisconfigurationError, match=r"max_restarts=-1"):
        SubprocessLauncher(max_restarts=-1)
    assert SubprocessLauncher(num_nodes=2, node_rank=0, host_lost_after=6).host_lost_after == 6.0
    with pytest.raises(MisconfigurationError, match=r"host_lost_after=3; a host is taken for lost after 5"):
        SubprocessLauncher(num_nodes=2, node_rank=0, host_lost_after=3)
    with pytest.raises(MisconfigurationError, match=r"host_lost_after='x'; expected a number of seconds"):
        SubprocessLauncher(num_nodes=2, node_rank=0, host_lost_after="x")  # type: ignore[arg-type]
    monkeypatch.setenv("NODE_RANK", "2")
    assert SubprocessLauncher(environment=LocalEnvironment(), num_nodes=3).node_rank == 2
    with pytest.raises(MisconfigurationError, match=r"listen_on='192.0.2.7' is not an address of this host"):
        SubprocessLauncher(listen_on="192.0.2.7")  # TEST-NET-1: no host has it
    with pytest.raises(MisconfigurationError, match=r"listen_on='127.0.0.2' with num_nodes=2: on several"):
        SubprocessLauncher(num_nodes=2, node_rank=0, listen_on="127.0.0.2")


def test_nodes_that_meet_in_rounds_need_no_node_rank(monkeypatch):
    """Without NODE_RANK: nodes that meet once are refused, naming what to
    give; nodes in rounds are numbered by the rendezvous, and with node 0's
    store the main address's host hosts it (torchrun's rule)."""
    monkeypatch.delenv("NODE_RANK", raising=False)
    local = LocalEnvironment()
    local.validate(num_devices=1, num_nodes=2)  # no error: the launcher knows whether it needs one
    with pytest.raises(MisconfigurationError, match=r"num_nodes=2 on the local environment needs NODE_RANK"):
        local.node_rank  # read by anything else, node 0 is not assumed
    with pytest.raises(
        MisconfigurationError,
        match=r"num_nodes=2 on the local environment needs NODE_RANK.*"
        r"--node-rank N --main-address ADDRESS.*--max-restarts N, --num-nodes MIN:MAX",
    ):
        SubprocessLauncher(environment=local, num_nodes=2)
    etcd = SubprocessLauncher(environment=local, num_nodes=3, max_restarts=2, rendezvous="etcd://a:1/j")
    assert etcd.node_rank is None and not etcd._hosts_store
    monkeypatch.setenv("MASTER_ADDR", socket.gethostname())  # this host: its node hosts the store
    assert SubprocessLauncher(environment=local, num_nodes=3, min_nodes=2)._hosts_store
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")  # TEST-NET-1: another host's
    other = SubprocessLauncher(environment=local, num_nodes=3, max_restarts=1)
    assert other.node_rank is None and not other._hosts_store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(
        MisconfigurationError,
        match=r"main address '127.0.0.1' is a loopback address.*"
        r"give each node --node-rank",
    ):
        SubprocessLauncher(environment=local, num_nodes=2, max_restarts=1)
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(
        MisconfigurationError, match=r"main address 'no-such-host.invalid' .* does not resolve"
    ):
        SubprocessLauncher(environment=local, num_nodes=2, max_restarts=1)
    monkeypatch.setenv("NODE_RANK", "1")  # given, it is asked for, and node 0 hosts the store
    ranked = SubprocessLauncher(environment=local, num_nodes=2, max_restarts=1)
    assert ranked.node_rank == 1 and not ranked._hosts_store


FORK_AFTER_PARALLEL_WORK = """
import torch, phalanx

def step(strategy):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.Linear(64, 64)(torch.randn(256, 64)).sum().backward()
    return torch.get_num_threads()

with torch.no_grad():  # the parent runs a parallel region first, as a notebook would
    torch.nn.Linear(64, 64)(torch.randn(256, 64)).sum()
print(phalanx.resolve("ddp_fork", accelerator="cpu", devices=2).launch(step))
"""


def test_fork_after_the_parent_ran_parallel_work_does_not_hang():
    """libgomp cannot run a parallel region in a child forked after the
    parent ran one; a forked rank computes with one thread, so it finishes."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_PARALLEL_WORK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1, 1]"


BACKWARD_THEN_FORK = """
import torch, phalanx
from phalanx_core import MisconfigurationError

torch.ones(2, requires_grad=True).sum().backward()  # on the CPU, on a machine with a GPU
try:
    phalanx.resolve("ddp_fork", accelerator="cpu", devices=2)
except MisconfigurationError as exc:
    print("REFUSED", exc)
"""


def test_fork_is_refused_after_a_backward_pass_on_a_machine_with_a_gpu():
    """There autograd has started its device threads, and a forked child's
    backward would raise deep inside torch: refused when resolving."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a machine with a CUDA GPU: without one autograd starts no threads")
    done = subprocess.run(
        [sys.executable, "-c", BACKWARD_THEN_FORK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "REFUSED launcher 'fork' cannot fork this process: it has run a backward pass" in done.stdout
    assert "'spawn'" in done.stdout


CHECK_THEN_FORK = """
import torch, phalanx

def where(strategy):
    return str(torch.ones(1, device=strategy.root_device).device)

torch.cuda.is_available()  # as scripts do: it leaves CUDA unfit for a forked child
phalanx.resolve("ddp_fork", accelerator="cuda", devices=1).launch(where)
"""


def test_a_forked_rank_that_cannot_use_cuda_says_why():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    done = subprocess.run(
        [sys.executable, "-c", CHECK_THEN_FORK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert (
        "MisconfigurationError: accelerator 'cuda': this process was forked from one that had" in done.stderr
    )
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in done.stderr
    assert done.stderr.count("Traceback") <= 2, done.stderr
