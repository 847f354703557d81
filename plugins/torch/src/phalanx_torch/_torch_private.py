"""Every private name of torch that phalanx's packages use, here and
nowhere else, each with why no public route serves
(``plugins/torch/tests/test_torch_private_names.py`` checks each against
the torch installed; CI runs it on both ends of the supported range).
``.ci/house_counts.py`` counts them: three.

- ``distributed_c10d._register_pg_in_world`` (torch 2.13 and later):
  enters a process group made outside ``new_group`` in torch's registry,
  so that ``get_rank(group)``, ``DeviceMesh.from_group`` and DTensor accept
  it. The public route, ``Backend.register_backend`` and ``new_group``,
  names the group by a counter every rank of the world must advance alike
  (a group over some ranks, registered on those only, would shift the
  names of the user's own later groups, which gloo and NCCL meet by) or,
  with ``use_local_synchronization``, by its ranks (two groups over the
  same ranks collide): it cannot enter a group that only its own ranks
  make. (The default group's place has a public route:
  ``init_process_group`` with a registered backend;
  :meth:`~phalanx_torch.process_group.CollectiveProcessGroup.register`
  takes it.)
- ``distributed_c10d._world`` and ``distributed_c10d._register_process_group``
  (torch before 2.13): what ``_register_pg_in_world`` does, by hand.

Imports torch.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["enter_group"]


def enter_group(group: dist.ProcessGroup, backend: str, store: Any, name: str, ranks: dict[int, int]) -> None:
    """Enter ``group`` (named ``name``, of backend ``backend``, whose
    global rank -> group rank mapping is ``ranks``) in torch's registry;
    ``dist.destroy_process_group(group)`` takes it out."""
    named: Any = name  # torch types it GroupName (a NewType of str) from 2.13
    if hasattr(distributed_c10d, "_register_pg_in_world"):  # torch 2.13 on
        distributed_c10d._register_pg_in_world(group, backend, store, named, backend, rank_mapping=ranks)
        return
    world = distributed_c10d._world
    world.pg_map[group] = (backend, store)
    world.pg_names[group] = named
    world.pg_backend_config[group] = backend
    world.pg_group_ranks[group] = ranks
    world.tags_to_pg.setdefault(f"ptd:{name}", []).append(group)
    world.pg_to_tag[group] = f"ptd:{name}"
    distributed_c10d._register_process_group(named, group)  # type: ignore[attr-defined]
