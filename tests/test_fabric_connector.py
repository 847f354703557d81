"""Lightning Fabric's connector tests, case by case, as ``phalanx.resolve()``.

Fabric's ``tests/tests_fabric/test_connector.py`` and
``tests/tests_fabric/plugins/environments/*.py`` check how its ``_Connector``
turns ``Fabric(accelerator=, strategy=, devices=, ...)`` into a strategy and
what its cluster environments read. Each row of ``CASES`` is one of those
cases translated into a phalanx call: the Fabric test it comes from, the
flags, the machine it runs on (GPUs, MPS, TPUs, start methods and host names
are faked the way Fabric's tests fake them; scheduler variables are set with
``monkeypatch``), what Fabric does, and what phalanx does, which is asserted.
Nothing is launched: every row only resolves, or reads an environment.

Each row has a verdict:

``agrees``
    phalanx does what Fabric does (the same strategy, devices, environment,
    launcher and precision, or an error where Fabric raises one; phalanx's
    errors are ``MisconfigurationError`` / ``UnknownNameError`` /
    ``UnavailableError`` where Fabric raises ``ValueError``, ``TypeError`` or
    ``RuntimeError``).
``stricter``
    phalanx refuses, with an error that says what to change, where Fabric
    warns and falls back, or goes on with a setting that does not hold
    (16-mixed on the CPU, a world that does not match the flags).
``by design``
    phalanx does something else on purpose: a documented rule of its own
    ('gpu' means CUDA, names are case-sensitive, Slurm is detected by
    ``SLURM_JOB_ID``), or a Fabric feature it does not have (DataParallel,
    DeepSpeed).
``wrong``
    a phalanx bug still open. Such a row asserts what phalanx should do and is
    a strict ``xfail``: when the bug is fixed the row fails as XPASS, and its
    verdict must then be changed (and the doc regenerated). Rows with this
    verdict are left out of the doc's table.

Every 'stricter' and 'by design' row names a group of ``GROUPS``, whose text
explains the difference; ``docs/content/fabric.md`` is generated from this
module (``python tests/test_fabric_connector.py > docs/content/fabric.md``)
and ``test_the_doc_is_generated_from_this_table`` checks that it is current.

Notebook rows run in a fresh interpreter that reads its code from standard
input (``python -``), which is what phalanx takes for a notebook or a REPL.
No row needs torch_xla, horovod or mpi4py (TPUs are faked); the one row
about a machine without torch_xla skips where it is importable.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import inspect
import json
import multiprocessing
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed
import torch.multiprocessing

import phalanx
from phalanx_core import (
    Accelerator,
    Availability,
    ClusterEnvironment,
    MisconfigurationError,
    Precision,
    Strategy,
    TorchCheckpointIO,
    UnavailableError,
    UnknownNameError,
)
from phalanx_torch.accelerators import CPUAccelerator, MPSAccelerator
from phalanx_torch.collectives import SingleDeviceCollective, TorchCollective
from phalanx_torch.environments import (
    KubeflowEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from phalanx_torch.launchers import InProcessLauncher, MultiprocessingLauncher
from phalanx_torch.precisions import DoublePrecision, FullPrecision, MixedPrecision, MixedPrecision16
from phalanx_torch.strategies import DDPStrategy, SingleDeviceStrategy

AGREES, STRICTER, BY_DESIGN, WRONG = "agrees", "stricter", "by design", "wrong"
VERDICTS = (AGREES, STRICTER, BY_DESIGN, WRONG)
DOC = Path(__file__).resolve().parents[1] / "docs" / "content" / "fabric.md"
FABRIC = "Lightning-AI/pytorch-lightning, tests/tests_fabric (commit 7f0c3436)"


# --------------------------------------------------------------------------- the table's parts


@dataclasses.dataclass(frozen=True)
class Make:
    """A ready object (an environment, an accelerator, a strategy) built when
    the row runs, after the fakes, and shown as ``label``."""

    factory: Callable[[], Any]
    label: str

    def __repr__(self) -> str:
        return self.label


@dataclasses.dataclass(frozen=True)
class R:
    """``phalanx.resolve(strategy, **flags)``."""

    strategy: Any = "auto"
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def render(self) -> str:
        args = [] if self.strategy == "auto" else [_literal(self.strategy)]
        args += [f"{k}={_literal(v)}" for k, v in self.flags.items()]
        return f"resolve({', '.join(args)})"


def resolve(strategy: Any = "auto", **flags: Any) -> R:
    return R(strategy, flags)


@dataclasses.dataclass(frozen=True)
class Env:
    """A fresh environment instance: its attributes and ``detect()``."""

    cls: type

    def render(self) -> str:
        return f"{self.cls.__name__}()"


@dataclasses.dataclass(frozen=True)
class Validate:
    """``Environment().validate(num_devices=, num_nodes=)``."""

    cls: type
    devices: int
    num_nodes: int

    def render(self) -> str:
        return f"{self.cls.__name__}().validate(num_devices={self.devices}, num_nodes={self.num_nodes})"


@dataclasses.dataclass(frozen=True)
class Do:
    """Any other call; ``fn`` returns the outcome's attributes."""

    fn: Callable[[], dict[str, Any]]
    label: str

    def render(self) -> str:
        return self.label


Call = R | Env | Validate | Do


@dataclasses.dataclass(frozen=True)
class F:
    """The machine a row runs on. ``cuda``: GPUs (a CUDA build of torch is
    faked when > 0); ``cuda_build=False``: a torch without CUDA; ``mps``:
    Apple's GPU; ``xla``: TPU devices (torch_xla faked as installed);
    ``start_methods``: multiprocessing's; ``hostname``: this machine's name;
    ``env``: variables (``{tmp}`` is the row's temporary folder, where
    ``files`` are written); ``interactive``: a notebook / REPL."""

    cuda: int = 0
    cuda_build: bool | None = None
    mps: bool = False
    xla: int | None = None
    start_methods: tuple[str, ...] | None = None
    hostname: str | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    env_label: str = ""
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    interactive: bool = False

    def render(self) -> str:
        parts = []
        if self.interactive:
            parts.append("in a notebook")
        if self.cuda:
            parts.append(f"{self.cuda} CUDA GPU{'s' if self.cuda > 1 else ''}")
        elif self.cuda_build is False:
            parts.append("torch without CUDA")
        if self.mps:
            parts.append("Apple MPS")
        if self.xla:
            parts.append(f"{self.xla} TPU device{'s' if self.xla > 1 else ''}")
        if self.start_methods is not None:
            parts.append(f"start methods: {', '.join(self.start_methods) or 'none'}")
        if self.hostname:
            parts.append(f"host name {self.hostname}")
        if self.env_label:
            parts.append(self.env_label)
        elif self.env:
            parts.append(" ".join(f"{k}={v}" for k, v in self.env.items()))
        return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Err:
    """An exception: its type (or a base of it) and part of its message."""

    type: type[BaseException]
    text: str | tuple[str, ...] = ()

    def matches(self, got: Any) -> bool:
        if not isinstance(got, dict) or "error" not in got:
            return False
        texts = (self.text,) if isinstance(self.text, str) else self.text
        return self.type.__name__ in got["mro"] and all(t in got["message"] for t in texts)

    def render(self) -> str:
        texts = (self.text,) if isinstance(self.text, str) else self.text
        return (
            f"{self.type.__name__}: " + " ... ".join(f'"{t}"' for t in texts) if texts else self.type.__name__
        )


def raises(exc: type[BaseException], *text: str) -> Err:
    return Err(exc, text)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the built strategy is made of; ``None`` fields are not checked."""

    strategy: str
    accelerator: str
    environment: str
    launcher: str
    devices: int
    precision: str = "32-true"
    start_method: str | None = None
    interactive: bool | None = None
    world_size: int | None = None
    global_rank: int | None = None
    local_rank: int | None = None
    node_rank: int | None = None
    main_address: str | None = None
    root_device: str | None = None
    kept: tuple[str, ...] = ()

    def render(self) -> str:
        launcher = self.launcher + (f" ({self.start_method})" if self.start_method else "")
        text = (
            f"{self.strategy} on {self.devices} {self.accelerator} device{'s' if self.devices > 1 else ''}; "
            f"{self.environment}; {launcher}; {self.precision}"
        )
        if self.world_size is not None:
            text += f"; rank {self.global_rank} of {self.world_size}"
            where = [
                f"{k} {v}" for k, v in (("local", self.local_rank), ("node", self.node_rank)) if v is not None
            ]
            text += f" ({', '.join(where)})" if where else ""
        if self.main_address is not None:
            text += f"; main address {self.main_address}"
        if self.root_device is not None:
            text += f"; root device {self.root_device}"
        if self.kept:
            text += f"; keeps the given {', '.join(self.kept)}"
        return text


@dataclasses.dataclass(frozen=True)
class Attrs:
    """Attributes of the outcome (an environment's, or a ``Do``'s)."""

    values: Mapping[str, Any]

    def render(self) -> str:
        return ", ".join(f"{k} {v.render() if isinstance(v, Err) else v}" for k, v in self.values.items())


def attrs(**values: Any) -> Attrs:
    return Attrs(values)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    fabric_test: str
    description: str
    call: Call
    fabric: str
    verdict: str
    expect: Plan | Err | Attrs
    fakes: F = F()
    group: str = ""
    note: str = ""
    #: rows about a machine without these modules skip where they are importable
    absent: tuple[str, ...] = ()


def _literal(value: Any) -> str:
    if isinstance(value, Make):
        return value.label
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


# --------------------------------------------------------------------------- custom parts, as Fabric's tests define them


class CustomCluster(LocalEnvironment):
    """Fabric's CustomCluster: a LightningEnvironment that says it created
    the processes, with its own main address."""

    creates_processes_externally = True

    @property
    def main_address(self) -> str:
        return "asdf"


class Accel(Accelerator):
    """Fabric's custom accelerator: a name that is no torch device type."""

    name = "custom_acc_name"
    collective_backend = "gloo"

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def device_count(cls) -> int:
        return 1

    def get_device(self, index: int) -> Any:
        return torch.device("cpu")

    def parallel_devices(self, devices: Any) -> list[Any]:
        return [torch.device("cpu")] * (devices if isinstance(devices, int) else 1)


class AccelOfCPUs(Accel):
    """The same, saying its devices' torch type (issue 31, item 5)."""

    name = "custom_acc_name"
    device_type = "cpu"


class Prec(Precision):
    pass


class TestStrategy(SingleDeviceStrategy):
    __test__ = False


class MyXLA(Accelerator):
    """An accelerator instance whose name is 'xla' (stands in for
    phalanx_xla's XLAAccelerator)."""

    name = "xla"

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def device_count(cls) -> int:
        return 8

    def get_device(self, index: int) -> Any:
        return torch.device("cpu")


class MyBF16(MixedPrecision):
    pass


class MyAMP(MixedPrecision16):
    pass


def _test_strategy() -> Strategy:
    return TestStrategy(
        accelerator=Accel(),
        precision=Prec(),
        environment=LocalEnvironment(),
        collective=SingleDeviceCollective(),
        launcher=InProcessLauncher(),
        parallel_devices=[torch.device("cpu")],
    )


def _xla_accelerator() -> Accelerator:
    from phalanx_xla.accelerator import XLAAccelerator

    return XLAAccelerator()


def _ready(strategy: str, **flags: Any) -> Make:
    shown = ", ".join([json.dumps(strategy), *(f"{k}={_literal(v)}" for k, v in flags.items())])
    return Make(lambda: phalanx.resolve(strategy, **flags), f"resolve({shown})")


def _bare_ddp() -> dict[str, Any]:
    DDPStrategy()  # type: ignore[call-arg]
    return {}


def _hand_built_ddp() -> dict[str, Any]:
    env, acc = LocalEnvironment(), CPUAccelerator()
    strategy = DDPStrategy(
        accelerator=acc,
        environment=env,
        collective=TorchCollective(),
        precision=FullPrecision(accelerator=acc),
        launcher=MultiprocessingLauncher(environment=env, num_processes=8),
        parallel_devices=[torch.device("cuda", i) for i in range(8)],
    )
    return {
        "constructed": True,
        "accelerator": strategy.accelerator.name,
        "root_device": str(strategy.root_device),
    }


def _defaults() -> dict[str, Any]:
    def defaults(fn: Callable[..., Any]) -> dict[str, Any]:
        return {k: p.default for k, p in inspect.signature(fn).parameters.items() if k != "self"}

    ours, registry = defaults(phalanx.resolve), defaults(phalanx.Registry.plan)
    differences = {k: [v, registry[k]] for k, v in ours.items() if registry.get(k, v) != v}
    return {"same defaults": not differences, "differences": differences}


def _teardown() -> dict[str, Any]:
    LocalEnvironment().teardown()
    return {"WORLD_SIZE still set": "WORLD_SIZE" in os.environ}


# --------------------------------------------------------------------------- variables of the schedulers

HOST = "node1"
#: Fabric's SLURM fixture: no SLURM_JOB_ID (Fabric detects Slurm by SLURM_NTASKS)
FABRIC_SLURM = {
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_JOB_NAME": "SOME_NAME",
    "SLURM_NODEID": "0",
    "LOCAL_RANK": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}
#: what `srun --nodes=1 --ntasks-per-node=2` sets in each task, on top of Fabric's
SRUN_STEP = {
    "SLURM_JOB_ID": "1234",
    "SLURM_JOBID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NODELIST": HOST,
    "SLURM_STEP_NODELIST": HOST,
    "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_NTASKS_PER_NODE": "2",
}


def _slurm_gpu(name: str) -> dict[str, str]:
    return {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NAME": name,
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
    }


SALLOC = {"SLURM_JOB_ID": "1234", "SLURM_NTASKS": "2", "SLURM_NODELIST": HOST, "SLURM_NNODES": "1"}
TORCHRUN = {
    "CUDA_VISIBLE_DEVICES": "0,1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "1",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "0",
    "TORCHELASTIC_RUN_ID": "1",
}
TORCHRUN_FULL = {**TORCHRUN, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_WORLD_SIZE": "1"}
KUBEFLOW = {
    "KUBERNETES_PORT": "tcp://127.0.0.1:443",
    "MASTER_ADDR": "1.2.3.4",
    "MASTER_PORT": "500",
    "WORLD_SIZE": "20",
    "RANK": "1",
}
LSF_FABRIC = {
    "LSB_JOBID": "1",
    "LSB_DJOB_RANKFILE": "SOME_RANK_FILE",
    "JSM_NAMESPACE_LOCAL_RANK": "1",
    "JSM_NAMESPACE_SIZE": "20",
    "JSM_NAMESPACE_RANK": "1",
}
LSF_RANKFILE = {"rankfile": f"batch\n{HOST}\n{HOST}\n"}
LSF_HOSTS_FILE = {"rankfile": "batch\n10.10.10.0\n10.10.10.1\n10.10.10.2\n10.10.10.3"}
LSF_VARS = {
    "LSB_DJOB_RANKFILE": "{tmp}/rankfile",
    "LSB_JOBID": "1234",
    "JSM_NAMESPACE_SIZE": "4",
    "JSM_NAMESPACE_RANK": "3",
    "JSM_NAMESPACE_LOCAL_RANK": "1",
}
HAND_STARTED = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29555",
}
SLURM_ATTRS = {
    "SLURM_NODELIST": "1.1.1.1, 1.1.1.2",
    "SLURM_JOB_ID": "0001234",
    "SLURM_NTASKS": "20",
    "SLURM_NTASKS_PER_NODE": "10",
    "SLURM_LOCALID": "2",
    "SLURM_PROCID": "1",
    "SLURM_NODEID": "3",
    "SLURM_JOB_NAME": "JOB",
}
SLURM_TWO_IP_NODES = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "10.0.0.[1-2]",
    "SLURM_STEP_NODELIST": "10.0.0.[1-2]",
    "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
}


def run_flags(**flags: Any) -> dict[str, str]:
    """What ``phalanx run --precision ...`` passes to the script (Fabric's
    ``fabric run`` sets LT_CLI_USED and LT_PRECISION etc.)."""
    return {"PHALANX_RUN_FLAGS": json.dumps(flags)}


def slurm_step_attrs(nodelist: str) -> dict[str, str]:
    return {"SLURM_NODELIST": nodelist, "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"}


CPU2 = {"accelerator": "cpu", "devices": 2}
GPU2 = {"accelerator": "gpu", "devices": 2}
DDP_CPU2 = Plan("DDPStrategy", "cpu", "LocalEnvironment", "SubprocessLauncher", 2)
SINGLE_CPU = Plan("SingleDeviceStrategy", "cpu", "LocalEnvironment", "InProcessLauncher", 1)
SINGLE_CUDA = Plan(
    "SingleDeviceStrategy", "cuda", "LocalEnvironment", "InProcessLauncher", 1, root_device="cuda:0"
)
SINGLE_MPS = Plan(
    "SingleDeviceStrategy", "mps", "LocalEnvironment", "InProcessLauncher", 1, root_device="mps:0"
)
XLA_SINGLE = Plan("XLASingleStrategy", "xla", "XLAEnvironment", "XLALauncher", 1)
XLA_ALL = Plan("XLAStrategy", "xla", "XLAEnvironment", "XLALauncher", 8)
MAC = F(mps=True, cuda_build=False)
NO_MPS_BACKEND = ("gloo moves cpu and cuda tensors only", "cannot run on 'mps'")
NO_XLA_BACKEND = "collective 'torch' with backend='xla': torch.distributed knows no such backend"


def C(  # a row of the table
    id: str,
    fabric_test: str,
    description: str,
    call: Call,
    fabric: str,
    verdict: str,
    expect: Plan | Err | Attrs,
    fakes: F = F(),
    group: str = "",
    note: str = "",
    absent: tuple[str, ...] = (),
) -> Case:
    return Case(id, fabric_test, description, call, fabric, verdict, expect, fakes, group, note, absent)


# --------------------------------------------------------------------------- the table

# One row per case, laid out as a table (hence fmt: off):
# C(id, Fabric test, description, call, what Fabric does, verdict, expectation, machine, group=, note=)
# fmt: off
CASES: list[Case] = [
    # ---- test_connector.py
    C("tpu_name", "test_accelerator_choice_tpu", "Fabric's accelerator name 'tpu', one device",
      resolve(accelerator="tpu", devices=1),
      "XLAAccelerator, SingleDeviceXLAStrategy", AGREES, XLA_SINGLE, F(xla=8),
      note="'tpu' is another name for 'xla'"),
    C("tpu_devices_auto", "test_accelerator_choice_tpu", "every TPU device",
      resolve(accelerator="xla", devices="auto"),
      "XLAStrategy over 8 devices, XLAEnvironment", AGREES, XLA_ALL, F(xla=8)),
    C("tpu_accelerator_auto", "test_accelerator_choice_tpu", "accelerator auto on a TPU host, 8 devices",
      resolve(accelerator="auto", devices=8),
      "XLAAccelerator, XLAStrategy", AGREES, XLA_ALL, F(xla=8)),
    C("tpu_device_index", "test_accelerator_choice_tpu", "one TPU device by index",
      resolve(accelerator="xla", devices=[1]),
      "SingleDeviceXLAStrategy on xla:1", STRICTER,
      raises(MisconfigurationError, "torch_xla runs one replica on every device of this host"),
      F(xla=8), group="xla_devices"),
    C("ddp_on_cpu", "test_strategy_choice_ddp_on_cpu", "ddp on two CPU processes",
      resolve("ddp", **CPU2),
      "DDPStrategy, CPUAccelerator, 2 processes", AGREES, DDP_CPU2),
    C("bare_ddp_instance", "test_strategy_choice_ddp_on_cpu", "a DDPStrategy() with no parts, for the connector to fill",
      Do(_bare_ddp, "DDPStrategy()"),
      "the connector completes it from the flags", BY_DESIGN,
      raises(TypeError, "missing 5 required keyword-only arguments"), group="ready_instance"),
    C("custom_cluster", "test_custom_cluster_environment_in_slurm_environment",
      "a LightningEnvironment subclass that creates processes externally, under Fabric's Slurm variables",
      resolve("ddp", **CPU2, plugins=[Make(CustomCluster, "CustomCluster()")]),
      "uses CustomCluster; world_size 2", STRICTER,
      raises(MisconfigurationError, "environment CustomCluster started 1 process(es) (its world_size)",
             "devices=2 x num_nodes=1 = 2"),
      F(env=FABRIC_SLURM, env_label="Fabric's Slurm variables"), group="external_world"),
    C("custom_cluster_world", "test_custom_cluster_environment_in_slurm_environment",
      "the same environment where the processes it says it started exist (WORLD_SIZE=2)",
      resolve("ddp", **CPU2, plugins=[Make(CustomCluster, "CustomCluster()")]),
      "uses CustomCluster; world_size 2", AGREES,
      Plan("DDPStrategy", "cpu", "CustomCluster", "InProcessLauncher", 2, world_size=2, global_rank=1,
           local_rank=1, node_rank=0, main_address="asdf", kept=("environment",)),
      F(env={**FABRIC_SLURM, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"},
        env_label="Fabric's Slurm variables; WORLD_SIZE=2 RANK=1 LOCAL_RANK=1")),
    C("custom_strategy_devices", "test_custom_accelerator",
      "a ready single-device strategy with a custom accelerator and precision, and devices=2",
      resolve(Make(_test_strategy, "TestStrategy(accelerator=Accel(), precision=Prec(), ...)"), devices=2),
      "keeps the instance, its accelerator and precision", STRICTER,
      raises(MisconfigurationError, "ready TestStrategy instance built for devices=1, num_nodes=1",
             "you also passed devices=2"),
      group="ready_instance"),
    C("custom_accelerator_ddp", "test_custom_accelerator",
      "ddp with a custom accelerator whose name is not a torch device type",
      resolve("ddp", accelerator=Make(Accel, "Accel()"), devices=2),
      "keeps the custom accelerator", BY_DESIGN,
      raises(MisconfigurationError, "torch.distributed's gloo moves cpu and cuda tensors only",
             "cannot run on 'custom_acc_name'", "device_type"),
      group="accelerator_name"),
    C("custom_accelerator_ddp_device_type", "test_custom_accelerator",
      "ddp with a custom accelerator whose name is not a torch device type, saying its device_type",
      resolve("ddp", accelerator=Make(AccelOfCPUs, "AccelOfCPUs()"), devices=2),
      "keeps the custom accelerator", AGREES,
      Plan("DDPStrategy", "custom_acc_name", "LocalEnvironment", "SubprocessLauncher", 2,
           kept=("accelerator",))),
    C("custom_accelerator_single", "test_custom_accelerator",
      "a custom accelerator instance on one device",
      resolve(accelerator=Make(Accel, "Accel()"), devices=1),
      "keeps the custom accelerator", AGREES,
      Plan("SingleDeviceStrategy", "custom_acc_name", "LocalEnvironment", "InProcessLauncher", 1,
           kept=("accelerator",))),
    C("spawn_under_fabric_slurm", "test_fallback_from_ddp_spawn_to_ddp_on_cluster",
      "ddp_spawn under Fabric's Slurm variables (no SLURM_JOB_ID)",
      resolve("ddp_spawn", **CPU2),
      "DDPStrategy with SLURMEnvironment (no spawning)", BY_DESIGN,
      Plan("DDPStrategy", "cpu", "LocalEnvironment", "MultiprocessingLauncher", 2, start_method="spawn"),
      F(env=FABRIC_SLURM, env_label="Fabric's Slurm variables"), group="slurm_job_id"),
    C("spawn_under_srun", "test_fallback_from_ddp_spawn_to_ddp_on_cluster",
      "ddp_spawn inside an srun step of 2 tasks",
      resolve("ddp_spawn", **CPU2),
      "DDPStrategy with SLURMEnvironment (no spawning)", AGREES,
      Plan("DDPStrategy", "cpu", "SLURMEnvironment", "InProcessLauncher", 2, world_size=2, global_rank=0,
           local_rank=0, node_rank=0),
      F(hostname=HOST, env={**FABRIC_SLURM, **SRUN_STEP}, env_label="srun step, 2 tasks, rank 0"),
      note="no strategy switch: srun started the processes, so the launcher runs fn in place"),
    C("spawn_under_lsf_no_rankfile", "test_fallback_from_ddp_spawn_to_ddp_on_cluster",
      "ddp_spawn under Fabric's LSF variables, whose rank file does not exist",
      resolve("ddp_spawn", **CPU2),
      "DDPStrategy with LSFEnvironment (the test mocks the reading of the rank file)", AGREES,
      raises(MisconfigurationError, "LSB_DJOB_RANKFILE='SOME_RANK_FILE' cannot be read"),
      F(env=LSF_FABRIC, env_label="Fabric's LSF variables"),
      note="without the mock, Fabric fails to open the file too"),
    C("spawn_under_lsf_20", "test_fallback_from_ddp_spawn_to_ddp_on_cluster",
      "ddp_spawn, devices=2, in an LSF job of JSM_NAMESPACE_SIZE=20 processes",
      resolve("ddp_spawn", **CPU2),
      "DDPStrategy with LSFEnvironment", STRICTER,
      raises(MisconfigurationError, "started JSM_NAMESPACE_SIZE=20 process(es)", "devices=2 x num_nodes=1 = 2"),
      F(hostname=HOST, env={**LSF_FABRIC, "LSB_DJOB_RANKFILE": "{tmp}/rankfile"}, files=LSF_RANKFILE,
        env_label="Fabric's LSF variables, a rank file listing this host"),
      group="external_world"),
    C("spawn_under_lsf_2", "test_fallback_from_ddp_spawn_to_ddp_on_cluster",
      "ddp_spawn, devices=2, in an LSF job of 2 processes",
      resolve("ddp_spawn", **CPU2),
      "DDPStrategy with LSFEnvironment", AGREES,
      Plan("DDPStrategy", "cpu", "LSFEnvironment", "InProcessLauncher", 2, world_size=2, global_rank=1,
           local_rank=1, node_rank=0),
      F(hostname=HOST, env={**LSF_FABRIC, "LSB_DJOB_RANKFILE": "{tmp}/rankfile", "JSM_NAMESPACE_SIZE": "2"},
        files=LSF_RANKFILE, env_label="LSF job of 2 processes (jsrun), rank 1"),
      note="no strategy switch: jsrun started the processes"),
    C("notebook_ddp", "test_interactive_incompatible_backend_error", "ddp in a notebook",
      resolve("ddp", **GPU2),
      "RuntimeError: strategy ddp is not compatible with an interactive environment", AGREES,
      raises(MisconfigurationError, "launcher 'subprocess' cannot run in a notebook or REPL", "launcher='fork'"),
      F(cuda=2, interactive=True)),
    C("notebook_ddp_spawn", "test_interactive_incompatible_backend_error", "ddp_spawn in a notebook",
      resolve("ddp_spawn", **GPU2),
      "RuntimeError: strategy ddp_spawn is not compatible with an interactive environment", AGREES,
      raises(MisconfigurationError, "launcher 'spawn' cannot run in a notebook or REPL", "launcher='fork'"),
      F(cuda=2, interactive=True)),
    C("precision_twice", "test_precision_and_precision_plugin_raises",
      "precision='16-true' and a precision plugin",
      resolve(precision="16-true", plugins=[Make(FullPrecision, "FullPrecision()")]),
      "ValueError: received both precision=16-true and plugins", AGREES,
      raises(MisconfigurationError, "the precision is given twice")),
    C("precision_twice_default", "test_precision_and_precision_plugin_raises",
      "precision='32-true' (the default, given) and a precision plugin",
      resolve(precision="32-true", plugins=[Make(FullPrecision, "FullPrecision()")]),
      "ValueError: received both precision and plugins", AGREES,
      raises(MisconfigurationError, "the precision is given twice: precision='32-true'")),
    C("precision_plugin", "test_precision_and_precision_plugin_raises", "a precision plugin alone",
      resolve(plugins=[Make(DoublePrecision, "DoublePrecision()")]),
      "uses the plugin", AGREES,
      dataclasses.replace(SINGLE_CPU, precision="64-true", kept=("precision",)), F(cuda_build=False)),
    C("dp_gpu", "test_interactive_compatible_dp_strategy_gpu", "DataParallel on GPUs",
      resolve("dp", accelerator="gpu"),
      "DataParallelStrategy, no launcher", BY_DESIGN,
      raises(UnknownNameError, "unknown strategy 'dp'", "Did you mean 'ddp'"), F(cuda=2), group="not_provided"),
    C("notebook_ddp_fork", "test_interactive_compatible_strategy_ddp_fork", "ddp_fork in a notebook",
      resolve("ddp_fork", accelerator="cpu"),
      "an interactive-compatible launcher (fork)", AGREES,
      Plan("DDPStrategy", "cpu", "LocalEnvironment", "MultiprocessingLauncher", 1, start_method="fork",
           interactive=True),
      F(interactive=True)),
    C("mps_ddp", "test_invalid_ddp_strategy_with_mps", "ddp on MPS",
      resolve("ddp", accelerator="mps"),
      "ValueError: strategies from the DDP family are not supported on MPS", AGREES,
      raises(MisconfigurationError, *NO_MPS_BACKEND), MAC),
    C("mps_ddp_auto", "test_invalid_ddp_strategy_with_mps", "ddp with accelerator auto on a Mac",
      resolve("ddp", accelerator="auto"),
      "ValueError: DDP family not supported on MPS", AGREES,
      raises(MisconfigurationError, *NO_MPS_BACKEND), MAC),
    C("mps_ddp_instance", "test_invalid_ddp_strategy_with_mps", "ddp with an MPSAccelerator() instance",
      resolve("ddp", accelerator=Make(MPSAccelerator, "MPSAccelerator()")),
      "ValueError: DDP family not supported on MPS", AGREES,
      raises(MisconfigurationError, *NO_MPS_BACKEND), MAC),
    C("mps_ddp_spawn", "test_invalid_ddp_strategy_with_mps", "ddp_spawn on MPS",
      resolve("ddp_spawn", accelerator="mps"),
      "ValueError: DDP family not supported on MPS", AGREES,
      raises(MisconfigurationError, *NO_MPS_BACKEND), MAC),
    C("mps_fsdp", "test_invalid_ddp_strategy_with_mps", "fsdp on MPS (phalanx's own row)",
      resolve("fsdp", accelerator="mps"),
      "(FSDP is not supported on MPS either)", AGREES,
      raises(MisconfigurationError, *NO_MPS_BACKEND), MAC),
    C("mps_ddp_gpu", "test_invalid_ddp_strategy_with_mps", "ddp with accelerator 'gpu' on a Mac",
      resolve("ddp", accelerator="gpu"),
      "'gpu' is MPS there: ValueError, DDP family not supported on MPS", BY_DESIGN,
      raises(UnavailableError, "accelerator 'cuda' cannot be used here", "use accelerator='mps'"),
      MAC, group="gpu_is_cuda"),
    C("mps_two_devices", "test_invalid_ddp_strategy_with_mps", "two MPS devices (phalanx's own row)",
      resolve("ddp", accelerator="mps", devices=2),
      "(a Mac has one MPS device)", AGREES,
      raises(MisconfigurationError, "this machine has 1 mps device(s)"), MAC),
    C("multi_node_no_node_rank", "test_strategy_choice_multi_node_gpu",
      "ddp on 2 nodes without a scheduler and without NODE_RANK",
      resolve("ddp", num_nodes=2, accelerator="gpu", devices=1),
      "DDPStrategy (node rank 0 assumed)", STRICTER,
      raises(MisconfigurationError, "num_nodes=2 on the local environment needs NODE_RANK"),
      F(cuda=2), group="multi_node_local"),
    C("multi_node", "test_strategy_choice_multi_node_gpu", "ddp on 2 nodes, NODE_RANK and MASTER_ADDR set",
      resolve("ddp", num_nodes=2, **GPU2),
      "DDPStrategy", AGREES,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 2, main_address="10.1.2.3"),
      F(cuda=2, env={"NODE_RANK": "0", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})),
    C("multi_node_spawn", "test_strategy_choice_multi_node_gpu", "ddp_spawn on 2 nodes",
      resolve("ddp_spawn", num_nodes=2, **GPU2),
      "DDPStrategy (spawn, on each node)", STRICTER,
      raises(MisconfigurationError, "launcher 'spawn' starts processes on this machine only",
             "num_nodes=2"),
      F(cuda=2, env={"NODE_RANK": "0", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}),
      group="multi_node_local"),
    C("num_nodes_zero", "test_num_nodes_input_validation", "num_nodes=0", resolve(num_nodes=0),
      "ValueError: `num_nodes` must be a positive integer", AGREES,
      raises(MisconfigurationError, "num_nodes=0: expected an int of at least 1")),
    C("num_nodes_negative", "test_num_nodes_input_validation", "num_nodes=-1", resolve(num_nodes=-1),
      "ValueError: `num_nodes` must be a positive integer", AGREES,
      raises(MisconfigurationError, "num_nodes=-1: expected an int of at least 1")),
    C("cpu_on_cpu", "test_cuda_accelerator_can_not_run_on_system", "the CPU",
      resolve(accelerator="cpu"), "CPUAccelerator", AGREES, SINGLE_CPU),
    C("cuda_without_cuda_build", "test_cuda_accelerator_can_not_run_on_system",
      "CUDA with a torch built without it", resolve(accelerator="cuda", devices=1),
      "RuntimeError: CUDAAccelerator can not run on your system", AGREES,
      raises(UnavailableError, "has no CUDA support"), F(cuda_build=False)),
    C("cuda_without_gpu", "test_cuda_accelerator_can_not_run_on_system",
      "CUDA with a CUDA build of torch but no GPU", resolve(accelerator="cuda", devices=1),
      "RuntimeError: CUDAAccelerator can not run on your system", AGREES,
      raises(UnavailableError, "no CUDA device is visible"), F(cuda=0, cuda_build=True)),
    C("tpu_without_torch_xla", "test_tpu_accelerator_can_not_run_on_system", "TPUs without torch_xla",
      resolve(accelerator="tpu", devices=8),
      "RuntimeError: XLAAccelerator can not run on your system", AGREES,
      raises(UnavailableError, "needs torch_xla, which is not installed"), absent=("torch_xla",)),
    C("devices_strings", "test_accelerator_invalid_type_devices", "devices=['0']",
      resolve(accelerator="gpu", devices=["0"]),
      "TypeError: devices must be an int, a string, a sequence of ints", AGREES,
      raises(MisconfigurationError, "expected an int, a list of ints"), F(cuda=2)),
    C("devices_mixed", "test_accelerator_invalid_type_devices", "devices=[0, '1']",
      resolve(accelerator="gpu", devices=[0, "1"]),
      "TypeError: devices must be an int, a string, a sequence of ints", AGREES,
      raises(MisconfigurationError, "expected an int, a list of ints"), F(cuda=2)),
    C("devices_bool", "test_accelerator_invalid_type_devices", "devices=[False]",
      resolve(accelerator="gpu", devices=[False]),
      "TypeError: devices must be an int, a string, a sequence of ints", AGREES,
      raises(MisconfigurationError, "expected an int, a list of ints"), F(cuda=2)),
    C("gpu_one", "test_accelerator_gpu", "'gpu', one device", resolve(accelerator="gpu", devices=1),
      "CUDAAccelerator", AGREES, SINGLE_CUDA, F(cuda=1)),
    C("auto_one_gpu", "test_accelerator_gpu", "accelerator auto on a GPU machine, one device",
      resolve(accelerator="auto", devices=1), "CUDAAccelerator", AGREES, SINGLE_CUDA, F(cuda=1)),
    C("cpu_one", "test_accelerator_cpu_with_devices", "one CPU process", resolve(accelerator="cpu", devices=1),
      "SingleDeviceStrategy on cpu", AGREES, SINGLE_CPU),
    C("cpu_five", "test_accelerator_cpu_with_devices", "five CPU processes", resolve(accelerator="cpu", devices=5),
      "DDPStrategy on 5 CPU processes", AGREES, dataclasses.replace(DDP_CPU2, devices=5)),
    C("gpu_by_index", "test_accelerator_gpu_with_devices", "the second GPU by index",
      resolve(accelerator="gpu", devices=[1]),
      "SingleDeviceStrategy on cuda:1", AGREES, dataclasses.replace(SINGLE_CUDA, root_device="cuda:1"),
      F(cuda=2)),
    C("gpu_two", "test_accelerator_gpu_with_devices", "two GPUs", resolve(**GPU2),
      "DDPStrategy", AGREES, Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 2), F(cuda=2)),
    C("auto_gpu", "test_accelerator_auto_with_devices_gpu", "accelerator auto, one device, one GPU",
      resolve(accelerator="auto", devices=1), "CUDAAccelerator on cuda:0", AGREES, SINGLE_CUDA, F(cuda=1)),
    C("cpu_three", "test_set_devices_if_none_cpu", "three CPU processes", resolve(accelerator="cpu", devices=3),
      "parallel devices [cpu, cpu, cpu]", AGREES, dataclasses.replace(DDP_CPU2, devices=3)),
    C("dp_on_cpu", "test_unsupported_strategy_types_on_cpu_and_fallback", "DataParallel on the CPU",
      resolve("dp", **CPU2),
      "warns and uses DDPStrategy", STRICTER,
      raises(UnknownNameError, "unknown strategy 'dp'", "Did you mean 'ddp'"), group="not_provided"),
    C("mps_16_mixed", "test_mps_enabled_with_float16_or_bfloat16_precision", "16-mixed on MPS",
      resolve(accelerator="mps", precision="16-mixed"),
      "MixedPrecision on mps", AGREES, dataclasses.replace(SINGLE_MPS, precision="16-mixed"), MAC),
    C("mps_bf16_mixed", "test_mps_enabled_with_float16_or_bfloat16_precision", "bf16-mixed on MPS",
      resolve(accelerator="mps", precision="bf16-mixed"),
      "MixedPrecision on mps", AGREES, dataclasses.replace(SINGLE_MPS, precision="bf16-mixed"), MAC),
    C("invalid_accelerator", "test_invalid_accelerator_choice", "an accelerator name that does not exist",
      resolve(accelerator="cocofruit"),
      "ValueError: invalid accelerator name", AGREES,
      raises(UnknownNameError, "unknown accelerator 'cocofruit'", "The accelerator names that exist")),
    C("invalid_strategy", "test_invalid_strategy_choice", "a strategy name that does not exist",
      resolve("cocofruit"),
      "ValueError: invalid strategy name", AGREES, raises(UnknownNameError, "unknown strategy 'cocofruit'")),
    C("invalid_strategy_object", "test_invalid_strategy_choice", "a strategy that is no name and no strategy",
      resolve(Make(object, "object()")),
      "ValueError: invalid strategy", AGREES,
      raises(MisconfigurationError, "expected a name (str) or a Strategy instance, got object")),
    C("ddp_spawn_cpu_str", "test_strategy_choice_cpu_str", "ddp_spawn by name on the CPU",
      resolve("ddp_spawn", **CPU2), "DDPStrategy", AGREES,
      Plan("DDPStrategy", "cpu", "LocalEnvironment", "MultiprocessingLauncher", 2, start_method="spawn")),
    C("ddp_cpu_str", "test_strategy_choice_cpu_str", "ddp by name on the CPU",
      resolve("ddp", **CPU2), "DDPStrategy", AGREES, DDP_CPU2),
    C("ddp_spawn_gpu_str", "test_strategy_choice_gpu_str", "ddp_spawn on two GPUs",
      resolve("ddp_spawn", **GPU2), "DDPStrategy", AGREES,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "MultiprocessingLauncher", 2, start_method="spawn"),
      F(cuda=2)),
    C("deepspeed", "test_strategy_choice_gpu_str", "DeepSpeed on two GPUs",
      resolve("deepspeed", **GPU2), "DeepSpeedStrategy", BY_DESIGN,
      raises(UnknownNameError, "unknown strategy 'deepspeed'"), F(cuda=2), group="not_provided"),
    C("ddp_gpu_by_name", "test_device_type_when_strategy_instance_gpu_passed",
      "ddp on two GPUs, by name (phalanx's form of DDPStrategy() + accelerator='gpu')",
      resolve("ddp", **GPU2), "DDPStrategy on CUDAAccelerator", AGREES,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 2), F(cuda=2)),
    C("instance_and_accelerator", "test_device_type_when_strategy_instance_cpu_passed",
      "a ready ddp strategy with accelerator='cpu' beside it",
      resolve(_ready("ddp", **CPU2), accelerator="cpu", devices=2),
      "DDPStrategy on CPUAccelerator", BY_DESIGN,
      raises(MisconfigurationError, "ready DDPStrategy instance, so it already has its parts",
             "you also passed accelerator"),
      group="ready_instance"),
    C("instance_same_devices", "test_device_type_when_strategy_instance_cpu_passed",
      "a ready ddp strategy with the devices it was built for",
      resolve(_ready("ddp", **CPU2), devices=2),
      "DDPStrategy on CPUAccelerator", AGREES, dataclasses.replace(DDP_CPU2, kept=("strategy",))),
    C("precision_one", "test_validate_precision_type", "precision=1", resolve(precision=1),
      "ValueError: Precision 1 is invalid", AGREES, raises(UnknownNameError, "unknown precision '1'")),
    C("precision_invalid", "test_validate_precision_type", "precision='invalid'", resolve(precision="invalid"),
      "ValueError: Precision 'invalid' is invalid", AGREES,
      raises(UnknownNameError, "unknown precision 'invalid'", "The precision names that exist")),
    C("precision_16", "test_precision_conversion", "precision=16", resolve(precision=16, accelerator="cuda"),
      "16-mixed (with a warning)", AGREES, dataclasses.replace(SINGLE_CUDA, precision="16-mixed"), F(cuda=1)),
    C("precision_bf16", "test_precision_conversion", "precision='bf16'",
      resolve(precision="bf16", accelerator="cuda"),
      "bf16-mixed (with a warning)", AGREES, dataclasses.replace(SINGLE_CUDA, precision="bf16-mixed"), F(cuda=1)),
    C("precision_32", "test_precision_conversion", "precision=32", resolve(precision=32, accelerator="cuda"),
      "32-true", AGREES, SINGLE_CUDA, F(cuda=1)),
    C("precision_64", "test_precision_conversion", "precision='64'", resolve(precision="64", accelerator="cuda"),
      "64-true", AGREES, dataclasses.replace(SINGLE_CUDA, precision="64-true"), F(cuda=1)),
    C("multi_device_default", "test_multi_device_default_strategy", "strategy auto, two CPU processes",
      resolve(**CPU2), "DDPStrategy, subprocess script launcher (popen)", AGREES, DDP_CPU2),
    C("ddp_spawn_cpu", "test_strategy_choice_ddp_spawn_cpu", "ddp_spawn on the CPU",
      resolve("ddp_spawn", **CPU2), "DDPStrategy, LightningEnvironment, spawn", AGREES,
      Plan("DDPStrategy", "cpu", "LocalEnvironment", "MultiprocessingLauncher", 2, start_method="spawn")),
    C("notebook_auto_cpu", "test_strategy_choice_ddp_fork_in_interactive",
      "strategy auto, two CPU processes, in a notebook",
      resolve(**CPU2), "DDPStrategy with the fork start method", AGREES,
      Plan("DDPStrategy", "cpu", "LocalEnvironment", "MultiprocessingLauncher", 2, start_method="fork",
           interactive=True),
      F(interactive=True), note="phalanx picks ddp_notebook"),
    C("ddp_fork_cpu", "test_strategy_choice_ddp_fork_cpu", "ddp_fork on the CPU",
      resolve("ddp_fork", **CPU2), "DDPStrategy, LightningEnvironment, fork", AGREES,
      Plan("DDPStrategy", "cpu", "LocalEnvironment", "MultiprocessingLauncher", 2, start_method="fork")),
    C("ddp_one_gpu", "test_strategy_choice_ddp", "ddp on one GPU",
      resolve("ddp", accelerator="gpu", devices=1), "CUDAAccelerator, DDPStrategy, LightningEnvironment", AGREES,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 1),
      F(cuda=2, env={"CUDA_VISIBLE_DEVICES": "0,1"})),
    C("ddp_spawn_one_gpu", "test_strategy_choice_ddp_spawn", "ddp_spawn on one GPU",
      resolve("ddp_spawn", accelerator="gpu", devices=1), "CUDAAccelerator, DDPStrategy, LightningEnvironment",
      AGREES, Plan("DDPStrategy", "cuda", "LocalEnvironment", "MultiprocessingLauncher", 1, start_method="spawn"),
      F(cuda=2, env={"CUDA_VISIBLE_DEVICES": "0,1"})),
    C("slurm_fabric_vars", "test_strategy_choice_ddp_slurm", "ddp under Fabric's Slurm variables (job name some_name)",
      resolve("ddp", accelerator="cuda", devices=2),
      "DDPStrategy with SLURMEnvironment", BY_DESIGN,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 2),
      F(cuda=2, env=_slurm_gpu("some_name"), env_label="Fabric's Slurm variables, rank 1"), group="slurm_job_id"),
    C("slurm_srun", "test_strategy_choice_ddp_slurm", "strategy auto inside an srun step, rank 1 of 2",
      resolve(accelerator="cuda", devices=2),
      "DDPStrategy with SLURMEnvironment, local rank 1", AGREES,
      Plan("DDPStrategy", "cuda", "SLURMEnvironment", "InProcessLauncher", 2, world_size=2, global_rank=1,
           local_rank=1, node_rank=0, root_device="cuda:1"),
      F(cuda=2, hostname=HOST, env={**_slurm_gpu("some_name"), **SRUN_STEP}, env_label="srun step, rank 1 of 2")),
    C("slurm_bash", "test_strategy_choice_ddp_slurm", "ddp under Fabric's Slurm variables, job name bash",
      resolve("ddp", accelerator="cuda", devices=2),
      "DDPStrategy with LightningEnvironment (Slurm ignored for an interactive job)", AGREES,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 2),
      F(cuda=2, env=_slurm_gpu("bash"), env_label="Fabric's Slurm variables, job name bash")),
    C("slurm_salloc", "test_strategy_choice_ddp_slurm", "ddp in a salloc shell (inside a job, not in an srun step)",
      resolve("ddp", accelerator="cuda", devices=2),
      "DDPStrategy with LightningEnvironment (job name bash)", STRICTER,
      raises(MisconfigurationError, "inside a Slurm allocation (job 1234) but was not started with srun",
             "environment='local'"),
      F(cuda=2, hostname=HOST, env={**SALLOC, "SLURM_JOB_NAME": "bash", "CUDA_VISIBLE_DEVICES": "0,1"},
        env_label="a salloc shell: SLURM_JOB_ID, no SLURM_STEP_ID"),
      group="slurm_job_id"),
    C("slurm_salloc_local", "test_strategy_choice_ddp_slurm", "the same, with environment='local'",
      resolve("ddp", accelerator="cuda", devices=2, environment="local"),
      "DDPStrategy with LightningEnvironment", AGREES,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 2),
      F(cuda=2, hostname=HOST, env={**SALLOC, "SLURM_JOB_NAME": "bash", "CUDA_VISIBLE_DEVICES": "0,1"},
        env_label="a salloc shell: SLURM_JOB_ID, no SLURM_STEP_ID")),
    C("torchelastic_partial", "test_strategy_choice_ddp_torchelastic",
      "torchrun's variables without MASTER_ADDR / MASTER_PORT (Fabric's)",
      resolve(**GPU2), "DDPStrategy with TorchElasticEnvironment, local rank 1", STRICTER,
      raises(MisconfigurationError, "TORCHELASTIC_RUN_ID is set", "MASTER_ADDR, MASTER_PORT are not set"),
      F(cuda=2, env=TORCHRUN, env_label="Fabric's torchrun variables, rank 1 of 2"), group="torchrun_vars"),
    C("torchelastic", "test_strategy_choice_ddp_torchelastic", "inside torchrun, rank 1 of 2",
      resolve(**GPU2), "DDPStrategy with TorchElasticEnvironment, local rank 1", AGREES,
      Plan("DDPStrategy", "cuda", "TorchElasticEnvironment", "InProcessLauncher", 2, world_size=2, global_rank=1,
           local_rank=1, node_rank=0, root_device="cuda:1"),
      F(cuda=2, env=TORCHRUN_FULL, env_label="torchrun's variables, rank 1 of 2")),
    C("torchelastic_over_slurm", "test_torchelastic_priority_over_slurm",
      "torchrun inside an srun step: both are detected",
      resolve("ddp"), "TorchElasticEnvironment", AGREES,
      Plan("DDPStrategy", "cuda", "TorchElasticEnvironment", "InProcessLauncher", 2, world_size=2, global_rank=1),
      F(cuda=2, hostname=HOST,
        env={**TORCHRUN_FULL, **SRUN_STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "0"},
        env_label="srun step and torchrun's variables, rank 1 of 2")),
    C("kubeflow_not_a_list", "test_strategy_choice_ddp_kubeflow", "plugins=KubeflowEnvironment(), not in a list",
      resolve(**GPU2, plugins=Make(KubeflowEnvironment, "KubeflowEnvironment()")),
      "CUDA, DDPStrategy, KubeflowEnvironment", BY_DESIGN,
      raises(MisconfigurationError, "expected a list of ready parts"),
      F(cuda=2, env=KUBEFLOW, env_label="a Kubeflow PyTorchJob of 20 pods, rank 1"), group="plugins_list"),
    C("kubeflow_two_devices", "test_strategy_choice_ddp_kubeflow", "Kubeflow, devices=2",
      resolve(**GPU2, plugins=[Make(KubeflowEnvironment, "KubeflowEnvironment()")]),
      "CUDA, DDPStrategy, KubeflowEnvironment, local rank 0", STRICTER,
      raises(MisconfigurationError, "a Kubeflow PyTorchJob runs one process per pod", "WORLD_SIZE=20 pod(s)"),
      F(cuda=2, env=KUBEFLOW, env_label="a Kubeflow PyTorchJob of 20 pods, rank 1"), group="external_world"),
    C("kubeflow", "test_strategy_choice_ddp_kubeflow", "Kubeflow, one device per pod, 20 pods",
      resolve(accelerator="gpu", devices=1, num_nodes=20, plugins=[Make(KubeflowEnvironment, "KubeflowEnvironment()")]),
      "CUDA, DDPStrategy, KubeflowEnvironment, local rank 0", AGREES,
      Plan("DDPStrategy", "cuda", "KubeflowEnvironment", "InProcessLauncher", 1, world_size=20, global_rank=1,
           local_rank=0, node_rank=1, main_address="1.2.3.4", kept=("environment",)),
      F(cuda=2, env=KUBEFLOW, env_label="a Kubeflow PyTorchJob of 20 pods, rank 1")),
    C("kubeflow_detected", "test_strategy_choice_ddp_kubeflow", "Kubeflow's variables, no plugin",
      resolve(accelerator="gpu", devices=1, num_nodes=20),
      "LightningEnvironment (Kubeflow is never detected)", BY_DESIGN,
      Plan("DDPStrategy", "cuda", "KubeflowEnvironment", "InProcessLauncher", 1, world_size=20, global_rank=1),
      F(cuda=2, env=KUBEFLOW, env_label="a Kubeflow PyTorchJob of 20 pods, rank 1"), group="kubeflow_detected"),
    C("kubeflow_cpu", "test_strategy_choice_ddp_cpu_kubeflow", "Kubeflow on CPUs, one process per pod",
      resolve(accelerator="cpu", devices=1, num_nodes=20, plugins=[Make(KubeflowEnvironment, "KubeflowEnvironment()")]),
      "CPU, DDPStrategy, KubeflowEnvironment, local rank 0", AGREES,
      Plan("DDPStrategy", "cpu", "KubeflowEnvironment", "InProcessLauncher", 1, world_size=20, global_rank=1,
           local_rank=0),
      F(env=KUBEFLOW, env_label="a Kubeflow PyTorchJob of 20 pods, rank 1")),
    C("slurm_cpu_fabric_vars", "test_strategy_choice_ddp_cpu_slurm", "strategy auto under Fabric's Slurm variables",
      resolve(**CPU2), "CPU, DDPStrategy, SLURMEnvironment", BY_DESIGN, DDP_CPU2,
      F(env=FABRIC_SLURM, env_label="Fabric's Slurm variables"), group="slurm_job_id"),
    C("slurm_cpu_srun", "test_strategy_choice_ddp_cpu_slurm", "ddp inside an srun step of 2 tasks",
      resolve("ddp", **CPU2), "CPU, DDPStrategy, SLURMEnvironment, local rank 0", AGREES,
      Plan("DDPStrategy", "cpu", "SLURMEnvironment", "InProcessLauncher", 2, world_size=2, global_rank=0,
           local_rank=0, node_rank=0),
      F(hostname=HOST, env={**FABRIC_SLURM, **SRUN_STEP}, env_label="srun step, 2 tasks, rank 0")),
    C("tpu_ddp", "test_unsupported_tpu_choice", "ddp with accelerator xla and 16-true",
      resolve("ddp", accelerator="xla", precision="16-true"),
      "ValueError: XLAAccelerator can only be used with a SingleDeviceXLAStrategy or XLAStrategy", AGREES,
      raises(MisconfigurationError, NO_XLA_BACKEND), F(xla=8)),
    C("tpu_instance_one", "test_connector_with_tpu_accelerator_instance", "an XLAAccelerator() instance, one device",
      resolve(accelerator=Make(_xla_accelerator, "XLAAccelerator()"), devices=1),
      "the instance; SingleDeviceXLAStrategy", AGREES, dataclasses.replace(XLA_SINGLE, kept=("accelerator",)),
      F(xla=8)),
    C("tpu_instance_all", "test_connector_with_tpu_accelerator_instance", "an XLAAccelerator() instance, devices unset",
      resolve(accelerator=Make(_xla_accelerator, "XLAAccelerator()")),
      "the instance; XLAStrategy", AGREES, dataclasses.replace(XLA_ALL, kept=("accelerator",)), F(xla=8)),
    C("accelerator_instance_name", "test_connector_with_tpu_accelerator_instance",
      "an accelerator instance of another class whose name is 'xla' (phalanx's own row)",
      resolve("xla", accelerator=Make(MyXLA, "MyXLA()"), devices=8),
      "(the accelerator is used as its kind)", AGREES, dataclasses.replace(XLA_ALL, kept=("accelerator",)),
      F(xla=8), note="an accelerator instance is planned under its name, not its class"),
    C("mps_auto", "test_devices_auto_choice_mps", "accelerator and devices auto on a Mac",
      resolve(accelerator="auto", devices="auto"), "MPSAccelerator, SingleDeviceStrategy on mps:0", AGREES,
      SINGLE_MPS, MAC),
    C("instance_conflict", "test_parallel_devices_in_strategy_conflict_with_accelerator",
      "a ready CPU strategy and accelerator='cuda'",
      resolve(_ready("ddp", accelerator="cpu", devices=1), accelerator="cuda"),
      "ValueError: parallel_devices set through the strategy conflict with accelerator", AGREES,
      raises(MisconfigurationError, "ready DDPStrategy instance, so it already has its parts"), F(cuda=2)),
    C("hand_built_conflict", "test_parallel_devices_in_strategy_conflict_with_accelerator",
      "a DDPStrategy built by hand with a CPU accelerator and CUDA parallel_devices",
      Do(_hand_built_ddp, "DDPStrategy(accelerator=CPUAccelerator(), parallel_devices=[cuda:0 ... cuda:7], ...)"),
      "ValueError, but only against an accelerator flag given beside the strategy", BY_DESIGN,
      attrs(constructed=True, accelerator="cpu", root_device="cuda:0"), group="ready_instance"),
    C("two_environments", "test_plugin_only_one_instance_for_one_type", "two environments in plugins",
      resolve(plugins=[Make(LocalEnvironment, "LocalEnvironment()"), Make(SLURMEnvironment, "SLURMEnvironment()")]),
      "ValueError: received multiple values for ClusterEnvironment", AGREES,
      raises(MisconfigurationError, "plugins= has two environment parts, LocalEnvironment and SLURMEnvironment")),
    C("two_checkpoint_io", "test_plugin_only_one_instance_for_one_type", "two CheckpointIO in plugins",
      resolve(plugins=[Make(TorchCheckpointIO, "TorchCheckpointIO()"), Make(TorchCheckpointIO, "TorchCheckpointIO()")]),
      "ValueError: received multiple values for CheckpointIO", AGREES,
      raises(MisconfigurationError, "plugins= has two checkpoint_io parts")),
    C("two_precisions", "test_plugin_only_one_instance_for_one_type", "two precisions and two environments",
      resolve(plugins=[Make(FullPrecision, "FullPrecision()"), Make(DoublePrecision, "DoublePrecision()"),
                       Make(LocalEnvironment, "LocalEnvironment()"), Make(SLURMEnvironment, "SLURMEnvironment()")]),
      "ValueError: received multiple values for Precision, ClusterEnvironment", AGREES,
      raises(MisconfigurationError, "plugins= has two precision parts")),
    C("zero_cpu", "test_passing_zero_and_empty_list_to_devices_flag", "devices=0 on the CPU",
      resolve(accelerator="cpu", devices=0), "ValueError: value is not a valid input", AGREES,
      raises(MisconfigurationError, "devices=0 asks for no device")),
    C("zero_cuda_str", "test_passing_zero_and_empty_list_to_devices_flag", "devices='0' on CUDA",
      resolve(accelerator="cuda", devices="0"), "ValueError: value is not a valid input", AGREES,
      raises(MisconfigurationError, "devices='0' asks for no device"), F(cuda=2)),
    C("zero_mps_list", "test_passing_zero_and_empty_list_to_devices_flag", "devices=[] on MPS",
      resolve(accelerator="mps", devices=[]), "ValueError: value is not a valid input", AGREES,
      raises(MisconfigurationError, "devices=[] asks for no device"), MAC),
    C("zero_tpu", "test_passing_zero_and_empty_list_to_devices_flag", "devices=0 on TPUs",
      resolve(accelerator="tpu", devices=0), "ValueError: value is not a valid input", AGREES,
      raises(MisconfigurationError, "devices=0 asks for no device"), F(xla=8)),
    C("gpu_on_cuda", "test_gpu_accelerator_backend_choice", "'gpu' on a CUDA machine",
      resolve(accelerator="gpu"), "CUDAAccelerator", AGREES, SINGLE_CUDA, F(cuda=1)),
    C("gpu_on_mac", "test_gpu_accelerator_backend_choice", "'gpu' on a Mac",
      resolve(accelerator="gpu"), "MPSAccelerator", BY_DESIGN,
      raises(UnavailableError, "accelerator 'cuda' cannot be used here", "is Apple's: use accelerator='mps'"),
      MAC, group="gpu_is_cuda"),
    C("gpu_cuda", "test_gpu_accelerator_backend_choice_cuda", "'gpu' with CUDA and no MPS",
      resolve(accelerator="gpu"), "CUDAAccelerator", AGREES, SINGLE_CUDA, F(cuda=1)),
    C("gpu_mps", "test_gpu_accelerator_backend_choice_mps", "'gpu' with MPS and no CUDA",
      resolve(accelerator="gpu"), "MPSAccelerator", BY_DESIGN,
      raises(UnavailableError, "use accelerator='mps'"), MAC, group="gpu_is_cuda"),
    C("gpu_none", "test_gpu_accelerator_no_gpu_backend_found_error", "'gpu' with neither CUDA nor MPS",
      resolve(accelerator="gpu"), "RuntimeError: No supported gpu backend found!", AGREES,
      raises(UnavailableError, "accelerator 'cuda' cannot be used here", "no CUDA device is visible"),
      F(cuda=0, cuda_build=True)),
    C("fork_unsupported", "test_ddp_fork_on_unsupported_platform", "ddp_fork where no start method exists",
      resolve("ddp_fork"), "ValueError: process forking is not supported on this platform", AGREES,
      raises(MisconfigurationError, "launcher start_method='fork': this platform cannot start processes that way",
             "use launcher='subprocess'"),
      F(start_methods=())),
    C("fork_on_windows", "test_ddp_fork_on_unsupported_platform", "ddp_notebook where only spawn exists (Windows)",
      resolve("ddp_notebook"), "ValueError: process forking is not supported on this platform", AGREES,
      raises(MisconfigurationError, "(its start methods: spawn); use launcher='spawn'"),
      F(start_methods=("spawn",))),
    C("precision_64_true", "test_precision_selection", "64-true", resolve(precision="64-true"),
      "DoublePrecision", AGREES, dataclasses.replace(SINGLE_CPU, precision="64-true")),
    C("precision_16_true", "test_precision_selection", "16-true", resolve(precision="16-true"),
      "HalfPrecision", AGREES, dataclasses.replace(SINGLE_CPU, precision="16-true")),
    C("precision_bf16_true", "test_precision_selection", "bf16-true", resolve(precision="bf16-true"),
      "HalfPrecision", AGREES, dataclasses.replace(SINGLE_CPU, precision="bf16-true")),
    C("precision_bf16_mixed", "test_precision_selection", "bf16-mixed on the CPU", resolve(precision="bf16-mixed"),
      "MixedPrecision", AGREES, dataclasses.replace(SINGLE_CPU, precision="bf16-mixed")),
    C("precision_fsdp", "test_precision_selection", "fsdp with 16-mixed on a GPU",
      resolve("fsdp", precision="16-mixed"), "FSDPPrecision", AGREES,
      Plan("FSDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 1, precision="16-mixed"), F(cuda=1),
      note="fsdp keeps the plain precision classes"),
    C("sixteen_mixed_cpu", "test_precision_selection_16_on_cpu_warns", "16-mixed on the CPU",
      resolve(accelerator="cpu", precision="16-mixed"), "warns and uses bf16-mixed", STRICTER,
      raises(MisconfigurationError, "precision '16-mixed' on accelerator 'cpu'", "use precision='bf16-mixed'"),
      group="sixteen_mixed_cpu"),
    C("amp_ddp", "test_precision_selection_amp_ddp", "ddp, 16-mixed on the CPU",
      resolve("ddp", **CPU2, precision="16-mixed"), "MixedPrecision (bf16-mixed, after a warning)", STRICTER,
      raises(MisconfigurationError, "precision '16-mixed' on accelerator 'cpu'"), group="sixteen_mixed_cpu"),
    C("amp_ddp_custom", "test_precision_selection_amp_ddp", "a custom 16-mixed precision for the CPU",
      resolve("ddp_spawn", **CPU2, plugins=[Make(lambda: MyAMP(accelerator=CPUAccelerator()),
                                                   "MyAMP(accelerator=CPUAccelerator())")]),
      "keeps MyAMP('16-mixed', 'cpu')", STRICTER,
      raises(MisconfigurationError, "precision '16-mixed' on accelerator 'cpu'"), group="sixteen_mixed_cpu"),
    C("amp_ddp_custom_bf16", "test_precision_selection_amp_ddp", "a custom bf16-mixed precision for the CPU",
      resolve("ddp", **CPU2, plugins=[Make(lambda: MyBF16(accelerator=CPUAccelerator()),
                                              "MyBF16(accelerator=CPUAccelerator())")]),
      "keeps the instance", AGREES, dataclasses.replace(DDP_CPU2, precision="bf16-mixed", kept=("precision",))),
    C("manual_bf16_true", "test_precision_selection_model_parallel", "your own parallelism with bf16-true",
      resolve("manual", precision="bf16-true"), "accepted", AGREES,
      Plan("ManualStrategy", "cpu", "LocalEnvironment", "SubprocessLauncher", 1, precision="bf16-true")),
    C("manual_16_mixed", "test_precision_selection_model_parallel", "your own parallelism with 16-mixed on the CPU",
      resolve("manual", precision="16-mixed"), "ValueError: does not support 16-mixed", AGREES,
      raises(MisconfigurationError, "precision '16-mixed' on accelerator 'cpu'")),
    C("bitsandbytes", "test_bitsandbytes_precision_cuda_required", "a bitsandbytes precision on the CPU",
      resolve(accelerator="cpu", precision="bnb-int8"), "RuntimeError: Bitsandbytes is only supported on CUDA GPUs",
      BY_DESIGN, raises(UnknownNameError, "unknown precision 'bnb-int8'"), group="not_provided"),
    C("case_sensitive", "test_strategy_str_passed_being_case_insensitive", "strategy 'DDP'",
      resolve("DDP"), "DDPStrategy", BY_DESIGN,
      raises(UnknownNameError, "unknown strategy 'DDP'", "Did you mean 'ddp'? Names are case-sensitive"),
      group="case_sensitive"),
    C("precision_from_cli", "test_precision_from_environment", "the precision from `phalanx run --precision 64-true`",
      resolve(accelerator="cuda"), "DoublePrecision (from LT_PRECISION)", AGREES,
      dataclasses.replace(SINGLE_CUDA, precision="64-true"),
      F(cuda=1, env=run_flags(precision="64-true"), env_label="phalanx run --precision 64-true")),
    C("precision_from_cli_mixed", "test_precision_from_environment",
      "the precision from `phalanx run --precision 16-mixed`",
      resolve(accelerator="cuda"), "MixedPrecision (from LT_PRECISION)", AGREES,
      dataclasses.replace(SINGLE_CUDA, precision="16-mixed"),
      F(cuda=1, env=run_flags(precision="16-mixed"), env_label="phalanx run --precision 16-mixed")),
    C("strategy_from_cli", "test_accelerator_strategy_from_environment",
      "accelerator and strategy from `phalanx run --accelerator cpu --strategy ddp`",
      resolve(), "CPUAccelerator, DDPStrategy (from LT_ACCELERATOR, LT_STRATEGY)", AGREES,
      dataclasses.replace(DDP_CPU2, devices=1),
      F(env=run_flags(accelerator="cpu", strategy="ddp"),
        env_label="phalanx run --accelerator cpu --strategy ddp")),
    C("accelerator_from_cli", "test_accelerator_strategy_from_environment",
      "the accelerator from `phalanx run --accelerator mps`",
      resolve(), "MPSAccelerator, SingleDeviceStrategy", AGREES, SINGLE_MPS,
      F(mps=True, cuda_build=False, env=run_flags(accelerator="mps"), env_label="phalanx run --accelerator mps")),
    C("devices_from_cli", "test_devices_from_environment", "`phalanx run --devices 2 --num-nodes 3 --node-rank 0`",
      resolve(accelerator="cuda"), "CUDA, DDPStrategy on 2 devices, 3 nodes", AGREES,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 2, main_address="10.1.2.3"),
      F(cuda=8, env={**run_flags(devices=2, num_nodes=3), "NODE_RANK": "0", "MASTER_ADDR": "10.1.2.3",
                     "MASTER_PORT": "29500"},
        env_label="phalanx run --devices 2 --num-nodes 3 --node-rank 0 --main-address 10.1.2.3")),
    C("devices_from_cli_no_node_rank", "test_devices_from_environment",
      "devices and num_nodes from the command line, without a node rank",
      resolve(accelerator="cuda"), "CUDA, DDPStrategy on 2 devices, 3 nodes", STRICTER,
      raises(MisconfigurationError, "num_nodes=3 on the local environment needs NODE_RANK"),
      F(cuda=8, env=run_flags(devices=2, num_nodes=3), env_label="PHALANX_RUN_FLAGS: devices 2, num_nodes 3"),
      group="multi_node_local"),
    C("collision_accelerator", "test_arguments_from_environment_collision",
      "`phalanx run --accelerator cpu` and accelerator='cuda' in the code",
      resolve(accelerator="cuda"), "ValueError naming both values", AGREES,
      raises(MisconfigurationError, "`phalanx run --accelerator cpu` and resolve(accelerator='cuda')",
             "disagree"),
      F(cuda=1, env=run_flags(accelerator="cpu"), env_label="phalanx run --accelerator cpu")),
    C("collision_devices", "test_arguments_from_environment_collision",
      "`phalanx run --devices 2` and devices=3 in the code",
      resolve(devices=3), "ValueError naming both values", AGREES,
      raises(MisconfigurationError, "`phalanx run --devices 2` and resolve(devices=3)"),
      F(env=run_flags(devices=2), env_label="phalanx run --devices 2")),
    C("collision_precision", "test_arguments_from_environment_collision",
      "`phalanx run --precision 16-mixed` and precision='64-true' in the code",
      resolve(precision="64-true"), "ValueError naming both values", AGREES,
      raises(MisconfigurationError, "`phalanx run --precision 16-mixed` and resolve(precision='64-true')"),
      F(env=run_flags(precision="16-mixed"), env_label="phalanx run --precision 16-mixed")),
    C("collision_same_value", "test_arguments_from_environment_collision",
      "`phalanx run --precision 16-mixed` and precision=16 (the same value) in the code",
      resolve(accelerator="cuda", precision=16), "no error", AGREES,
      dataclasses.replace(SINGLE_CUDA, precision="16-mixed"),
      F(cuda=1, env=run_flags(precision="16-mixed"), env_label="phalanx run --precision 16-mixed")),
    C("fsdp_cpu", "test_fsdp_unsupported_on_cpu", "fsdp on the CPU",
      resolve("fsdp", **CPU2), "ValueError: FSDP is only available on GPU", BY_DESIGN,
      Plan("FSDPStrategy", "cpu", "LocalEnvironment", "SubprocessLauncher", 2), group="fsdp_cpu"),
    C("defaults", "test_connector_defaults_match_fabric_defaults",
      "resolve()'s defaults and Registry.plan()'s",
      Do(_defaults, "inspect.signature(phalanx.resolve) vs Registry.plan"),
      "the connector's defaults equal Fabric's", AGREES, attrs(**{"same defaults": True})),
    C("auto_cpu", "test_connector_auto_selection", "resolve() on a CPU machine", resolve(),
      "CPUAccelerator, SingleDeviceStrategy, devices 1", AGREES, SINGLE_CPU, F(cuda_build=False)),
    C("auto_one_cuda", "test_connector_auto_selection", "resolve() with one GPU", resolve(),
      "CUDAAccelerator, SingleDeviceStrategy on cuda:0", AGREES, SINGLE_CUDA, F(cuda=1)),
    C("auto_four_cuda", "test_connector_auto_selection", "resolve() with four GPUs", resolve(),
      "DDPStrategy over the 4 GPUs, LightningEnvironment, popen", AGREES,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 4), F(cuda=4)),
    C("auto_mps", "test_connector_auto_selection", "resolve() on a Mac", resolve(),
      "MPSAccelerator, SingleDeviceStrategy", AGREES, SINGLE_MPS, MAC),
    C("auto_one_tpu", "test_connector_auto_selection", "resolve() with one TPU device", resolve(),
      "XLAAccelerator, SingleDeviceXLAStrategy", AGREES, XLA_SINGLE, F(xla=1)),
    C("auto_eight_tpu", "test_connector_auto_selection", "resolve() with 8 TPU devices", resolve(),
      "XLAStrategy over 8, XLAEnvironment", AGREES, XLA_ALL, F(xla=8)),
    C("auto_tpu_and_cuda", "test_connector_auto_selection", "resolve() with 8 TPU devices and 4 GPUs", resolve(),
      "the TPUs: XLAStrategy over 8", BY_DESIGN,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "SubprocessLauncher", 4), F(cuda=4, xla=8),
      group="accelerator_priority"),
    C("notebook_auto_four_cuda", "test_connector_auto_selection", "resolve() with four GPUs, in a notebook",
      resolve(), "SingleDeviceStrategy on cuda:0", BY_DESIGN,
      Plan("DDPStrategy", "cuda", "LocalEnvironment", "MultiprocessingLauncher", 4, start_method="fork",
           interactive=True),
      F(cuda=4, interactive=True), group="notebook_all_devices"),
    C("notebook_auto_one_tpu", "test_connector_auto_selection", "resolve() with one TPU device, in a notebook",
      resolve(), "SingleDeviceXLAStrategy", STRICTER,
      raises(MisconfigurationError, "launcher 'xla' cannot run in a notebook or REPL"),
      F(xla=1, interactive=True), group="xla_notebook"),
    C("notebook_auto_eight_tpu", "test_connector_auto_selection", "resolve() with 8 TPU devices, in a notebook",
      resolve(), "XLAStrategy over 8, launcher with the fork start method", STRICTER,
      raises(MisconfigurationError, "launcher 'xla' cannot run in a notebook or REPL"),
      F(xla=8, interactive=True), group="xla_notebook",
      note="the xla strategy's launcher starts replicas from a script; in a notebook it is refused, "
      "not replaced by ddp_notebook (whose torch collective cannot run on xla)"),
    C("xla_fsdp", "test_xla_fsdp_automatic_strategy_selection", "fsdp on TPUs",
      resolve("fsdp", accelerator="xla"), "XLAFSDPStrategy", BY_DESIGN,
      raises(MisconfigurationError, NO_XLA_BACKEND), F(xla=8), group="not_provided"),
    C("xla_fsdp_name", "test_xla_fsdp_automatic_strategy_selection", "strategy 'xla_fsdp'",
      resolve("xla_fsdp", accelerator="xla"), "XLAFSDPStrategy", BY_DESIGN,
      raises(UnknownNameError, "unknown strategy 'xla_fsdp'"), F(xla=8), group="not_provided"),
    # ---- plugins/environments/test_lightning.py
    C("hand_started", "environments/test_lightning.py::test_manual_user_launch",
      "processes started by hand with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT",
      resolve("ddp", **CPU2), "runs in the given processes and starts none", AGREES,
      Plan("DDPStrategy", "cpu", "VariablesEnvironment", "InProcessLauncher", 2, world_size=2, global_rank=1,
           local_rank=1, node_rank=0),
      F(env=HAND_STARTED, env_label="RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 MASTER_ADDR MASTER_PORT")),
    C("local_rank_only", "environments/test_lightning.py::test_manual_user_launch",
      "only LOCAL_RANK=2 set, one device",
      resolve(accelerator="cpu", devices=1), "the processes were created externally", STRICTER,
      raises(MisconfigurationError, "LOCAL_RANK=2 is set, but devices=1"), F(env={"LOCAL_RANK": "2"}),
      note="LOCAL_RANK alone is not a launch: it is refused, naming the variables of one",
      group="external_world"),
    C("local_defaults", "environments/test_lightning.py::test_default_attributes", "no variables",
      Env(LocalEnvironment), "not external, 127.0.0.1, world 1, ranks 0", AGREES,
      attrs(creates_processes_externally=False, main_address="127.0.0.1", world_size=1, global_rank=0,
            local_rank=0, node_rank=0)),
    C("local_attrs", "environments/test_lightning.py::test_attributes_from_environment_variables",
      "MASTER_ADDR, MASTER_PORT, LOCAL_RANK, NODE_RANK set", Env(LocalEnvironment),
      "1.2.3.4, 500, local rank 2, node rank 3", AGREES,
      attrs(main_address="1.2.3.4", main_port=500, world_size=1, global_rank=0, local_rank=2, node_rank=3),
      F(env={"MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "500", "LOCAL_RANK": "2", "NODE_RANK": "3"})),
    C("local_group_rank", "environments/test_lightning.py::test_node_rank_from_group_rank", "GROUP_RANK=1 only",
      Env(LocalEnvironment), "node_rank 1", BY_DESIGN, attrs(node_rank=0), F(env={"GROUP_RANK": "1"}),
      group="env_views"),
    C("local_port", "environments/test_lightning.py::test_random_main_port", "no MASTER_PORT",
      Env(LocalEnvironment), "a free port, the same on every call", BY_DESIGN, attrs(main_port=29500),
      group="ports"),
    C("local_teardown", "environments/test_lightning.py::test_teardown", "WORLD_SIZE=1, then teardown()",
      Do(_teardown, "LocalEnvironment().teardown()"), "WORLD_SIZE removed", BY_DESIGN,
      attrs(**{"WORLD_SIZE still set": True}), F(env={"WORLD_SIZE": "1"}), group="env_views"),
    C("local_detect", "environments/test_lightning.py::test_detect", "detect()", Env(LocalEnvironment),
      "True", AGREES, attrs(detect=True)),
    # ---- plugins/environments/test_slurm.py
    C("slurm_defaults", "environments/test_slurm.py::test_default_attributes", "no variables",
      Env(SLURMEnvironment), "127.0.0.1, port 12910; world_size, local_rank, node_rank raise KeyError", BY_DESIGN,
      attrs(creates_processes_externally=True, main_address="127.0.0.1", world_size=1, global_rank=0),
      group="slurm_job_id"),
    C("slurm_attrs_no_step", "environments/test_slurm.py::test_attributes_from_environment_variables",
      "Fabric's variables, with no SLURM_STEP_ID (not under srun)", Env(SLURMEnvironment),
      "main 1.1.1.1, world 20, rank 1, local 2, node 3", BY_DESIGN,
      attrs(main_address="127.0.0.1", world_size=1, global_rank=0, local_rank=0, node_rank=0),
      F(env=SLURM_ATTRS, env_label="Fabric's variables: NTASKS 20, PROCID 1, LOCALID 2, NODEID 3"),
      group="slurm_job_id"),
    C("slurm_attrs", "environments/test_slurm.py::test_attributes_from_environment_variables",
      "the same inside an srun step (SLURM_STEP_ID=0)", Env(SLURMEnvironment),
      "main 1.1.1.1, world 20, rank 1, local 2, node 3", AGREES,
      attrs(main_address="1.1.1.1", world_size=20, global_rank=1, local_rank=2, node_rank=3),
      F(hostname=HOST, env={**SLURM_ATTRS, "SLURM_STEP_ID": "0"},
        env_label="Fabric's variables and SLURM_STEP_ID=0")),
    C("slurm_port", "environments/test_slurm.py::test_attributes_from_environment_variables",
      "the port for job 0001234", Env(SLURMEnvironment), "15000 + 1234 = 16234", BY_DESIGN,
      attrs(main_port=11234), F(env={**SLURM_ATTRS, "SLURM_STEP_ID": "0"}, env_label="SLURM_JOB_ID=0001234"),
      group="ports"),
    C("slurm_nodelist_range", "environments/test_slurm.py::test_main_address_from_slurm_node_list",
      "SLURM_NODELIST='1.2.3.[100-110]'", Env(SLURMEnvironment), "1.2.3.100", AGREES,
      attrs(main_address="1.2.3.100"), F(hostname=HOST, env=slurm_step_attrs("1.2.3.[100-110]"))),
    C("slurm_nodelist_padded", "environments/test_slurm.py::test_main_address_from_slurm_node_list",
      "SLURM_NODELIST='1.2.3.[089, 100-110]'", Env(SLURMEnvironment), "1.2.3.089", AGREES,
      attrs(main_address="1.2.3.089"), F(hostname=HOST, env=slurm_step_attrs("1.2.3.[089, 100-110]"))),
    C("slurm_nodelist_unordered", "environments/test_slurm.py::test_main_address_from_slurm_node_list",
      "SLURM_NODELIST='host[5-9,1]'", Env(SLURMEnvironment), "host5", AGREES,
      attrs(main_address="host5"), F(hostname=HOST, env=slurm_step_attrs("host[5-9,1]"))),
    C("slurm_nodelist_mixed", "environments/test_slurm.py::test_main_address_from_slurm_node_list",
      "SLURM_NODELIST='alpha[3,1], beta'", Env(SLURMEnvironment), "alpha3", AGREES,
      attrs(main_address="alpha3"), F(hostname=HOST, env=slurm_step_attrs("alpha[3,1], beta"))),
    C("slurm_nodelist_one_host", "environments/test_slurm.py::test_main_address_from_slurm_node_list",
      "SLURM_NODELIST='host[22]' (one host)", Env(SLURMEnvironment), "host22", BY_DESIGN,
      attrs(main_address="127.0.0.1"), F(hostname=HOST, env=slurm_step_attrs("host[22]")),
      group="one_host_loopback"),
    C("slurm_master_env", "environments/test_slurm.py::test_main_address_and_port_from_env_variable",
      "MASTER_ADDR and MASTER_PORT set", Env(SLURMEnvironment), "1.2.3.4, 1234", AGREES,
      attrs(main_address="1.2.3.4", main_port=1234),
      F(env={"MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "1234", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"})),
    C("slurm_detect_none", "environments/test_slurm.py::test_detect", "no variables", Env(SLURMEnvironment),
      "False", AGREES, attrs(detect=False)),
    C("slurm_detect_ntasks", "environments/test_slurm.py::test_detect", "SLURM_NTASKS=2 only",
      Env(SLURMEnvironment), "True", BY_DESIGN, attrs(detect=False), F(env={"SLURM_NTASKS": "2"}),
      group="slurm_job_id"),
    C("slurm_detect_bash", "environments/test_slurm.py::test_detect", "a job named bash",
      Env(SLURMEnvironment), "False", BY_DESIGN, attrs(detect=True),
      F(env={"SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "bash"}), group="slurm_job_id"),
    C("srun_not_used_one", "environments/test_slurm.py::test_srun_available_and_not_used",
      "inside an allocation, not started with srun, one device", resolve(accelerator="cpu", devices=1),
      "a warning naming srun; one process", AGREES,
      Plan("SingleDeviceStrategy", "cpu", "SLURMEnvironment", "InProcessLauncher", 1),
      F(hostname=HOST, env=SALLOC, env_label="a batch script: SLURM_JOB_ID, no SLURM_STEP_ID")),
    C("srun_not_used_two", "environments/test_slurm.py::test_srun_available_and_not_used",
      "inside an allocation, not started with srun, two devices", resolve(**CPU2),
      "a warning naming srun", STRICTER,
      raises(MisconfigurationError, "was not started with srun", "srun --nodes=1 --ntasks-per-node=2"),
      F(hostname=HOST, env=SALLOC, env_label="a batch script: SLURM_JOB_ID, no SLURM_STEP_ID"),
      group="slurm_job_id"),
    C("srun_ntasks", "environments/test_slurm.py::test_srun_variable_validation",
      "an srun step of 2 tasks, one device asked for", resolve(accelerator="cpu", devices=1),
      "RuntimeError: You set --ntasks=2 in your SLURM bash script", AGREES,
      raises(MisconfigurationError, "started SLURM_NTASKS=2 process(es)", "devices=1 x num_nodes=1 = 1"),
      F(hostname=HOST, env={"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
                            "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": HOST},
        env_label="srun step, SLURM_NTASKS=2")),
    C("slurm_validate_ok", "environments/test_slurm.py::test_validate_user_settings",
      "4 tasks per node on 2 nodes; devices 4, num_nodes 2", Validate(SLURMEnvironment, 4, 2), "ok", AGREES,
      attrs(validate="ok"),
      F(env={"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0",
             "SLURM_NTASKS": "8", "SLURM_NODELIST": "n[1-2]"}, env_label="srun step: 4 tasks on each of 2 nodes")),
    C("slurm_validate_devices", "environments/test_slurm.py::test_validate_user_settings",
      "4 tasks per node on 2 nodes; devices 2", Validate(SLURMEnvironment, 2, 2),
      "ValueError: tasks per node do not match devices", AGREES,
      raises(MisconfigurationError, "started SLURM_NTASKS=8 process(es), but devices=2 x num_nodes=2 = 4"),
      F(env={"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0",
             "SLURM_NTASKS": "8", "SLURM_NODELIST": "n[1-2]"}, env_label="srun step: 4 tasks on each of 2 nodes")),
    C("slurm_validate_nodes", "environments/test_slurm.py::test_validate_user_settings",
      "4 tasks per node on 2 nodes; num_nodes 1", Validate(SLURMEnvironment, 4, 1),
      "ValueError: nodes do not match num_nodes", AGREES,
      raises(MisconfigurationError, "runs on SLURM_NNODES=2 node(s), but num_nodes=1"),
      F(env={"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0",
             "SLURM_NTASKS": "8", "SLURM_NODELIST": "n[1-2]"}, env_label="srun step: 4 tasks on each of 2 nodes")),
    C("slurm_ip_hosts", "environments/test_slurm.py::test_main_address_from_slurm_node_list",
      "an srun step on 2 nodes named by IP address, on the second (phalanx's own row)",
      resolve(accelerator="cpu", devices=1, num_nodes=2), "(the first host of the list)", AGREES,
      Plan("DDPStrategy", "cpu", "SLURMEnvironment", "InProcessLauncher", 1, world_size=2, global_rank=1,
           local_rank=0, node_rank=1, main_address="10.0.0.1"),
      F(hostname="10.0.0.2", env=SLURM_TWO_IP_NODES, env_label="srun step on 10.0.0.[1-2], rank 1")),
    # ---- plugins/environments/test_lsf.py
    C("lsf_missing_rankfile", "environments/test_lsf.py::test_missing_lsb_djob_rankfile", "LSB_JOBID only",
      Env(LSFEnvironment), "ValueError: did not find LSB_DJOB_RANKFILE", BY_DESIGN,
      attrs(detect=True, world_size=1, global_rank=0), F(env={"LSB_JOBID": "1234"}), group="lsf"),
    C("lsf_empty_rankfile", "environments/test_lsf.py::test_empty_lsb_djob_rankfile", "LSB_DJOB_RANKFILE=''",
      Env(LSFEnvironment), "ValueError: LSB_DJOB_RANKFILE is empty", BY_DESIGN, attrs(world_size=1),
      F(env={"LSB_JOBID": "1234", "LSB_DJOB_RANKFILE": ""}), group="env_views"),
    C("lsf_missing_jobid", "environments/test_lsf.py::test_missing_lsb_job_id", "a rank file but no LSB_JOBID",
      Env(LSFEnvironment), "ValueError: could not find the job id", BY_DESIGN, attrs(detect=False),
      F(env={"LSB_DJOB_RANKFILE": "{tmp}/rankfile"}, files=LSF_HOSTS_FILE), group="lsf"),
    C("lsf_port", "environments/test_lsf.py::test_manual_main_port_and_address", "job 1234",
      Env(LSFEnvironment), "10000 + 234 = 10234", BY_DESIGN, attrs(main_port=11234),
      F(hostname="10.10.10.2", env=LSF_VARS, files=LSF_HOSTS_FILE, env_label="LSB_JOBID=1234, jsrun rank 3 of 4"),
      group="ports"),
    C("lsf_attrs", "environments/test_lsf.py::test_attributes_from_environment_variables",
      "rank file of hosts 10.10.10.0-3, this host 10.10.10.2", Env(LSFEnvironment),
      "main 10.10.10.0, world 4, rank 3, local 1, detected", AGREES,
      attrs(main_address="10.10.10.0", world_size=4, global_rank=3, local_rank=1, detect=True),
      F(hostname="10.10.10.2", env=LSF_VARS, files=LSF_HOSTS_FILE, env_label="LSB_JOBID=1234, jsrun rank 3 of 4")),
    C("lsf_node_rank", "environments/test_lsf.py::test_node_rank", "this host 10.10.10.2, third in the rank file",
      Env(LSFEnvironment), "node_rank 2", AGREES, attrs(node_rank=2),
      F(hostname="10.10.10.2", env=LSF_VARS, files=LSF_HOSTS_FILE, env_label="LSB_JOBID=1234, jsrun rank 3 of 4")),
    C("lsf_node_rank_fqdn", "environments/test_lsf.py::test_node_rank",
      "hosts node1.a.example and node1.b.example, this host the second (phalanx's own row)", Env(LSFEnvironment),
      "(node_rank 1)", AGREES, attrs(node_rank=1),
      F(hostname="node1.b.example", env=LSF_VARS, files={"rankfile": "batch\nnode1.a.example\nnode1.b.example"},
        env_label="LSB_JOBID=1234, jsrun rank 3 of 4")),
    C("lsf_detect_empty", "environments/test_lsf.py::test_detect", "every LSF variable set, but empty",
      Env(LSFEnvironment), "True", BY_DESIGN, attrs(detect=False),
      F(env={"LSB_DJOB_RANKFILE": "", "LSB_JOBID": "", "JSM_NAMESPACE_SIZE": "", "JSM_NAMESPACE_LOCAL_RANK": ""}),
      group="env_views"),
    # ---- plugins/environments/test_torchelastic.py
    C("torchelastic_defaults", "environments/test_torchelastic.py::test_default_attributes", "no variables",
      Env(TorchElasticEnvironment), "127.0.0.1, port 12910; world_size and local_rank raise KeyError", STRICTER,
      attrs(main_address="127.0.0.1", world_size=Err(MisconfigurationError, "needs WORLD_SIZE, which is not set"),
            main_port=Err(MisconfigurationError, "needs MASTER_PORT")),
      group="torchrun_vars"),
    C("torchelastic_attrs", "environments/test_torchelastic.py::test_attributes_from_environment_variables",
      "MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, GROUP_RANK set", Env(TorchElasticEnvironment),
      "the values back", AGREES,
      attrs(main_address="1.2.3.4", main_port=500, world_size=20, global_rank=1, local_rank=2, node_rank=3),
      F(env={"MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "500", "WORLD_SIZE": "20", "RANK": "1", "LOCAL_RANK": "2",
             "GROUP_RANK": "3"})),
    C("torchelastic_detect_empty", "environments/test_torchelastic.py::test_detect", "TORCHELASTIC_RUN_ID=''",
      Env(TorchElasticEnvironment), "True", BY_DESIGN, attrs(detect=False), F(env={"TORCHELASTIC_RUN_ID": ""}),
      group="env_views"),
    C("torchelastic_validate_partial", "environments/test_torchelastic.py::test_validate_user_settings",
      "TORCHELASTIC_RUN_ID and WORLD_SIZE=8 only; devices 4, num_nodes 2", Validate(TorchElasticEnvironment, 4, 2),
      "ok", STRICTER, raises(MisconfigurationError, "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set"),
      F(env={"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "8"}), group="torchrun_vars"),
    C("torchelastic_validate", "environments/test_torchelastic.py::test_validate_user_settings",
      "torchrun's variables, WORLD_SIZE=8; devices 2, num_nodes 2", Validate(TorchElasticEnvironment, 2, 2),
      "ValueError: the product (2 * 2) does not match the world size (8)", AGREES,
      raises(MisconfigurationError, "torchrun started WORLD_SIZE=8 process(es), but devices=2 x num_nodes=2 = 4"),
      F(env={"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
             "MASTER_PORT": "1"})),
    # ---- plugins/environments/test_mpi.py
    C("mpi_detect", "environments/test_mpi.py::test_detect", "mpirun's variables, world size 2",
      Env(MPIEnvironment), "True", AGREES, attrs(detect=True),
      F(env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})),
    C("mpi_detect_one", "environments/test_mpi.py::test_detect", "mpirun's variables, world size 1",
      resolve(accelerator="cpu"), "not detected", BY_DESIGN,
      Plan("SingleDeviceStrategy", "cpu", "MPIEnvironment", "InProcessLauncher", 1),
      F(env={"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}), group="mpi_variables"),
    C("mpi_defaults", "environments/test_mpi.py::test_default_attributes", "no variables",
      Env(MPIEnvironment), "creates processes externally; node_rank, main_address, main_port unset", BY_DESIGN,
      attrs(creates_processes_externally=True, main_address="127.0.0.1", main_port=29500,
            world_size=Err(MisconfigurationError, "needs OMPI_COMM_WORLD_SIZE or PMI_SIZE")),
      group="mpi_variables"),
    C("mpi_node_rank", "environments/test_mpi.py::test_init_local_comm", "rank 3 of 4, two ranks per node",
      Env(MPIEnvironment), "node rank 1 (from the host names), local rank 1", AGREES,
      attrs(world_size=4, global_rank=3, local_rank=1, node_rank=1, main_address="host1"),
      F(env={"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "host1"}),
      note="the node rank is rank // local size, which validate() checks"),
    C("mpi_world", "environments/test_mpi.py::test_world_comm", "world size 8, rank 3", Env(MPIEnvironment),
      "world_size 8, global_rank 3", AGREES, attrs(world_size=8, global_rank=3),
      F(env={"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3"})),
    # ---- plugins/environments/test_kubeflow.py
    C("kubeflow_defaults", "environments/test_kubeflow.py::test_default_attributes", "no variables",
      Env(KubeflowEnvironment), "world_size, global_rank raise KeyError; local_rank 0", AGREES,
      attrs(creates_processes_externally=True, local_rank=0,
            world_size=Err(MisconfigurationError, "needs WORLD_SIZE"),
            global_rank=Err(MisconfigurationError, "needs RANK"))),
    C("kubeflow_attrs", "environments/test_kubeflow.py::test_attributes_from_environment_variables",
      "a PyTorchJob's variables", Env(KubeflowEnvironment), "1.2.3.4, 500, world 20, rank 1, local 0, node 1",
      AGREES, attrs(main_address="1.2.3.4", main_port=500, world_size=20, global_rank=1, local_rank=0, node_rank=1),
      F(env=KUBEFLOW, env_label="a Kubeflow PyTorchJob of 20 pods, rank 1")),
    C("kubeflow_detect", "environments/test_kubeflow.py::test_detect_kubeflow", "a PyTorchJob's variables",
      Env(KubeflowEnvironment), "NotImplementedError: cannot be detected", BY_DESIGN, attrs(detect=True),
      F(env=KUBEFLOW, env_label="a Kubeflow PyTorchJob of 20 pods, rank 1"), group="kubeflow_detected"),
]
# fmt: on


GROUPS: dict[str, tuple[str, str]] = {
    "gpu_is_cuda": (
        "'gpu' means CUDA",
        "accelerator='gpu' is another name for 'cuda' and for nothing else. Fabric turns 'gpu' into MPS on "
        "a Mac; phalanx refuses it there and says to pass accelerator='mps', so that one flag never means "
        "two device types.",
    ),
    "not_provided": (
        "No DataParallel, DeepSpeed, XLA FSDP, bitsandbytes or Transformer Engine",
        "phalanx has no 'dp', 'deepspeed' or 'xla_fsdp' strategy and no 'bnb-*' or 'transformer-engine' "
        "precision. Asking for one is an UnknownNameError that lists the names that exist (and suggests "
        "'ddp' for 'dp'); Fabric, given 'dp' on the CPU, warns and uses DDP. 'fsdp' with accelerator "
        "'xla' is refused because torch.distributed has no 'xla' backend.",
    ),
    "case_sensitive": (
        "Names are case-sensitive",
        "'DDP' is not 'ddp'. Fabric lower-cases strategy names; phalanx refuses the other spelling and "
        "suggests the right one.",
    ),
    "slurm_job_id": (
        "Slurm is detected by SLURM_JOB_ID, and its ranks are read inside an srun step",
        "srun sets SLURM_JOB_ID and SLURM_STEP_ID in every task. Fabric detects Slurm by SLURM_NTASKS, "
        "and its tests set only that kind of variable; phalanx does not take those for a Slurm job, so "
        "the rows with Fabric's variables plan the local environment. Inside an allocation but outside an "
        "srun step (a batch script, a salloc shell) the Slurm environment is a world of one process, and "
        "asking for more than one device there is refused with the srun command to run, or "
        "environment='local' to have phalanx start the processes. There is no job-name rule: a job named "
        "'bash' or 'interactive' is a Slurm job like any other.",
    ),
    "sixteen_mixed_cpu": (
        "16-mixed on the CPU is refused",
        "float16 autocast with a gradient scaler needs a GPU. Fabric warns and uses bf16-mixed instead; "
        "phalanx refuses, names bf16-mixed, and does the same for a custom 16-mixed precision instance.",
    ),
    "multi_node_local": (
        "Several nodes without a scheduler need NODE_RANK",
        "num_nodes > 1 on the local environment needs NODE_RANK (and MASTER_ADDR) set on each node, "
        "unless the nodes meet in rounds that number them (max_restarts, min_nodes or a rendezvous in "
        "etcd, as torchrun's rendezvous does); Fabric assumes node 0. The spawn and fork launchers start processes on one machine only, so "
        "ddp_spawn or ddp_fork with num_nodes > 1 is refused and the error points to 'ddp' or a scheduler.",
    ),
    "external_world": (
        "A scheduler's world is checked against the flags",
        "When the processes were started outside phalanx (by srun, jsrun, torchrun, a Kubeflow "
        "PyTorchJob, or a custom environment whose creates_processes_externally is true), their number "
        "must equal devices x num_nodes, or resolve() refuses and names both numbers. Fabric checks this "
        "for Slurm and torchrun as well (those rows agree), but not for jsrun, a PyTorchJob or a custom "
        "environment, where its world can differ from its flags without an error. A Kubeflow PyTorchJob "
        "runs one process per pod, so devices is 1 and num_nodes the number of pods.",
    ),
    "torchrun_vars": (
        "torchrun's variables must all be set",
        "With TORCHELASTIC_RUN_ID set, phalanx needs RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT, which torchrun always sets, and names the ones that are missing. Fabric's tests set "
        "only some of them: Fabric then uses 127.0.0.1 and port 12910 with a warning, and raises a "
        "KeyError for a missing WORLD_SIZE, RANK or LOCAL_RANK.",
    ),
    "notebook_all_devices": (
        "strategy='auto' in a notebook uses every GPU",
        "In a notebook, strategy='auto' with devices='auto' on several GPUs picks ddp_notebook (the fork "
        "launcher) over all of them, as it picks ddp outside a notebook. Fabric uses one GPU there.",
    ),
    "xla_notebook": (
        "The xla launcher is refused in a notebook",
        "phalanx's xla launcher (torch_xla.launch) is not one that works in a notebook or REPL, so "
        "resolve() refuses it there and names the launchers that do. Fabric's XLA launcher forks from a "
        "notebook.",
    ),
    "accelerator_priority": (
        "With TPUs and GPUs on one host, CUDA is chosen",
        "accelerator='auto' takes the available accelerator of highest priority, and cuda's (20) is "
        "above xla's (5). Fabric prefers the TPUs. Pass accelerator='xla' to use them.",
    ),
    "ready_instance": (
        "A ready strategy instance is complete",
        "phalanx strategies are built with all their parts, so DDPStrategy() without them is a TypeError "
        "and there is no half-made instance for resolve() to complete. A ready instance keeps its parts: "
        "accelerator=, precision= and the other part flags are refused beside it, and devices= and "
        "num_nodes= are accepted only when they equal what it was built with. Fabric completes a bare "
        "instance from the flags and keeps a full one whatever the flags say. A strategy built by hand is "
        "not cross-checked (a CPU accelerator with CUDA parallel_devices constructs).",
    ),
    "accelerator_name": (
        "An accelerator says its torch device type",
        "The collective checks which backend moves the tensors of the accelerator's devices, by "
        "Accelerator.device_type (cpu, cuda, mps, xla), which is the accelerator's name unless the "
        "class says otherwise. An accelerator named 'custom_acc_name' that does not say is refused by "
        "gloo, with the fix named (set device_type); one that sets device_type = 'cpu' trains under ddp. "
        "On one device, where no collective moves tensors, any custom accelerator works.",
    ),
    "fsdp_cpu": (
        "fsdp runs on the CPU",
        "phalanx's fsdp is torch's fully_shard (FSDP2), which runs over gloo on the CPU. Fabric's FSDP "
        "refuses the CPU.",
    ),
    "plugins_list": (
        "plugins= is a list",
        "plugins= takes a list of ready parts; a single part is refused. Fabric also takes one plugin on "
        "its own.",
    ),
    "xla_devices": (
        "XLA: one device, or all of them",
        "torch_xla runs one replica on one device or on every device of the host, so devices=[1] is "
        "refused with the two forms that work; Fabric plans a single-device strategy on xla:1.",
    ),
    "kubeflow_detected": (
        "Kubeflow is detected",
        "phalanx detects a Kubeflow PyTorchJob from its variables (KUBERNETES_PORT, MASTER_ADDR, "
        "MASTER_PORT, WORLD_SIZE, RANK). Fabric never detects it; it must be passed as a plugin.",
    ),
    "env_views": (
        "Environments are read-only views of the launcher's variables",
        "An environment only reads variables: it has no setters, and teardown() changes nothing (Fabric's "
        "removes WORLD_SIZE). A variable that is set but empty counts as unset (Fabric counts it as set). "
        "The local environment reads the node from NODE_RANK only, not GROUP_RANK; phalanx's own "
        "launchers set NODE_RANK.",
    ),
    "ports": (
        "Default ports",
        "Without MASTER_PORT, Slurm and LSF jobs use 10000 plus the last four digits of the job id "
        "(Fabric: 15000 plus the last four for Slurm, 10000 plus the last three for LSF), so that every "
        "rank finds the same port without talking to the others. The local environment reports 29500 "
        "and searches for no free port, where Fabric's picks one: on one machine phalanx's launchers hold "
        "their rendezvous store on a port the system assigns (port 0), and on several nodes node 0 hosts "
        "it at the main address and port.",
    ),
    "one_host_loopback": (
        "A one-host job meets on 127.0.0.1",
        "When a Slurm job runs on one host, its main address is 127.0.0.1, since its processes never "
        "leave the machine; on several hosts it is the first host of the job. Fabric gives the first "
        "host's name in both cases.",
    ),
    "mpi_variables": (
        "MPI is read from the launcher's variables",
        "The MPI environment reads the variables mpirun sets (OMPI_COMM_WORLD_*, PMI_*) and imports no "
        "mpi4py. A world of one under mpirun is detected as MPI (Fabric: not detected), and a missing "
        "variable is an error that names it.",
    ),
    "lsf": (
        "LSF without a rank file or a job id",
        "Without LSB_DJOB_RANKFILE the LSF environment reads the hosts from LSB_HOSTS, and outside jsrun "
        "it is a world of one process; Fabric raises. Without LSB_JOBID it is not detected (Fabric "
        "raises); named with environment='lsf' it is used.",
    ),
}


# --------------------------------------------------------------------------- running a row


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the outcome records what was raised
        return _error(exc)
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def apply_fakes(mp: pytest.MonkeyPatch, fakes: F, tmp: Path) -> None:
    """Fake the machine of ``fakes`` with ``mp`` (pytest's monkeypatch, or
    a standalone MonkeyPatch in a notebook row's interpreter)."""
    build = fakes.cuda_build if fakes.cuda_build is not None else (True if fakes.cuda else None)
    if build is not None:
        mp.setattr(torch.version, "cuda", "12.4" if build else None)
    mp.setattr(torch.cuda, "device_count", lambda: fakes.cuda)
    mp.setattr(torch.cuda, "is_available", lambda: fakes.cuda > 0)
    if fakes.cuda:
        mp.setattr(torch.distributed, "is_nccl_available", lambda: True)
    mp.setattr(torch.backends.mps, "is_built", lambda: fakes.mps)
    mp.setattr(torch.backends.mps, "is_available", lambda: fakes.mps)
    if fakes.xla is None and importlib.util.find_spec("phalanx_xla") is not None:
        import phalanx_xla._runtime as runtime

        # where torch_xla is installed, its devices would be found: no TPU here
        mp.setattr(runtime, "availability", lambda: Availability(False, "no XLA device (faked)"))
    if fakes.xla is not None:
        import phalanx_xla._runtime as runtime

        real_find_spec = importlib.util.find_spec

        def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
            if name == "torch_xla" or name.startswith("torch_xla."):
                return importlib.machinery.ModuleSpec(name, None)
            return real_find_spec(name, *args, **kwargs)

        count = fakes.xla
        mp.setattr(importlib.util, "find_spec", find_spec)
        mp.setattr(runtime, "availability", lambda: Availability(True))
        mp.setattr(runtime, "device_count", lambda: count)
        mp.setattr(runtime, "device_type", lambda: "TPU")
    if fakes.start_methods is not None:
        methods = list(fakes.start_methods)
        mp.setattr(multiprocessing, "get_all_start_methods", lambda: list(methods))
        mp.setattr(torch.multiprocessing, "get_all_start_methods", lambda: list(methods))
    if fakes.hostname is not None:
        name = fakes.hostname
        mp.setattr(socket, "gethostname", lambda: name)
    for file, text in fakes.files.items():
        (tmp / file).write_text(text)
    for key, value in fakes.env.items():
        mp.setenv(key, value.replace("{tmp}", str(tmp)))


def _build(value: Any) -> Any:
    if isinstance(value, Make):
        return value.factory()
    if isinstance(value, list):
        return [_build(v) for v in value]
    return value


def _strategy_outcome(strategy: Strategy, given: list[Any]) -> dict[str, Any]:
    launcher = strategy.launcher
    parts = {
        "strategy": strategy,
        "accelerator": strategy.accelerator,
        "environment": strategy.environment,
        "precision": strategy.precision,
    }
    outcome: dict[str, Any] = {
        "strategy": type(strategy).__name__,
        "accelerator": strategy.accelerator.name,
        "environment": type(strategy.environment).__name__,
        "launcher": type(launcher).__name__,
        "start_method": getattr(launcher, "start_method", None),
        "interactive": getattr(launcher, "is_interactive_compatible", None),
        "precision": strategy.precision.name,
        "devices": len(strategy.parallel_devices),
        "kept": sorted(name for name, part in parts.items() if any(part is g for g in given)),
    }
    for name in ("world_size", "global_rank", "local_rank", "node_rank", "main_address", "root_device"):
        if name == "main_address":
            outcome[name] = _attempt(lambda: strategy.environment.main_address)
        else:
            outcome[name] = _attempt(lambda name=name: getattr(strategy, name))
    return outcome


def _environment_outcome(env: ClusterEnvironment) -> dict[str, Any]:
    names = ("main_address", "main_port", "world_size", "global_rank", "local_rank", "node_rank")
    outcome = {name: _attempt(lambda name=name: getattr(env, name)) for name in names}
    outcome["creates_processes_externally"] = type(env).creates_processes_externally
    outcome["detect"] = _attempt(type(env).detect)
    return outcome


def run_call(call: Call) -> dict[str, Any]:
    """The outcome of a row's call: what was built, or what was raised."""
    try:
        if isinstance(call, R):
            strategy = _build(call.strategy)
            flags = {k: _build(v) for k, v in call.flags.items()}
            plugins = flags.get("plugins", [])
            given = [strategy, *flags.values(), *(plugins if isinstance(plugins, list) else [plugins])]
            return _strategy_outcome(phalanx.resolve(strategy, **flags), given)
        if isinstance(call, Env):
            return _environment_outcome(call.cls())
        if isinstance(call, Validate):
            call.cls().validate(num_devices=call.devices, num_nodes=call.num_nodes)
            return {"validate": "ok"}
        return call.fn()
    except Exception as exc:  # noqa: BLE001 - the outcome records what was raised
        return _error(exc)


def check(expect: Plan | Err | Attrs, outcome: dict[str, Any]) -> None:
    if isinstance(expect, Err):
        assert expect.matches(outcome), f"expected {expect.render()}, got {outcome}"
        return
    assert "error" not in outcome, (
        f"expected {expect.render()}, got {outcome.get('error')}: {outcome.get('message')}"
    )
    if isinstance(expect, Attrs):
        for name, want in expect.values.items():
            got = outcome.get(name)
            if isinstance(want, Err):
                assert want.matches(got), f"{name}: expected {want.render()}, got {got}"
            else:
                assert got == want, f"{name}: expected {want!r}, got {got!r}"
        return
    for field in dataclasses.fields(expect):
        want = getattr(expect, field.name)
        if field.name == "kept":
            assert set(want) <= set(outcome["kept"]), f"kept: expected {want}, got {outcome['kept']}"
        elif want is not None:
            assert outcome[field.name] == want, (
                f"{field.name}: expected {want!r}, got {outcome[field.name]!r}"
            )


def _case(case_id: str) -> Case:
    return next(c for c in CASES if c.id == case_id)


def _child(case_id: str, tmp: str) -> dict[str, Any]:
    """A notebook row, in the interpreter that reads its code from stdin."""
    mp = pytest.MonkeyPatch()
    try:
        case = _case(case_id)
        apply_fakes(mp, case.fakes, Path(tmp))
        return run_call(case.call)
    finally:
        mp.undo()


CHILD = """\
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("fabric_connector_rows", {path!r})
rows = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rows)
print("OUTCOME " + json.dumps(rows._child({case_id!r}, {tmp!r})))
"""


def run_in_notebook(case: Case, tmp: Path) -> dict[str, Any]:
    code = CHILD.format(path=str(Path(__file__).resolve()), case_id=case.id, tmp=str(tmp))
    proc = subprocess.run(
        [sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120, cwd=tmp, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, f"the notebook row printed no outcome (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("OUTCOME ") :])


# --------------------------------------------------------------------------- the tests

_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "LSB_", "JSM_", "KUBERNETES_")
_PREFIXES += ("HOROVOD_", "PHALANX_", "LT_", "PJRT_", "XRT_", "TPU_")
_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
_NAMES += ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "CPU_NUM_DEVICES")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No scheduler or phalanx variable of the machine running the tests
    leaks in (CI may itself run under Slurm, or under `phalanx run`)."""
    for name in [k for k in os.environ if k.startswith(_PREFIXES) or k in _NAMES]:
        monkeypatch.delenv(name)


def _param(case: Case) -> Any:
    marks = []
    if case.verdict == WRONG:
        marks.append(pytest.mark.xfail(reason=f"phalanx bug: {case.note}", strict=True))
    if case.fakes.interactive:
        marks.append(pytest.mark.subprocess)
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_fabric_case(case: Case, monkeypatch, tmp_path):
    for module in case.absent:
        if importlib.util.find_spec(module) is not None:
            pytest.skip(f"{module} is importable here; this row is about a machine without it")
    if case.fakes.xla is not None and importlib.util.find_spec("phalanx_xla") is None:
        pytest.skip("phalanx-xla is not installed")
    if case.fakes.interactive:
        outcome = run_in_notebook(case, tmp_path)
    else:
        apply_fakes(monkeypatch, case.fakes, tmp_path)
        outcome = run_call(case.call)
    check(case.expect, outcome)


def test_every_row_has_a_verdict_and_every_difference_a_reason():
    assert len({c.id for c in CASES}) == len(CASES)
    for case in CASES:
        assert case.verdict in VERDICTS, case.id
        assert case.fabric and case.description and case.fabric_test, case.id
        if case.verdict in (STRICTER, BY_DESIGN):
            assert case.group in GROUPS, f"{case.id}: a {case.verdict!r} row needs a group of GROUPS"
    used = {c.group for c in CASES if c.verdict in (STRICTER, BY_DESIGN)}
    assert used == set(GROUPS), f"groups without a row: {set(GROUPS) - used}"


def test_the_doc_is_generated_from_this_table():
    assert DOC.read_text() == render_markdown(), (
        "docs/content/fabric.md is out of date: python tests/test_fabric_connector.py > docs/content/fabric.md"
    )


# --------------------------------------------------------------------------- the doc


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _case_cell(case: Case) -> str:
    text = f"{case.description}<br>`{case.call.render()}`"
    machine = case.fakes.render()
    return text + (f"<br>*{machine}*" if machine else "")


def render_markdown() -> str:
    rows = [c for c in CASES if c.verdict != WRONG]
    counts = {v: sum(1 for c in rows if c.verdict == v) for v in (AGREES, STRICTER, BY_DESIGN)}
    out = [
        "# phalanx and Lightning Fabric: the connector cases",
        "",
        "<!-- Generated from tests/test_fabric_connector.py, which asserts every row: edit the table there, "
        "then run `python tests/test_fabric_connector.py > docs/content/fabric.md`. -->",
        "",
        "Lightning Fabric turns `Fabric(accelerator=..., strategy=..., devices=..., num_nodes=..., "
        "precision=..., plugins=...)` into a strategy in its connector, and reads the cluster it runs on "
        "through its cluster environments. Its tests of both, `tests/tests_fabric/test_connector.py` and "
        "`tests/tests_fabric/plugins/environments/*.py`, are translated below into `phalanx.resolve()` calls "
        "(or reads of a phalanx environment), case by case. Each row is asserted by "
        "`tests/test_fabric_connector.py` on a CPU-only machine: GPUs, Apple's MPS, TPU devices, "
        "multiprocessing's start methods and the host name are faked the way Fabric's own tests fake them, "
        "scheduler variables are set for the row alone, and notebook rows run in an interpreter that reads "
        "its code from standard input. Nothing is launched.",
        "",
        "The verdicts:",
        "",
        "- **agrees**: phalanx does what Fabric does. Where Fabric raises `ValueError`, `TypeError` or "
        "`RuntimeError`, phalanx raises `MisconfigurationError`, `UnknownNameError` or `UnavailableError`.",
        "- **stricter**: phalanx refuses, with an error that says what to change, where Fabric warns and "
        "falls back or goes on with a setting that does not hold.",
        "- **by design**: phalanx does something else on purpose, or does not have the Fabric feature.",
        "",
        f"Of the {len(rows)} rows, {counts[AGREES]} agree, {counts[STRICTER]} are stricter and "
        f"{counts[BY_DESIGN]} differ by design. The strategy, environment and launcher columns name "
        "phalanx's classes; the accelerator and precision, their names. The section after the table "
        "explains each difference.",
        "",
        f"Fabric's tests: {FABRIC}.",
        "",
        "## The cases",
        "",
        "| Fabric test | case | what Fabric does | what phalanx does | verdict |",
        "|---|---|---|---|---|",
    ]
    for case in rows:
        verdict = case.verdict
        if case.group:
            verdict += f" ([{GROUPS[case.group][0]}](#{case.group.replace('_', '-')}))"
        if case.note:
            verdict += f"; {case.note}"
        out.append(
            "| "
            + " | ".join(
                _cell(s)
                for s in (
                    f"`{case.fabric_test}`",
                    _case_cell(case),
                    case.fabric,
                    case.expect.render(),
                    verdict,
                )
            )
            + " |"
        )
    out += ["", "## Differences that remain, and why", ""]
    for key, (title, text) in GROUPS.items():
        members = [c for c in rows if c.group == key and c.verdict in (STRICTER, BY_DESIGN)]
        kinds = sorted({c.verdict for c in members})
        out += [
            f"### {title} {{#{key.replace('_', '-')}}}",
            "",
            text,
            "",
            f"*{' and '.join(kinds).capitalize()}; rows: {', '.join(c.id for c in members)}.*",
            "",
        ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
