"""Resolution with the installed phalanx-torch plugin: flags, plans, builds."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import phalanx
from phalanx_core import (
    AcceleratorSpec,
    MisconfigurationError,
    StrategySpec,
    UnavailableError,
    UnknownNameError,
    hookimpl,
)


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.delenv("PHALANX_PLUGINS", raising=False)
    monkeypatch.delenv("PHALANX_DISABLE_PLUGINS", raising=False)
    return phalanx.Registry()


def test_single_device_plan_names_every_part_with_its_reason(registry):
    plan = registry.plan("single_device", accelerator="cpu")
    parts = {str(c.kind): c for c in plan.parts()}
    assert {k: c.name for k, c in parts.items()} == {
        "strategy": "single_device",
        "accelerator": "cpu",
        "environment": "local",
        "precision": "32-true",
        "collective": "single_device",
        "launcher": "in_process",
    }
    assert parts["strategy"].reason == "asked for"
    assert parts["collective"].reason == "the strategy's default"
    assert parts["environment"].reason.startswith("detected")
    assert all(c.provider.distribution == "phalanx-torch" for c in plan.parts())
    text = plan.explain()
    assert "collective   single_device  'torch' (phalanx-torch 0.1.0)  the strategy's default" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["parts"]["launcher"]["distribution"] == "phalanx-torch"


def test_auto_chooses_by_availability_and_says_why(registry):
    plan = registry.plan()
    assert plan.accelerator.name == "cpu"
    assert plan.accelerator.reason.startswith("auto:")
    assert plan.strategy.name == "single_device"
    assert plan.strategy.reason.startswith("auto:")


def test_resolve_builds_the_parts(registry):
    from phalanx_torch.collectives import SingleDeviceCollective
    from phalanx_torch.strategies import SingleDeviceStrategy

    strategy = registry.resolve("single_device", accelerator="cpu")
    assert isinstance(strategy, SingleDeviceStrategy)
    assert isinstance(strategy.collective, SingleDeviceCollective)
    assert strategy.world_size == 1 and strategy.global_rank == 0 and strategy.is_global_zero
    assert str(strategy.root_device) == "cpu"


def test_qualified_names_and_aliases(registry):
    plan = registry.plan("phalanx-torch:single_device", accelerator="phalanx_torch:cpu", precision=32)
    assert plan.strategy.name == "single_device"
    assert plan.precision.name == "32-true"


def test_instances_are_used_as_given(registry):
    from phalanx_torch.collectives import SingleDeviceCollective

    mine = SingleDeviceCollective(timeout=5)
    strategy = registry.resolve("single_device", accelerator="cpu", collective=mine)
    assert strategy.collective is mine
    again = registry.resolve(strategy)
    assert again is strategy
    with pytest.raises(MisconfigurationError, match="already has its parts; you also passed collective"):
        registry.resolve(strategy, collective="single_device")


@pytest.mark.parametrize(
    ("kind", "flags"),
    [
        ("strategy", {"strategy": "dpp"}),
        ("accelerator", {"accelerator": "quantum"}),
        ("precision", {"precision": "bf17-mixed"}),
        ("collective", {"collective": "nccl2"}),
        ("launcher", {"launcher": "rocket"}),
        ("environment", {"environment": "mars"}),
    ],
)
def test_unknown_names_list_what_exists(registry, kind, flags):
    flags = {"strategy": "single_device", "accelerator": "cpu", **flags}
    with pytest.raises(UnknownNameError) as info:
        registry.plan(flags.pop("strategy"), **flags)
    message = str(info.value)
    assert f"unknown {kind}" in message
    assert f"The {kind} names that exist: " in message
    assert "phalanx list" in message


def test_unknown_name_lists_failed_plugins(monkeypatch, phalanx_distribution):
    phalanx_distribution(
        "phalanx-broken",
        entry_points={"broken": "phalanx_broken"},
        modules={"phalanx_broken": "import no_such_module_here\n"},
    )
    registry = phalanx.Registry()
    with pytest.raises(
        UnknownNameError, match=r"failed to load.*'broken' \(phalanx-broken 0.1.0\).*no_such_module_here"
    ):
        registry.plan("no_such_strategy")  # "horovod" is a name now: phalanx-horovod gives it


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"strategy": 3}, r"strategy=3: expected a name \(str\) or a Strategy instance, got int"),
        ({"accelerator": None}, r"accelerator=None: name one, or pass 'auto'"),
        ({"accelerator": 1.5}, r"accelerator=1.5: expected a name"),
        ({"precision": True}, r"precision=True: expected a name"),
        ({"precision": 16.0}, r"precision=16.0: expected a name"),
        ({"collective": ["torch"]}, r"collective=\['torch'\]: expected a name"),
        ({"launcher": object}, r"launcher=<class 'object'>: expected a name"),
        ({"devices": 2.5}, r"devices=2.5: expected an int, a list of ints"),
        ({"devices": True}, r"devices=True: expected an int"),
        ({"devices": [0, "1"]}, r"devices=\[0, '1'\]: expected an int"),
        ({"devices": 0}, r"devices=0 asks for no device"),
        ({"devices": []}, r"devices=\[\] asks for no device"),
        ({"num_nodes": 0}, r"num_nodes=0: expected an int of at least 1"),
        ({"num_nodes": "2"}, r"num_nodes='2': expected an int of at least 1"),
    ],
)
def test_flags_of_the_wrong_type(registry, flags, match):
    flags = {"strategy": "single_device", "accelerator": "cpu", **flags}
    with pytest.raises(MisconfigurationError, match=match):
        registry.plan(flags.pop("strategy"), **flags)


def test_impossible_combinations_are_refused_before_building(registry):
    with pytest.raises(MisconfigurationError, match=r"'single_device' runs on one device .* devices=2"):
        registry.plan("single_device", accelerator="cpu", devices=2)
    with pytest.raises(MisconfigurationError, match=r"num_nodes=2 ask for more"):
        registry.plan("single_device", accelerator="cpu", num_nodes=2)
    plan = registry.plan(accelerator="cpu", devices=4)  # auto picks a parallel strategy
    assert plan.strategy.name == "ddp"
    assert plan.strategy.reason == "auto: the parallel strategy of highest priority"

    class OnlySingle:  # a plugin with a CPU and no parallel strategy
        @hookimpl
        def phalanx_accelerators(self):
            return [AcceleratorSpec(name="cpu", target="phalanx_torch.accelerators:CPUAccelerator")]

        @hookimpl
        def phalanx_strategies(self):
            return [StrategySpec(name="one", target="phalanx_torch.strategies:SingleDeviceStrategy")]

    only_single = phalanx.Registry(plugins=[OnlySingle()], autoload=False)
    with pytest.raises(MisconfigurationError, match=r"found no parallel strategy for accelerator 'cpu'"):
        only_single.plan(accelerator="cpu", devices=4)


def test_unknown_strategy_options_are_refused(registry):
    with pytest.raises(
        MisconfigurationError,
        match=r"option find_unused=True is taken by no part of this plan\. What each part takes: .*collective "
        r"'single_device' takes timeout",
    ):
        registry.resolve("single_device", accelerator="cpu", find_unused=True)


def test_a_strategy_restricted_to_accelerators_refuses_others(registry):
    registry.register(
        StrategySpec(
            name="tpu_only", target="phalanx_torch.strategies:SingleDeviceStrategy", accelerators=("xla",)
        )
    )
    with pytest.raises(MisconfigurationError, match=r"'tpu_only' works with accelerator\(s\) xla, not 'cpu'"):
        registry.plan("tpu_only", accelerator="cpu")
    with pytest.raises(
        UnavailableError, match=r"accelerator='auto' found no available accelerator among xla"
    ):
        registry.plan("tpu_only")


def test_run_time_registration_is_used_by_name(registry):
    registry.register(
        StrategySpec(name="mine", target="phalanx_torch.strategies:SingleDeviceStrategy", summary="mine")
    )
    plan = registry.plan("mine", accelerator="cpu")
    assert plan.strategy.provider.distribution is None
    assert "registered at run time" in plan.explain()
    assert registry.build(plan).world_size == 1


def test_a_target_of_the_wrong_class_is_a_plugin_error(registry):
    from phalanx_core import CollectiveSpec, PluginError

    registry.register(
        CollectiveSpec(name="notacollective", target="phalanx_torch.strategies:SingleDeviceStrategy")
    )
    with pytest.raises(PluginError, match=r"not a subclass of phalanx_core.Collective"):
        registry.resolve("single_device", accelerator="cpu", collective="notacollective")


def test_in_process_launcher_refuses_several_processes_nobody_made(registry):
    with pytest.raises(MisconfigurationError, match=r"launcher 'in_process' runs in this one process"):
        from phalanx_torch.launchers import InProcessLauncher

        InProcessLauncher(num_processes=2)


def test_default_registry_and_module_level_resolve():
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    assert phalanx.default_registry() is phalanx.default_registry()
    assert strategy.world_size == 1


@pytest.fixture
def elastic_rank(monkeypatch):
    """The variables torchrun (or the subprocess launcher) gives a rank."""
    values = {
        "TORCHELASTIC_RUN_ID": "r1",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_a_named_subprocess_launcher_runs_in_its_own_ranks(registry, elastic_rank):
    plan = registry.plan("ddp", accelerator="cpu", devices=2, launcher="subprocess")
    assert plan.environment.name == "torchelastic"
    assert plan.launcher.name == "subprocess"
    assert plan.launcher.reason == "asked for; it runs fn in the processes 'torchelastic' already started"
    assert registry.plan("ddp", accelerator="cpu", devices=2).launcher.name == "in_process"


def test_a_launcher_that_would_start_more_processes_is_refused(registry, elastic_rank):
    with pytest.raises(
        MisconfigurationError, match=r"launcher='spawn' creates processes, but environment 'torchelastic'"
    ):
        registry.plan("ddp", accelerator="cpu", devices=2, launcher="spawn")


def test_flags_beside_a_ready_strategy_are_applied_or_refused_never_dropped():
    ready = phalanx.resolve("ddp", accelerator="cpu", devices=2)
    assert phalanx.resolve(ready, devices=2, num_nodes=1) is ready  # what it was built with
    assert phalanx.resolve(ready, devices="auto") is ready
    for flags, words in (
        ({"num_nodes": 2}, "built for devices=2, num_nodes=1, and you also passed num_nodes=2"),
        ({"devices": 3}, "you also passed devices=3"),
        ({"precision": "32-true"}, "you also passed precision"),
    ):
        with pytest.raises(MisconfigurationError, match=re.escape(words)):
            phalanx.resolve(ready, **flags)


def test_an_explicit_precision_is_explicit_even_the_default():
    from phalanx_torch.precisions import MixedPrecision

    with pytest.raises(MisconfigurationError, match=r"the precision is given twice: precision='32-true'"):
        phalanx.resolve("single_device", accelerator="cpu", precision="32-true", plugins=[MixedPrecision()])
    strategy = phalanx.resolve("single_device", accelerator="cpu", plugins=[MixedPrecision()])
    assert strategy.precision.accelerator is strategy.accelerator  # bound to the strategy's


def test_a_ready_precision_is_checked_against_the_accelerator():
    from phalanx_torch.precisions import MixedPrecision16

    with pytest.raises(MisconfigurationError, match=r"'16-mixed' on accelerator 'cpu'.*bf16-mixed"):
        phalanx.resolve("ddp", accelerator="cpu", devices=2, plugins=[MixedPrecision16()])


def test_auto_in_a_notebook_picks_a_strategy_whose_launcher_works_there():
    # `python -c` is what a notebook is to phalanx: no script to re-run.
    code = (
        "import phalanx\n"
        "plan = phalanx.plan(accelerator='cpu', devices=2)\n"
        "print(plan.strategy.name, plan.launcher.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["ddp_notebook", "fork"], out.stderr


def test_a_stray_plugin_giving_the_same_names_takes_no_default_away(phalanx_distribution):
    """Issue 31, item 2: another plugin gives a collective 'torch' and a
    launcher 'subprocess'. A strategy's defaults come from the plugin that gave the
    strategy ('ddp' meant phalanx-torch's own parts); a name the user types
    stays ambiguous, and is refused naming both."""
    phalanx_distribution(
        "phalanx-stray",
        entry_points={"stray": "phalanx_stray"},
        modules={
            "phalanx_stray": (
                "from phalanx_core import CollectiveSpec, LauncherSpec, hookimpl\n"
                "@hookimpl\n"
                "def phalanx_collectives():\n"
                "    return [CollectiveSpec(name='torch', target='phalanx_stray.impl:C')]\n"
                "@hookimpl\n"
                "def phalanx_launchers():\n"
                "    return [LauncherSpec(name='subprocess', target='phalanx_stray.impl:L')]\n"
            )
        },
    )
    registry = phalanx.Registry()
    plan = registry.plan("ddp", accelerator="cpu", devices=2)
    parts = {c.kind: (c.name, c.provider.distribution) for c in (plan.collective, plan.launcher)}
    assert parts == {"collective": ("torch", "phalanx-torch"), "launcher": ("subprocess", "phalanx-torch")}, (
        plan.explain()
    )
    assert "the strategy's default" in plan.explain()
    with pytest.raises(phalanx.PluginError, match=r"collective 'torch' is given by 2 plugins.*phalanx-stray"):
        registry.plan("ddp", accelerator="cpu", devices=2, collective="torch")
    assert registry.plan("ddp", accelerator="cpu", devices=2, collective="phalanx-torch:torch")
