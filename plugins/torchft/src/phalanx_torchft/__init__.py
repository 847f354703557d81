"""TorchFT for phalanx: training that goes on in place when a replica group
is lost.

``ddp_ft`` (:class:`~phalanx_torchft.strategy.DDPFTStrategy`) is data
parallel across *replica groups*; TorchFT's ``Manager`` agrees on every
step's members through a lighthouse, drops a group that is gone at the
next step, and heals a group that comes back from a healthy peer.
``local_sgd_ft``, ``diloco_ft`` and ``diloco_hsdp_ft`` (FSDP within a
group; :mod:`phalanx_torchft.windowed`) sync the groups once a window of
steps (TorchFT's ``LocalSGD`` and ``DiLoCo``), for slow links between them.
``replica_groups`` (:class:`~phalanx_torchft.launcher.ReplicaGroupsLauncher`)
starts the lighthouse and the groups and restarts a group that dies.
:class:`QuorumLoader` (what ``setup_dataloader`` returns) deals each
step's samples out over the groups in the step.
Importing this package imports neither torch nor torchft.
"""

from __future__ import annotations

from ._loader import QuorumLoader
from .errors import JobFinishedError, NoQuorumError

__all__ = ["JobFinishedError", "NoQuorumError", "QuorumLoader"]
