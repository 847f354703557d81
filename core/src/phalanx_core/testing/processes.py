"""The processes a job left behind, for tests of launchers (Linux: reads
``/proc``).

A test gives every process of a job a tag: a variable (``TAG_VAR``) in the
environment of the command it starts, which every descendant inherits —
torchrun's workers, srun's tasks under slurmstepd, mpirun's ranks. After the
job, a process that still carries the tag was left behind, whoever its
parent now is (a rank orphaned by a dead launcher is nobody's child)::

    tag = new_tag()
    subprocess.run(command, env=scheduler_free_environment(**{TAG_VAR: tag}), timeout=60)
    assert not reap(tag), "processes left behind"

For code that runs in the test's own process (``strategy.launch`` with the
spawn or fork launcher), :func:`left_behind` also counts the live
descendants of the test process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

__all__ = [
    "TAG_VAR",
    "as_a_terminal_starts_it",
    "descendants",
    "is_alive",
    "left_behind",
    "connections_to",
    "listening_sockets",
    "new_tag",
    "reap",
    "run_tagged",
    "scheduler_free_environment",
    "tagged_processes",
]

#: The environment variable that tags a test's processes.
TAG_VAR = "PHALANX_TEST_TAG"

#: Variables of a scheduler the tests themselves may run under (CI inside a
#: Slurm job, torchrun); a job a test starts must see only its own launcher's.
SCHEDULER_PREFIXES = (
    "SLURM_",
    "TORCHELASTIC_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "LSB_",
    "JSM_",
    "HOROVOD_",
)
SCHEDULER_NAMES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


#: The signals tests send to the processes they start.
SENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def as_a_terminal_starts_it() -> None:
    """For ``subprocess.Popen(preexec_fn=...)`` in a test that signals the
    process it starts: the child begins with the default handling of
    :data:`SENT_SIGNALS`, none of them blocked, as a terminal's foreground
    job does, whatever the test run inherited. A shell without job control
    starts a background command with SIGINT and SIGQUIT ignored (``cmd &``
    in a CI script), children inherit that, and a Python started with
    SIGINT ignored never raises ``KeyboardInterrupt``: a Ctrl-C test would
    wait on a process that cannot get one."""
    for sig in SENT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def new_tag() -> str:
    """A fresh tag for one job."""
    return uuid.uuid4().hex


def scheduler_free_environment(**extra: str) -> dict[str, str]:
    """This process's environment without any scheduler's rank variables
    (and without phalanx's own launch variables), unbuffered, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith((*SCHEDULER_PREFIXES, "PHALANX_")) and k not in SCHEDULER_NAMES
    }
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _read(path: str | Path) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:  # gone meanwhile, or another user's
        return b""


def is_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[-1].split()[0] != b"Z"


def _command(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


def tagged_processes(tag: str, var: str = TAG_VAR) -> dict[int, str]:
    """pid -> command line of every live process (not this one) whose
    environment holds ``var=tag``."""
    needle = f"{var}={tag}".encode()
    return {
        int(entry.name): _command(int(entry.name))
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and int(entry.name) != os.getpid()
        and needle in _read(entry / "environ").split(b"\0")
        and is_alive(int(entry.name))
    }


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, recursively (through every thread's
    children)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in _read(task / "children").split():
            found |= {int(child)} | descendants(int(child))
    return found


def left_behind(tag: str, *, children_of: int | None = None, var: str = TAG_VAR) -> dict[int, str]:
    """The live processes tagged ``tag``, and, with ``children_of``, the
    live descendants of that process — but not multiprocessing's resource
    tracker, which serves a whole session rather than a job."""
    found = tagged_processes(tag, var)
    if children_of is not None:
        for pid in descendants(children_of):
            if pid not in found and is_alive(pid):
                found[pid] = _command(pid)
    return {pid: cmd for pid, cmd in found.items() if "multiprocessing.resource_tracker" not in cmd}


def reap(
    tag: str, grace: float = 10.0, *, children_of: int | None = None, var: str = TAG_VAR
) -> dict[int, str]:
    """Wait up to ``grace`` seconds for the job's processes to end (a
    scheduler may reap its tasks just after the launcher exits); kill those
    still there by pid with SIGKILL, and return them (empty: nothing was
    left behind)."""
    deadline = time.monotonic() + grace
    while (left := left_behind(tag, children_of=children_of, var=var)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


def run_tagged(
    command: list[str], *, timeout: float, cwd: str | Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end, its output captured, in a scheduler-free
    environment (plus ``env``) with a fresh tag; then reap what the job left
    behind and fail (AssertionError, listing them) if anything was. The
    return code is the caller's to check."""
    tag = new_tag()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=scheduler_free_environment(**{TAG_VAR: tag, **env}),
            cwd=cwd,
        )
    finally:
        left = reap(tag)
    assert not left, f"processes left behind (killed now): {left}"
    return done


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours to read
        return inodes
    for name in names:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _address(hex_address: str) -> tuple[str, int]:
    import ipaddress

    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        address = str(ipaddress.IPv4Address(raw[::-1]))
    else:  # four little-endian 32-bit words
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        six = ipaddress.IPv6Address(words)
        # An IPv4 address on an IPv6 socket (::ffff:127.0.0.1) is that IPv4 address.
        address = str(six.ipv4_mapped or six)
    return address, int(port, 16)


def listening_sockets(pids: list[int] | set[int]) -> list[tuple[int, str, int]]:
    """The TCP sockets that ``pids`` hold open and listen on, as ``(pid,
    address, port)``; address ``0.0.0.0`` or ``::`` means every interface.
    Reads ``/proc`` (Linux): the sockets of the network namespace of this
    process."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and fields[9] in owner:  # 0A: LISTEN
                    address, port = _address(fields[1])
                    found.append((owner[fields[9]], address, port))
    return sorted(found)


def connections_to(pids: list[int] | set[int], port: int) -> dict[int, int]:
    """How many established TCP connections each of ``pids`` holds to a
    peer's ``port`` (the clients of a store listening there). Reads
    ``/proc`` (Linux), as :func:`listening_sockets` does."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    counts = dict.fromkeys(pids, 0)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                established = len(fields) > 9 and fields[3] == "01"  # 01: ESTABLISHED
                if established and fields[9] in owner and _address(fields[2])[1] == port:
                    counts[owner[fields[9]]] += 1
    return counts
