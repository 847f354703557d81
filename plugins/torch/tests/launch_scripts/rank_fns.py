"""What the ranks of the launcher tests run: top-level functions, importable
by name (spawned ranks import them afresh), shared by the in-process tests
(spawn, fork) and by launch_job.py (subprocess). Plain functions import
nothing heavy; those that need a process group say so."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

#: Longer than any test: a rank that sleeps this long was stopped by the launcher.
FOREVER = 600


def rank() -> int:
    return int(os.environ["RANK"])


def whoami(*tags: Any) -> dict[str, Any]:
    """Where this rank is, from the rank protocol's variables."""
    names = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    main = getattr(sys.modules["__main__"], "__spec__", None)
    return {
        "pid": os.getpid(),
        "tags": list(tags),
        "dev_mode": sys.flags.dev_mode,
        "main": main.name if main else None,
        **{name: os.environ.get(name) for name in names},
    }


def raises_on(failing: int | str) -> str:
    """Rank ``failing`` raises; the others would run for ever."""
    if rank() == int(failing):
        raise ValueError(f"rank {failing} refuses")
    time.sleep(FOREVER)
    return "finished"


def killed_on(failing: int | str) -> str:
    """Rank ``failing`` is killed with SIGKILL; the others would run for ever."""
    if rank() == int(failing):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(FOREVER)
    return "finished"


def exits_on(failing: int | str, code: int | str) -> str:
    """Rank ``failing`` exits with ``code`` without raising; the others would
    run for ever."""
    if rank() == int(failing):
        os._exit(int(code))
    time.sleep(FOREVER)
    return "finished"


def waits_forever(folder: str) -> str:
    """Say this rank started (a file named after it in ``folder``), then
    wait for ever."""
    said = Path(folder, f".{rank()}")
    said.write_text(str(os.getpid()))
    said.rename(Path(folder, str(rank())))  # whole, or not there yet
    time.sleep(FOREVER)
    return "finished"


def unpicklable() -> Any:
    return lambda: None


def rank0_dies_in_barrier() -> str:
    """Rank 0 raises; the others wait for it in a gloo barrier, which would
    block for ever without the launcher."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=FOREVER))
    if rank() == 0:
        raise RuntimeError("rank 0 dies first")
    dist.barrier()
    return "finished"


def fails_once(marker: str) -> list[Any]:
    """Rank 1 fails the first time (no ``marker`` yet); every attempt makes a
    real group and reduces over it."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    if rank() == 1 and not Path(marker).exists():
        Path(marker).touch()
        raise RuntimeError("the first attempt fails")
    dist.all_reduce(total)
    dist.destroy_process_group()
    return [rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"]), total.item()]


def world() -> list[Any]:
    """This rank's place, as the process group sees it, and a sum over it."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    place = [dist.get_rank(), dist.get_world_size(), int(os.environ["NODE_RANK"]), total.item()]
    dist.destroy_process_group()
    return place


def strategy_all_reduce(strategy: Any) -> list[Any]:
    """Through a phalanx strategy: its parts as this rank sees them, and an
    all_reduce of rank + 1."""
    import torch

    value = torch.tensor([float(strategy.global_rank + 1)])
    strategy.all_reduce(value)
    parts = [type(strategy.launcher).__name__, type(strategy.environment).__name__]
    return [strategy.global_rank, strategy.world_size, value.item(), *parts]


def never_arrives(strategy: Any) -> str:
    """Rank 1 never reaches the all_reduce rank 0 waits in."""
    import torch

    if strategy.global_rank == 1:
        time.sleep(FOREVER)
    strategy.all_reduce(torch.ones(1))
    return "finished"


def aborts_while_exiting(value: Any) -> Any:
    """Return ``value``, then die by SIGABRT in this rank's exit (an
    ``atexit`` handler, which a spawned rank runs after handing its result
    back), as a native library's exit handler might."""
    import atexit

    atexit.register(os.abort)
    return value


def _listening(pid: int) -> list[str]:
    """The local addresses on which process ``pid`` listens for TCP
    connections (Linux: its socket inodes in /proc/PID/fd, looked up in
    /proc/net/tcp and tcp6)."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    raw = bytes.fromhex(fields[1].split(":")[0])
                    # Each 32-bit word in host (little-endian) order.
                    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append(str(ipaddress.ip_address(packed)))
    return sorted(found)


def listening(strategy: Any) -> dict[str, list[str]]:
    """Where this rank (its gloo) and the process that started it (the
    launcher's store, or the subprocess launcher's agent loop) listen, once every rank is in
    the group."""
    strategy.barrier()
    return {"rank": _listening(os.getpid()), "launcher": _listening(os.getppid())}


def world_listening() -> dict[str, Any]:
    """In a group of every rank (made from the rank protocol's variables):
    where this rank and the process that started it (the agent loop, which
    hosts the store on node 0) listen, once every rank is in the group."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))  # every pair connected
    found = {"rank": _listening(os.getpid()), "launcher": _listening(os.getppid())}
    dist.barrier()
    dist.destroy_process_group()
    return found
