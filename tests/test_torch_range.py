"""The supported torch range is said the same way everywhere: in every
plugin's ``torch`` extra (what pip reads), in its parts' specs (what the
registry checks), and at the oldest end of what CI runs (``noxfile.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import phalanx
from phalanx_core import Need
from phalanx_torch.plugin import TORCH

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))


def torch_in_extras(pyproject: Path) -> set[str]:
    """Every ``torch`` requirement of the distribution's extras (the only
    place a plugin's pyproject.toml names torch with a version)."""
    return {"".join(r.split()) for r in re.findall(r'"(torch\s*[<>=!][^"]*)"', pyproject.read_text())}


def torch_in_specs(distribution: str) -> set[str]:
    registry = phalanx.Registry()
    return {
        "".join(text.split())
        for entry in registry.entries()
        if entry.provider.distribution == distribution
        for text in entry.spec.needs
        if Need.parse(text).name == "torch"
    }


@pytest.mark.parametrize("plugin", PLUGINS, ids=[p.name for p in PLUGINS])
def test_a_plugins_extra_and_its_specs_say_the_same_torch(plugin):
    name = re.search(r'^name = "([^"]+)"$', (plugin / "pyproject.toml").read_text(), re.M).group(1)
    extras, specs = torch_in_extras(plugin / "pyproject.toml"), torch_in_specs(name)
    assert len(specs) == 1, f"{name}: its specs say {specs or 'nothing'} of torch; say one range"
    [range_] = specs
    # The extra says the same, or pins a release inside it (phalanx-xla:
    # torch_xla 2.9.0 needs exactly torch 2.9.0).
    for extra in extras:
        pinned = re.fullmatch(r"torch==([\d.]+)", extra)
        assert extra == range_ or (pinned and Need.parse(range_).admits(pinned.group(1))), (
            f"{name}: its torch extra says {extra}, its specs {range_}"
        )
    assert extras, f"{name}: no extra installs torch"


def test_the_oldest_torch_ci_runs_is_the_floor_of_the_range():
    floor = re.fullmatch(r"torch>=([\d.]+)", TORCH)
    assert floor, TORCH
    noxfile = (ROOT / "noxfile.py").read_text()
    oldest = re.search(r'^TORCH_RANGE = \["([\d.]+)", "([\d.]+)"\]$', noxfile, re.M)
    assert oldest, "noxfile.py: TORCH_RANGE = [oldest, newest]"
    assert Need.parse(TORCH).admits(oldest.group(1))
    assert oldest.group(1).startswith(floor.group(1))
