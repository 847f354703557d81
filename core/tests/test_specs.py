from __future__ import annotations

import dataclasses

import pytest

from phalanx_core import CollectiveSpec, Kind, LauncherSpec, Need, StrategySpec


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
        ({"name": "ok", "target": "a:B", "needs": ("torch>2.9.x",)}, "'>2.9.x' is not a version clause"),
        ({"name": "ok", "target": "a:B", "needs": ("~=2.9",)}, "does not start with an import name"),
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


def test_collectives_declare_and_strategies_need_fault_tolerance_capabilities():
    collective = CollectiveSpec(name="c", target="a:B", fault_tolerance=["reconfigure", "liveness"])
    assert collective.fault_tolerance == ("liveness", "reconfigure")
    assert CollectiveSpec(name="c", target="a:B").fault_tolerance == ()
    strategy = StrategySpec(name="s", target="a:B", collective_needs=("reconfigure", "liveness"))
    assert strategy.collective_needs == ("liveness", "reconfigure")
    with pytest.raises(
        ValueError, match=r"CollectiveSpec 'c': fault_tolerance: 'heal' is no fault-tolerance"
    ):
        CollectiveSpec(name="c", target="a:B", fault_tolerance=("heal",))
    with pytest.raises(ValueError, match=r"StrategySpec 's': collective_needs: 'quorum' is no"):
        StrategySpec(name="s", target="a:B", collective_needs=("quorum",))


def test_a_strategy_names_its_variants_in_other_libraries():
    spec = StrategySpec(name="s", target="a:B", variants={"s_fast": {"fast": True}})
    assert dict(spec.variants["s_fast"]) == {"fast": True}
    with pytest.raises(ValueError, match="variants must map names to the resolve"):
        StrategySpec(name="s", target="a:B", variants={"s_fast": True})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("need", "version", "admitted"),
    [
        ("torch>=2.9", "2.9.0", True),
        ("torch>=2.9", "2.9", True),
        ("torch>=2.9", "2.13.0+cpu", True),
        ("torch>=2.9", "2.10.0.dev20250801", True),
        ("torch>=2.9", "2.8.1", False),
        ("torch>=2.9", "2.5.1+cu124", False),
        ("torch>=2.9", "10.0", True),
        ("torch>=2.9,<2.14", "2.14.0", False),
        ("torch>=2.9,<2.14", "2.13.99", True),
        ("torch==2.9.0", "2.9.0+cu128", True),
        ("torch==2.9.0", "2.9.1", False),
        ("torch!=2.10", "2.10.0", False),
        ("torch<=2.10", "2.10.0", True),
        ("torch>2.10", "2.10.0", False),
        ("torch", "0.1", True),
        ("torch>=2.9", "unknown", True),  # no release number: nothing to say
    ],
)
def test_a_need_admits_the_versions_its_clauses_say(need, version, admitted):
    assert Need.parse(need).admits(version) is admitted


def test_a_need_reads_back_as_written_without_spaces():
    need = Need.parse(" torch >= 2.9 , < 3 ")
    assert (need.name, need.versions, str(need)) == ("torch", ">=2.9,<3", "torch>=2.9,<3")
    assert Need.parse("torch_xla").versions == ""
