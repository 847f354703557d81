"""horovod.torch, imported when a part is used, and what the parts share:
the tensor dtypes Horovod moves, and names for its operations."""

from __future__ import annotations

from typing import Any

from phalanx_core import UnavailableError

from .plugin import INSTALL

#: Text in the last line of a rank's traceback when its error was caused by a
#: peer that failed first, beside :data:`phalanx_core.launching.PEER_LOST_MARKS`
#: (a torch group's lost connections, a collective's timeout): Horovod shuts
#: down on every rank when one leaves.
PEER_LOST = ("HorovodInternalError", "Horovod has been shut down")


def hvd() -> Any:
    """``horovod.torch``, or :class:`UnavailableError` saying how to install it."""
    try:
        import horovod.torch as module  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError as exc:  # the registry checks `needs` first; this is for direct use
        raise UnavailableError(
            f"the 'horovod' parts (phalanx-horovod) need horovod with its PyTorch extension, which "
            f"cannot be imported here ({type(exc).__name__}: {exc}); {INSTALL}"
        ) from exc
    return module


def on_wire(tensor: Any, *, reduce: bool) -> Any:
    """``tensor`` as Horovod can move it on the CPU: contiguous, and in a dtype
    it has (uint8/int8/int16/int32/int64/float16/float32/float64 for moving,
    int32/int64/float16/float32/float64 for reducing). Moving, a bool tensor
    travels as a uint8 view and a bfloat16 one as an int16 view (the same
    bits); reducing, both travel as copies (int32, float32) and narrow
    integers as int32. The result shares ``tensor``'s memory where it can."""
    import torch

    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    if reduce:
        if t.dtype is torch.bool or t.dtype in (torch.uint8, torch.int8, torch.int16):
            return t.to(torch.int32)
        if t.dtype is torch.bfloat16:
            return t.to(torch.float32)
        return t
    if t.dtype is torch.bool:
        return t.view(torch.uint8)
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16)
    return t


def off_wire(wire: Any, dtype: Any) -> Any:
    """What :func:`on_wire` made, back in ``dtype`` (a view where it was one)."""
    import torch

    if wire.dtype is dtype:
        return wire
    if dtype is torch.bool:
        return wire.view(torch.bool) if wire.dtype is torch.uint8 else wire.to(torch.bool)
    if dtype is torch.bfloat16 and wire.dtype is torch.int16:
        return wire.view(torch.bfloat16)
    return wire.to(dtype)
