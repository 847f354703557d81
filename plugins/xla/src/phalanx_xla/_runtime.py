"""What every part of phalanx-xla shares: whether torch_xla can be used here
(without importing it until that is known), the replicas of this process,
and the one workaround the CPU runtime needs.

**Availability** is decided in this order, importing nothing until the last
step: torch_xla installed (``importlib.util.find_spec``); the torch release
it was built for (torch_xla's metadata does not pin torch, and torch_xla
2.9.0 works with exactly torch 2.9.0: :data:`TORCH_FOR_XLA`); a device for
it (``PJRT_DEVICE`` set, or a TPU on the PCI bus); then ``import
torch_xla.runtime``. Importing torch_xla sets ``PJRT_DEVICE=CPU`` when it is
unset and no TPU is found, which would make XLA "available" on every
machine, so without ``PJRT_DEVICE`` and a TPU the answer is no, with what to
set.

**Replicas as threads** (the CPU runtime with ``CPU_NUM_DEVICES=N``, and
TPU v2/v3 with two cores per chip): the replicas of a process share its
XLA runtime. Two threads that compile the graph of a collective at the same
time get two executables whose cross-replica operations carry different ids,
and each waits forever for a partner running the other one; XLA aborts the
process after 15 s (pytorch/xla#9089 shows the symptom). A graph whose
constants differ between replicas (``torch.full((2,), rank + 1.0)``: 1.0 is
a constant, 2.0 a parameter) compiles to different executables too. So
where replicas are threads, :func:`sync` holds one lock per process around
``torch_xla.sync()`` (the second replica then finds the first one's
executable in the compilation cache instead of compiling its own), and the
collective syncs its inputs before each operation, so that the operation's
graph is the same on every replica. ``torch_xla.sync()`` only launches the
execution, but it first waits for the previous execution on its device to
finish; so each replica waits for that *before* taking the lock, and the
lock is never held while a replica waits for another (holding it then, a
replica whose previous graph was a collective would keep the others from
launching their part of it: a deadlock). And the graph that holds a
collective holds nothing else: the collective is launched on its own
(:func:`collective_issued`), and what follows it (a mean's division, a
cast) runs in the next graph. With more in it, a bfloat16 all_reduce
followed by a multiplication in one graph, ``torch_xla.sync()`` did not
return on this runtime while it held the lock (the execution waited for the
other replica inside it), in every run; alone, it returns at once. Where
each process has one replica, none of this applies.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import os
import re
import threading
from pathlib import Path
from typing import Any

from phalanx_core import Availability, MisconfigurationError

from .plugin import INSTALL

__all__ = [
    "INSTALL",
    "TORCH_FOR_XLA",
    "availability",
    "in_replica",
    "replicas_are_threads",
    "sync",
    "version_problem",
]


#: The torch release each torch_xla release was built for (major.minor of
#: torch_xla -> exact torch version). torch_xla's own metadata does not say.
#: A torch_xla not listed here needs a torch of the same major.minor.
TORCH_FOR_XLA: dict[str, str] = {"2.9": "2.9.0", "2.8": "2.8.0", "2.7": "2.7.0", "2.6": "2.6.0"}

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")
_GOOGLE_PCI_VENDOR = "0x1ae0"

#: Held around torch_xla.sync() where the replicas are threads of one process.
_SYNC_LOCK = threading.Lock()
#: Per thread: the replica this thread runs (set by the launcher).
_REPLICA = threading.local()


def version_problem(torch_version: str, xla_version: str) -> str | None:
    """Say why ``torch_version`` cannot work with ``xla_version`` (both as
    their distributions report them, local parts like ``+cpu`` allowed), or
    return ``None`` when they match."""
    t, x = _RELEASE.match(torch_version), _RELEASE.match(xla_version)
    if t is None or x is None:
        return f"cannot read the versions torch {torch_version!r} and torch_xla {xla_version!r}"
    minor = f"{x.group(1)}.{x.group(2)}"
    needed = TORCH_FOR_XLA.get(minor)
    have = f"{t.group(1)}.{t.group(2)}.{t.group(3) or 0}"
    if needed is not None:
        if have == needed:
            return None
        return (
            f"torch_xla {xla_version} needs exactly torch {needed}, and torch {torch_version} is "
            f"installed (torch_xla's package metadata does not say which torch it needs)"
        )
    if (t.group(1), t.group(2)) == (x.group(1), x.group(2)):
        return None
    return (
        f"torch_xla {xla_version} needs torch {minor}.x, and torch {torch_version} is installed "
        "(torch_xla's package metadata does not say which torch it needs)"
    )


def _tpu_on_pci() -> bool:
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with contextlib.suppress(OSError):
            if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
    return False


def availability() -> Availability:
    """Whether torch_xla can be used here, and if not why and what to do.
    Never raises; imports torch_xla only once everything else is known to
    be right."""
    if importlib.util.find_spec("torch_xla") is None:
        return Availability(False, f"torch_xla is not installed; run: {INSTALL}")
    if importlib.util.find_spec("torch") is None:
        return Availability(False, f"torch is not installed (torch_xla needs it); run: {INSTALL}")
    try:
        torch_version = importlib.metadata.version("torch")
        xla_version = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError as exc:
        return Availability(False, f"no package metadata for {exc}; reinstall: {INSTALL}")
    problem = version_problem(torch_version, xla_version)
    if problem:
        return Availability(False, f"{problem}; install the pair: {INSTALL}")
    if not os.environ.get("PJRT_DEVICE") and not _tpu_on_pci():
        return Availability(
            False,
            "PJRT_DEVICE is not set and no TPU is attached; set PJRT_DEVICE=CPU (XLA's CPU runtime, "
            "CPU_NUM_DEVICES=N replicas) or PJRT_DEVICE=CUDA, or run on a TPU VM",
        )
    try:
        import torch_xla.runtime  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return Availability(
            False,
            f"importing torch_xla {xla_version} with torch {torch_version} failed "
            f"({type(exc).__name__}: {exc}); reinstall the pair: {INSTALL}",
        )
    return Availability(True)


def device_type() -> str:
    """``PJRT_DEVICE`` without its variant (``"CPU"``, ``"TPU"``), or
    ``"TPU"`` where it is unset and a TPU is attached."""
    value = os.environ.get("PJRT_DEVICE", "")
    return value.split("_")[0].upper() if value else ("TPU" if _tpu_on_pci() else "")


def device_count() -> int:
    """The XLA devices of this host, without starting the XLA runtime
    (started, it could not be launched from this process any more)."""
    kind = device_type()
    if kind == "CPU":
        return _int_env("CPU_NUM_DEVICES", 1)
    if kind == "TPU":
        from torch_xla._internal import tpu

        return int(tpu.num_available_devices())
    if kind in ("CUDA", "GPU"):
        import torch

        return _int_env("GPU_NUM_DEVICES", torch.cuda.device_count())
    return _int_env(f"{kind}_NUM_DEVICES", 1)


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise MisconfigurationError(
            f"{name}={raw!r} is not a number of devices; set it to an int like 2, or unset it"
        ) from None
    if value < 1:
        raise MisconfigurationError(f"{name}={raw!r}: set it to at least 1, or unset it")
    return value


def enter_replica(rank: int) -> None:
    """Mark this thread as running replica ``rank`` (the launcher calls it)."""
    _REPLICA.rank = rank


def in_replica() -> bool:
    """Whether this thread runs a replica that the ``xla`` launcher started."""
    return getattr(_REPLICA, "rank", None) is not None


def require_replica(what: str) -> None:
    """Raise, saying where to call ``what``, outside a launched replica:
    asking torch_xla for ranks here would start the XLA runtime in this
    process, after which it can launch no replicas."""
    if not in_replica():
        raise MisconfigurationError(
            f"{what} on XLA exists only inside a replica, that is inside strategy.launch(fn, ...) "
            "with the 'xla' launcher; call it from fn (asking torch_xla here would start its runtime "
            "in this process, and then no replicas could be launched from it)"
        )


def replicas_are_threads() -> bool:
    """Whether this process runs more than one replica (as threads)."""
    import torch_xla.runtime as xr

    return int(xr.addressable_runtime_device_count()) > 1 and int(xr.world_size()) > 1


def sync() -> None:
    """``torch_xla.sync()``: launch this replica's pending graph. Where the
    replicas are threads of this process, one at a time (see the module's
    docstring)."""
    import torch_xla

    if replicas_are_threads():
        # torch_xla.sync() first waits for this device's previous execution;
        # waiting for it under the lock would keep the other replicas from
        # launching their part of it, if it was a collective.
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops(xm.xla_real_devices([torch_xla.device()]))
        with _SYNC_LOCK:
            torch_xla.sync()
    else:
        torch_xla.sync()


def collective_issued() -> None:
    """Where replicas are threads: launch the collective just issued, alone
    in its graph (see the module's docstring). Elsewhere nothing: it runs
    with whatever follows it."""
    if replicas_are_threads():
        sync()


def pin_layout() -> bool:
    """``pin_layout`` for torch_xla's collectives: pinned (torch_xla's
    default) except where replicas are threads: there, pinned all_reduce and
    all_gather deadlocked on the CPU runtime in every run (the replicas
    waited at different op ids), and every replica runs the same
    executable, which is what pinning exists to protect."""
    return not replicas_are_threads()


def xla_device() -> Any:
    """This replica's device."""
    import torch_xla

    return torch_xla.device()
