"""Collectives over torch tensors: ``torch`` (:class:`TorchCollective`, over
``torch.distributed``) and ``single_device`` (:class:`SingleDeviceCollective`,
a world of one process).

Each lives in its own module; this one is where the plugin's specs, and
code of one's own, find them (``phalanx_torch.collectives:TorchCollective``).
"""

from __future__ import annotations

from ._collective.single_device_collective import SingleDeviceCollective
from ._collective.torch_collective import TorchCollective

__all__ = ["SingleDeviceCollective", "TorchCollective"]
