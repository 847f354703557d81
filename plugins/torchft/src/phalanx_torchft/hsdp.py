"""``hsdp_ft``: FSDP within each TorchFT replica group, fault tolerant
across groups (hybrid sharding whose replicated dimension comes and goes)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from phalanx_core import SaveHandle
from phalanx_torch.fsdp import FSDPStrategy

from .strategy import FaultTolerant

__all__ = ["HSDPFTStrategy"]


class HSDPFTStrategy(FaultTolerant, FSDPStrategy):
    """FSDP (torch's ``fully_shard``) within each replica group, data
    parallel across groups that come and go (:class:`FaultTolerant`): the
    parameters, gradients and optimizer state are sharded over a group's
    ranks, and each shard's gradient is averaged over the step's groups
    (rank r of every group holds shard r) by FSDP's all-reduce hook, after
    the group's reduce-scatter. A group that heals copies its peers' shards
    rank by rank.

    Options: :class:`FaultTolerant`'s and FSDP's (``shard_modules``,
    ``mp_policy``, ``state_dict_type``, ...). As under ``fsdp``, ``setup``
    takes optimizer factories (``functools.partial(torch.optim.AdamW,
    lr=1e-3)``). Checkpoints are written by one group, the one that leads
    the step's quorum (a sharded checkpoint: each of its ranks writes its
    shards; full: its rank 0), and read by every group.
    """

    name: ClassVar[str] = "hsdp_ft"
    #: A step waits for its quorum before its forward pass: a healing
    #: peer's copy of the shards is read from FSDP's ``state_dict()`` in
    #: TorchFT's quorum thread, which in the middle of a forward or backward
    #: pass changes FSDP's state under it (the ranks of a group can then
    #: wait in different collectives for good).
    compute_during_quorum: ClassVar[bool] = False
    traffic: ClassVar[frozenset[str]] = frozenset({"all_gather", "reduce_scatter", "all_reduce", "broadcast"})

    def setup_module(self, module: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        sharded = super().setup_module(module)
        for unit in sharded.modules():
            if isinstance(unit, FSDPModule):
                unit.set_all_reduce_hook(self._average_over_groups)
        return sharded

    def _average_over_groups(self, shard: Any) -> None:
        """FSDP's all-reduce hook: the group's reduced gradient shard (this
        rank's part of a unit's gradients) averaged over the step's groups,
        in place. TorchFT drops a failed step instead of raising."""
        self.open_step()
        self.wait_quorum()  # where none comes, the named error (TorchFT's raises its client's)
        self.manager.allreduce(shard).wait()

    def save_checkpoint(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, blocking: bool = True
    ) -> SaveHandle:
        """As ``fsdp``'s, written by the group that leads the step's quorum
        (every rank of every group calls it at the same step, after
        ``optimizer_step``); the other groups' call returns at once."""
        if not self._leads():
            return SaveHandle.finished(path)
        return super().save_checkpoint(path, state, blocking=blocking)
