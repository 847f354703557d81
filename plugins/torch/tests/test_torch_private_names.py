"""The private names of torch that phalanx-torch uses, each checked against
the torch installed, so that a release that renames or reshapes one fails
here, by name, rather than in a job: one a module, none in the launcher
(its agent loop stands on elastic's public API, whose parts it uses
``test_rank_loop.py`` checks). CI runs this file on each end of the
supported range."""

from __future__ import annotations

import inspect

import torch.distributed as dist


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_default_store_of_the_default_group():
    # _collective.torch_collective (the group's store address) and process_group.
    assert parameters(dist.distributed_c10d._get_default_store) == []


def test_sync_module_states():
    # fsdp.py: FSDP's own broadcast of rank 0's module states.
    from torch.distributed.utils import _sync_module_states

    assert parameters(_sync_module_states)[:4] == ["module", "process_group", "broadcast_bucket_size", "src"]


def test_nccl_premul_sum():
    # _torch_versions: NCCL's pre-multiplied sum (a ReduceOp made with a factor).
    assert callable(dist._make_nccl_premul_sum)
