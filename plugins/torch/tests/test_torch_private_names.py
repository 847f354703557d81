"""The private names of torch that phalanx's packages use, each checked
against the torch installed, so that a release that renames or reshapes
one fails here, by name, rather than in a job. They are listed, with why
no public route serves, in ``phalanx_torch._torch_private``, the only
module that uses them (``.ci/house_counts.py`` counts every package); CI
runs this file on each end of the supported range."""

from __future__ import annotations

import inspect
import pathlib
import re

import torch.distributed as dist
from torch.distributed import distributed_c10d

import phalanx_torch._torch_private as private

ROOT = pathlib.Path(__file__).resolve().parents[3]


def parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_a_group_is_entered_in_torchs_registry_by_one_name_or_the_two_before_it():
    if hasattr(distributed_c10d, "_register_pg_in_world"):  # torch 2.13 on
        assert parameters(distributed_c10d._register_pg_in_world)[:6] == [
            "pg",
            "backend_name",
            "store",
            "group_name",
            "backend_config",
            "rank_mapping",
        ]
    else:
        world = distributed_c10d._world
        for table in ("pg_map", "pg_names", "pg_backend_config", "pg_group_ranks", "tags_to_pg", "pg_to_tag"):
            assert isinstance(getattr(world, table), dict), table
        assert callable(distributed_c10d._register_process_group)


class Named(dist.ProcessGroup):
    """A Python group with its own name, as CollectiveProcessGroup is."""

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return "phalanx-test:0"


def test_a_group_entered_is_torchs_until_destroyed():
    # What enter_group promises, on the torch installed: torch's helpers
    # accept the group, and the public destroy_process_group takes it out.
    pg = Named(0, 1)
    private.enter_group(pg, "phalanx-test", dist.HashStore(), "phalanx-test:0", {0: 0})  # type: ignore[attr-defined]
    try:
        assert dist.get_process_group_ranks(pg) == [0]
        assert dist.get_backend(pg) == "phalanx-test"
    finally:
        dist.destroy_process_group(pg)
    assert pg not in distributed_c10d._world.pg_map


def test_no_other_module_of_any_package_uses_a_private_name_of_torch():
    pattern = re.compile(
        r"\b(?:torch(?:\.\w+)*|c10d|distributed_c10d|dist)\.(_[a-z]\w*)|from torch\S* import .*\b_[a-z]"
    )
    found = []
    for path in [
        *ROOT.glob("core/src/**/*.py"),
        *ROOT.glob("registry/src/**/*.py"),
        *ROOT.glob("plugins/*/src/**/*.py"),
    ]:
        if path.name == "_torch_private.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and "__" not in pattern.search(code).group(0):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
