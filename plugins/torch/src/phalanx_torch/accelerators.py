"""Accelerators over torch devices."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from phalanx_core import Accelerator, Availability, MisconfigurationError
from phalanx_core.accelerator import DevicesFlag

__all__ = ["CPUAccelerator", "CUDAAccelerator", "MPSAccelerator"]


class CPUAccelerator(Accelerator):
    """The CPU. ``devices=N`` means N processes, all on the CPU (one device
    each in the strategy's terms); ``"auto"`` and ``-1`` mean one."""

    name: ClassVar[str] = "cpu"
    collective_backend: ClassVar[str | None] = "gloo"

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def device_count(cls) -> int:
        return 1

    def get_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def parallel_devices(self, devices: DevicesFlag) -> list[torch.device]:
        if devices in ("auto", -1, "-1"):
            return [torch.device("cpu")]
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
            return [torch.device("cpu")] * devices
        raise MisconfigurationError(
            f"accelerator='cpu' with devices={devices!r}: on the CPU, devices is the number of "
            "processes (an int of at least 1, or 'auto'); device indices mean nothing there"
        )


class CUDAAccelerator(Accelerator):
    """NVIDIA GPUs through ``torch.cuda``; collectives default to ``nccl``.

    ``devices`` picks GPUs by count (``2``: the first two), index list
    (``[0, 3]``, ``"0,3"``), or all of them (``-1``, ``"auto"``). Refused
    in its constructor where there is no usable GPU, with the reason.
    """

    name: ClassVar[str] = "cuda"
    collective_backend: ClassVar[str | None] = "nccl"

    def __init__(self) -> None:
        self.check_available()

    @classmethod
    def availability(cls) -> Availability:
        if torch.version.cuda is None:
            if torch.backends.mps.is_available():
                return Availability(
                    False,
                    f"this torch build ({torch.__version__}) has no CUDA support, and this machine's GPU "
                    "is Apple's: use accelerator='mps' ('gpu' is another name for 'cuda' here; phalanx "
                    "does not turn it into 'mps' for you)",
                )
            return Availability(
                False,
                f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of "
                "torch, or use accelerator='cpu'",
            )
        # device_count() asks NVML first and leaves this process fit to fork;
        # torch.cuda.is_available() would call cudaGetDeviceCount, after which
        # a forked child (ddp_fork, ddp_notebook) can no longer use CUDA.
        if torch.cuda.device_count() < 1:
            return Availability(
                False,
                f"no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda}; "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!s}); check "
                "the driver with nvidia-smi, or use accelerator='cpu'",
            )
        return Availability(True)

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count()

    def get_device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def setup_device(self, device: Any) -> None:
        in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
        if in_bad_fork():
            raise MisconfigurationError(
                "accelerator 'cuda': this process was forked from one that had already used CUDA "
                "(torch.cuda.is_available(), a tensor on a GPU, torch.cuda.* calls), and a forked "
                "child cannot use CUDA. Use a launcher that starts fresh processes (strategy "
                "'ddp_spawn', or launcher='spawn'), or make no CUDA call before strategy.launch(...); "
                "with PYTORCH_NVML_BASED_CUDA_CHECK=1 set, torch.cuda.is_available() leaves the "
                "process fit to fork"
            )
        torch.cuda.set_device(device)

    def teardown(self) -> None:
        torch.cuda.empty_cache()


class MPSAccelerator(Accelerator):
    """Apple silicon GPUs through ``torch.backends.mps``: one device; the
    collectives default to ``gloo``. Refused in its constructor where MPS is
    not available, with the reason."""

    name: ClassVar[str] = "mps"
    collective_backend: ClassVar[str | None] = "gloo"

    def __init__(self) -> None:
        self.check_available()

    @classmethod
    def availability(cls) -> Availability:
        if not torch.backends.mps.is_built():
            return Availability(
                False, f"this torch build ({torch.__version__}) has no MPS support (macOS only)"
            )
        if not torch.backends.mps.is_available():
            return Availability(False, "MPS is built but not available (needs macOS 12.3+ on Apple silicon)")
        return Availability(True)

    @classmethod
    def device_count(cls) -> int:
        return 1 if torch.backends.mps.is_available() else 0

    def get_device(self, index: int) -> torch.device:
        return torch.device("mps", index)
