"""Which c10d backends this torch has, and which devices' tensors each
moves: the ``torch`` collective's checks when resolving, before any
process starts."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from phalanx_core import MisconfigurationError, UnavailableError
from phalanx_core.accelerator import Accelerator

#: c10d backends that move one kind of device's tensors only.
_DEVICE_ONLY = {"nccl": "cuda", "xccl": "xpu"}


def check_backend(name: str) -> str:
    """``name`` in lower case, where this torch has that backend; else the
    error that says which it has, or how to get it."""
    backend = name.lower()
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if backend not in known:
        raise MisconfigurationError(
            f"collective 'torch' with backend={name!r}: torch.distributed knows no such backend; "
            f"it has {', '.join(known)}. Register a third-party backend with "
            "torch.distributed.Backend.register_backend before resolving, or choose one of those"
        )
    available = {
        "gloo": dist.is_gloo_available,
        "nccl": dist.is_nccl_available,
        "mpi": dist.is_mpi_available,
    }
    if backend in available and not available[backend]():
        raise UnavailableError(
            f"collective 'torch' with backend={backend!r}: this torch build has no {backend} "
            f"backend ({torch.__version__}); "
            + (
                "torch from PyPI has no MPI backend: use collective='mpi' (phalanx-mpi) for MPI, "
                "or backend='gloo'"
                if backend == "mpi"
                else "install a torch build with it, or choose another backend"
            )
        )
    return backend


#: Device types torch itself has (``torch.device(...).type``).
_TORCH_DEVICE_TYPES = frozenset({"cpu", "cuda", "mps", "xla", "xpu", "hpu", "meta", "mtia", "privateuseone"})


def check_backend_moves(backend: str, accelerator: Accelerator) -> None:
    """Refuse ``backend`` (in lower case) unless this torch has it and it
    moves the tensors of ``accelerator``'s devices (nccl moves CUDA tensors
    only)."""
    device = _DEVICE_ONLY.get(backend)
    device_type = accelerator.device_type
    if device is not None and device_type != device:
        raise MisconfigurationError(
            f"collective 'torch' with backend={backend!r} and accelerator {accelerator.name!r}: "
            f"{backend} moves {device} tensors only; use backend='gloo' (the default for "
            f"{accelerator.name!r}), or accelerator={device!r}"
        )
    check_backend(backend)
    # What torch says each backend moves ({'gloo': ['cpu', 'cuda'], ...});
    # a backend a plugin registered without saying is taken at its word.
    capability = getattr(dist.Backend, "backend_capability", {})
    moves = capability.get(backend)
    if moves and device_type not in moves:
        others = [b for b, m in capability.items() if device_type in m and b != "fake"]
        cure = (
            f"use backend={others[0]!r}, which does"
            if others
            else "no backend of this torch does, so a parallel strategy cannot run on "
            f"{accelerator.name!r}: train on accelerator='cpu' (or 'cuda'), or use strategy "
            "'single_device' for one device"
        )
        if device_type == accelerator.name and device_type not in _TORCH_DEVICE_TYPES:
            cure += (
                f". If the devices of {accelerator.name!r} are of a type torch knows (its get_device "
                "gives torch.device('cpu'), say), set device_type to it in the accelerator's class "
                "(device_type = 'cpu'): the name stands for it where the class does not say"
            )
        raise MisconfigurationError(
            f"collective 'torch' with backend={backend!r} and accelerator {accelerator.name!r} (devices of "
            f"type {device_type!r}): torch.distributed's {backend} moves {' and '.join(moves)} tensors "
            f"only; {cure}"
        )


def bound_device(backend: str) -> dict[str, Any]:
    """nccl's group bound to this rank's GPU (the strategy set it before the
    group is made), as torch asks: without it every ``barrier`` warns that
    it guesses the device. Where torch has ``device_id`` (2.3 on)."""
    if backend != "nccl" or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return {}
    if "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": torch.device("cuda", torch.cuda.current_device())}
