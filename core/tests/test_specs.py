from __future__ import annotations

import dataclasses

import pytest

from phalanx_core import CollectiveSpec, Kind, LauncherSpec, StrategySpec


def test_specs_are_frozen_data_with_their_kind():
    spec = CollectiveSpec(name="mine", target="pkg.mod:Cls", needs=["torch"], options={"timeout": 5})
    assert spec.kind is Kind.COLLECTIVE
    assert spec.needs == ("torch",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.options["timeout"] = 6  # type: ignore[index]
    assert StrategySpec(name="s", target="a:B").launcher == "in_process"
    assert LauncherSpec(name="l", target="a:B").creates_processes is True


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "torch:ddp", "target": "a:B"}, "not a valid name"),
        ({"name": "", "target": "a:B"}, "not a valid name"),
        ({"name": "ok", "target": "a.B"}, "not of the form 'package.module:attribute'"),
        ({"name": "ok", "target": "a:B", "needs": "torch"}, "needs must be a tuple of import names"),
        ({"name": "ok", "target": "a:B", "options": [1]}, "options must be a mapping"),
        ({"name": "ok", "target": "a:B", "priority": "high"}, "priority must be an int"),
        ({"name": "ok", "target": "a:B", "aliases": ("x:y",)}, "alias 'x:y' is not a valid name"),
    ],
)
def test_bad_specs_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CollectiveSpec(**kwargs)


def test_a_strategy_says_where_its_traffic_goes_per_collective():
    spec = StrategySpec(
        name="s", target="a:B", traffic={"mine": "its own wire", "*": "the {collective!r} collective"}
    )
    assert spec.traffic_through("mine") == "its own wire"
    assert spec.traffic_through("theirs") == "the 'theirs' collective"
    with pytest.raises(TypeError):
        spec.traffic["x"] = "y"  # type: ignore[index]
    assert StrategySpec(name="s", target="a:B").traffic_through("mine") is None
    with pytest.raises(ValueError, match="traffic must map collective names"):
        StrategySpec(name="s", target="a:B", traffic={"mine": 3})  # type: ignore[dict-item]


def test_a_strategy_names_its_variants_in_other_libraries():
    spec = StrategySpec(name="s", target="a:B", variants={"s_fast": {"fast": True}})
    assert dict(spec.variants["s_fast"]) == {"fast": True}
    with pytest.raises(ValueError, match="variants must map names to the resolve"):
        StrategySpec(name="s", target="a:B", variants={"s_fast": True})  # type: ignore[dict-item]
