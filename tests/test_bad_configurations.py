"""The flag checks: every bad configuration is refused when resolving, before
any process starts, with an error of the right type whose message names what
was wrong and what to do. Plus a property: random flags either resolve or
raise a PhalanxError subclass, never anything else."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import phalanx
from phalanx_core import (
    MisconfigurationError,
    PhalanxError,
    Strategy,
    TorchCheckpointIO,
    UnavailableError,
    UnknownNameError,
)

CUDA = torch.cuda.device_count() > 0  # unlike is_available(), leaves pytest fit to fork ranks on CUDA
no_cuda_only = pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _local():
    from phalanx_torch.environments import LocalEnvironment

    return LocalEnvironment()


def _precision():
    from phalanx_torch.precisions import FullPrecision

    return FullPrecision()


def _ready_strategy():
    return phalanx.resolve("single_device", accelerator="cpu")


M, U, N = MisconfigurationError, UnavailableError, UnknownNameError
DDP2 = {"strategy": "ddp", "accelerator": "cpu", "devices": 2}

#: (id, flags for phalanx.resolve, error type, words the message must hold)
TABLE = [
    # unknown names list what exists
    (
        "unknown-strategy",
        {"strategy": "dpp"},
        N,
        ["unknown strategy 'dpp'", "Did you mean 'ddp'?", "names that exist"],
    ),
    (
        "strategy-upper-case",
        {"strategy": "DDP"},
        N,
        ["unknown strategy 'DDP'", "Did you mean 'ddp'?", "case"],
    ),
    (
        "fabric-variant-ddp",
        {"strategy": "ddp_find_unused_parameters_true"},
        N,
        ["Fabric's", "resolve('ddp', find_unused_parameters=True)"],
    ),
    (
        "fabric-variant-spawn",
        {"strategy": "DDP_SPAWN_FIND_UNUSED_PARAMETERS_FALSE"},
        N,
        ["resolve('ddp_spawn', find_unused_parameters=False)"],
    ),
    ("fabric-variant-fsdp", {"strategy": "fsdp_cpu_offload"}, N, ["resolve('fsdp', cpu_offload=True)"]),
    ("unknown-accelerator", {"accelerator": "quantum"}, N, ["unknown accelerator 'quantum'", "cpu, cuda"]),
    (
        "slurm-outside-slurm",
        {"strategy": "ddp", "devices": 2, "environment": "slurm"},
        M,
        ["environment 'slurm' was asked for, but this process is not in a Slurm job", "drop environment="],
    ),
    ("unknown-precision", {"precision": "bf17-mixed"}, N, ["unknown precision", "bf16-mixed"]),
    ("unknown-collective", {"collective": "nccl2"}, N, ["unknown collective 'nccl2'", "torch"]),
    (
        "backend-as-collective",
        {"strategy": "ddp", "devices": 2, "collective": "gloo"},
        N,
        [
            "collective 'gloo' is not a collective of its own: collective 'torch' speaks it, with "
            "backend='gloo': resolve(..., collective='torch', backend='gloo') (phalanx run: --collective "
            "torch -o backend=gloo)"
        ],
    ),
    ("unknown-launcher", {"launcher": "rocket"}, N, ["unknown launcher 'rocket'", "spawn"]),
    ("unknown-environment", {"environment": "mars"}, N, ["unknown environment 'mars'", "slurm"]),
    # flags of the wrong type
    ("strategy-int", {"strategy": 3}, M, ["strategy=3", "expected a name (str) or a Strategy"]),
    ("accelerator-none", {"accelerator": None}, M, ["accelerator=None", "pass 'auto'"]),
    ("accelerator-float", {"accelerator": 1.5}, M, ["accelerator=1.5", "phalanx list --kind accelerator"]),
    ("precision-bool", {"precision": True}, M, ["precision=True", "expected a name"]),
    ("precision-float", {"precision": 16.0}, M, ["precision=16.0", "expected a name"]),
    ("collective-list", {"collective": ["torch"]}, M, ["collective=['torch']", "expected a name"]),
    ("launcher-class", {"launcher": object}, M, ["launcher=<class 'object'>", "Launcher instance"]),
    # devices
    ("devices-float", {"devices": 2.5}, M, ["devices=2.5", "expected an int, a list of ints"]),
    ("devices-bool", {"devices": True}, M, ["devices=True", "expected an int"]),
    ("devices-mixed-list", {"devices": [0, "1"]}, M, ["devices=[0, '1']", "list of ints"]),
    ("devices-zero", {"devices": 0}, M, ["devices=0 asks for no device", "at least 1"]),
    ("devices-zero-str", {"devices": "0"}, M, ["devices='0' asks for no device"]),
    ("devices-empty", {"devices": []}, M, ["devices=[] asks for no device"]),
    ("devices-negative", {"devices": -2}, M, ["devices=-2", "at least 1", "-1 and 'auto' mean all"]),
    ("devices-word", {"devices": "two"}, M, ["devices='two'", "indices like '0,2'"]),
    ("devices-gap", {"devices": "0,,2"}, M, ["devices='0,,2'"]),
    ("devices-negative-index", {"devices": [-1, 0]}, M, ["devices=[-1, 0]", "start at 0"]),
    (
        "cpu-indices",
        {**DDP2, "devices": [0, 2]},
        M,
        ["accelerator='cpu' with devices=[0, 2]", "mean nothing"],
    ),
    ("cpu-index-str", {**DDP2, "devices": "0,2"}, M, ["devices='0,2'", "number of processes"]),
    # nodes
    ("nodes-zero", {"num_nodes": 0}, M, ["num_nodes=0", "at least 1"]),
    ("nodes-str", {"num_nodes": "2"}, M, ["num_nodes='2'", "an int"]),
    ("nodes-negative", {"num_nodes": -1}, M, ["num_nodes=-1"]),
    (
        "nodes-without-node-rank",
        {**DDP2, "num_nodes": 2},
        M,
        ["num_nodes=2 on the local environment needs NODE_RANK", "MASTER_ADDR"],
    ),
    (
        "in-process-two",
        {**DDP2, "launcher": "in_process"},
        M,
        ["'in_process' runs in this one process", "torchrun / srun"],
    ),
    # a strategy that cannot do what the flags ask
    (
        "single-two-devices",
        {"strategy": "single_device", "devices": 2},
        M,
        ["'single_device' runs on one device", "or a parallel strategy (", "ddp, ddp_spawn,"],
    ),
    ("single-two-nodes", {"strategy": "single_device", "num_nodes": 2}, M, ["num_nodes=2 ask for more"]),
    # a ready strategy and flags for its parts
    (
        "instance-and-accelerator",
        {"strategy": _ready_strategy, "accelerator": "cpu"},
        M,
        ["ready SingleDeviceStrategy instance", "you also passed accelerator"],
    ),
    (
        "instance-and-option",
        {"strategy": _ready_strategy, "timeout": 5},
        M,
        ["already has its parts", "timeout"],
    ),
    # the same part twice
    (
        "two-environments",
        {"plugins": lambda: [_local(), _local()]},
        M,
        ["plugins= has two environment parts", "keep the one"],
    ),
    (
        "environment-twice",
        {"environment": "local", "plugins": lambda: [_local()]},
        M,
        ["environment is given twice", "environment='local'"],
    ),
    (
        "precision-twice",
        {"precision": "64-true", "plugins": lambda: [_precision()]},
        M,
        ["precision is given twice", "precision='64-true'"],
    ),
    (
        "checkpoint-io-twice",
        {"checkpoint_io": TorchCheckpointIO(), "plugins": lambda: [TorchCheckpointIO()]},
        M,
        ["checkpoint_io is given twice"],
    ),
    ("plugins-not-a-part", {"plugins": [3]}, M, ["plugins=[..., 3, ...]: not a part"]),
    ("plugins-not-a-list", {"plugins": "local"}, M, ["plugins='local'", "a list of ready parts"]),
    (
        "plugins-strategy",
        {"plugins": lambda: [_ready_strategy()]},
        M,
        ["a strategy: pass it as the first argument"],
    ),
    # precision the accelerator does not support: an error that suggests, never a switch
    ("16-mixed-on-cpu", {"precision": "16-mixed"}, M, ["'16-mixed'", "cpu", "bf16-mixed"]),
    ("16-alias-on-cpu", {"precision": 16}, M, ["'16-mixed'", "bf16-mixed"]),
    # collective backends
    (
        "nccl-on-cpu",
        {**DDP2, "backend": "nccl"},
        M,
        ["backend='nccl' and accelerator 'cpu'", "backend='gloo'"],
    ),
    (
        "unknown-backend",
        {**DDP2, "backend": "nope"},
        M,
        ["backend='nope'", "knows no such backend", "register_backend"],
    ),
    (
        "mpi-backend-missing",
        {**DDP2, "backend": "mpi"},
        U,
        ["no mpi backend", "collective='mpi' (phalanx-mpi)"],
    ),
    # options
    (
        "manual-ddp-option",
        {**DDP2, "strategy": "manual", "find_unused_parameters": True},
        M,
        ["find_unused_parameters=True is taken by no part", "strategy 'manual' takes"],
    ),
    ("misspelt-option", {**DDP2, "find_unused": True}, M, ["find_unused=True", "find_unused_parameters"]),
    (
        "misspelt-option-guessed",
        {**DDP2, "find_unused_parametres": True},
        M,
        ["Did you mean 'find_unused_parameters', an option of strategy 'ddp'?"],
    ),
    ("deterministic-int", {"deterministic": 1}, M, ["deterministic=1", "True", "'warn'"]),
    ("restarts-negative", {**DDP2, "max_restarts": -1}, M, ["max_restarts=-1", "at least 0"]),
    ("timeout-negative", {**DDP2, "timeout": -5}, M, ["timeout=-5"]),
    # hardware that is not here
    pytest.param(
        "cuda-missing",
        {"accelerator": "cuda"},
        U,
        ["accelerator 'cuda' cannot be used here", "accelerator='cpu'"],
        marks=no_cuda_only,
    ),
    pytest.param(
        "gpu-alias-missing",
        {"strategy": "ddp", "accelerator": "gpu", "devices": 2},
        U,
        ["accelerator 'cuda' cannot be used here"],
        marks=no_cuda_only,
    ),
    pytest.param(
        "cuda-index",
        {"strategy": "ddp", "accelerator": "cuda", "devices": [0, 99]},
        M,
        ["[99]", "ask for fewer"],
        marks=cuda_only,
    ),
]


def _ids(row):
    return row.values[0] if hasattr(row, "values") else row[0]


@pytest.mark.parametrize(("name", "flags", "error", "words"), TABLE, ids=[_ids(r) for r in TABLE])
def test_a_bad_configuration_is_refused_with_what_to_do(name, flags, error, words):
    flags = {k: (v() if callable(v) and k in ("strategy", "plugins") else v) for k, v in flags.items()}
    flags.setdefault("accelerator", "cpu")
    flags.setdefault("strategy", "single_device")
    strategy = flags.pop("strategy")
    with pytest.raises(error) as info:
        phalanx.resolve(strategy, **flags)
    assert type(info.value) is error  # not a subclass standing in for it
    message = str(info.value)
    for word in words:
        assert word in message, f"{name}: {word!r} not in {message!r}"


def test_the_table_has_at_least_forty_rows():
    assert len(TABLE) >= 40


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (
            "phalanx.resolve('ddp', accelerator='cpu', devices=2)",
            ["launcher 'subprocess' cannot run in a notebook or REPL", "launcher='fork'"],
        ),
        (
            "phalanx.resolve('ddp_spawn', accelerator='cpu', devices=2)",
            ["launcher 'spawn' cannot run", "launcher='fork'"],
        ),
        (
            "phalanx.resolve('single_device', accelerator='cpu', launcher='subprocess')",
            ["launcher='in_process', launcher='fork'"],
        ),
    ],
)
def test_an_interactive_session_gets_a_launcher_that_runs_there(call, words):
    """``python -c`` has no script to re-run, as a notebook or a REPL."""
    code = f"import phalanx\ntry:\n    {call}\nexcept phalanx.MisconfigurationError as e:\n    print(e)\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    for word in words:
        assert word in done.stdout, done.stdout + done.stderr
    # Code piped to the interpreter (python -) has no script either.
    done = subprocess.run(
        [sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60, check=True
    )
    for word in words:
        assert word in done.stdout, done.stdout + done.stderr
    ok = "phalanx.resolve('ddp_notebook', accelerator='cpu', devices=2).launcher.start_method"
    done = subprocess.run(
        [sys.executable, "-c", f"import phalanx\nprint({ok})"], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "fork", done.stderr


@cuda_only
def test_ddp_fork_after_cuda_is_initialised_is_refused():
    # In a process of its own: CUDA initialised in pytest's would stop every
    # later test that forks.
    code = (
        "import torch, phalanx\n"
        "from phalanx_core import MisconfigurationError\n"
        "torch.zeros(1, device='cuda')\n"
        "try:\n"
        "    phalanx.resolve('ddp_fork', accelerator='cuda', devices=1)\n"
        "except MisconfigurationError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "REFUSED launcher 'fork' cannot fork this process: CUDA is already initialised" in done.stdout


# -- the property ----------------------------------------------------------------

_STRATEGIES = ["auto", "single_device", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "manual"]
_FLAGS = st.fixed_dictionaries(
    {},
    optional={
        "accelerator": st.sampled_from(["auto", "cpu", "cuda", "gpu", "mps", "quantum", None, 3, ""]),
        "devices": st.one_of(
            st.integers(-3, 4),
            st.sampled_from(["auto", "-1", "0", "2", "0,1", "x", "1,", "", " 2 ", "-3"]),
            st.lists(st.integers(-1, 3), max_size=3),
            st.sampled_from([2.5, True, None, (0,), {"a": 1}]),
        ),
        "num_nodes": st.one_of(st.integers(-1, 3), st.sampled_from(["2", None, 1.0])),
        "precision": st.sampled_from(
            [
                "32-true",
                "64-true",
                "bf16-mixed",
                "16-mixed",
                "bf16-true",
                "16-true",
                "bf16",
                16,
                32,
                64,
                8,
                True,
            ]
        ),
        "collective": st.sampled_from([None, "torch", "single_device", "nope", 5, "phalanx-torch:torch"]),
        "launcher": st.sampled_from([None, "in_process", "subprocess", "spawn", "fork", "rocket", 1]),
        "environment": st.sampled_from(
            [None, "local", "torchelastic", "slurm", "mpi", "lsf", "kubeflow", "mars"]
        ),
        "timeout": st.sampled_from([1, 30.5, -1, 0, "x"]),
        "backend": st.sampled_from(["gloo", "nccl", "mpi", "nope", 3]),
        "find_unused_parameters": st.booleans(),
        "deterministic": st.sampled_from([True, False, "warn", 1, "x"]),
        "max_restarts": st.sampled_from([0, 2, -1, "x"]),
        "start_method": st.sampled_from(["spawn", "fork", "thread"]),
        "checkpoint_per_rank": st.sampled_from([True, False, "yes"]),
        "reshard_after_forward": st.sampled_from([True, False, "x"]),
        "unknown_option": st.just(1),
    },
)


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(strategy=st.sampled_from([*_STRATEGIES, "nope", 7, None]), flags=_FLAGS)
def test_random_flags_resolve_or_raise_a_phalanx_error(strategy, flags):
    try:
        resolved = phalanx.resolve(strategy, **flags)
    except PhalanxError as exc:
        assert str(exc)  # noqa: PT017 - every refusal says why; the property is the type
    else:
        assert isinstance(resolved, Strategy)


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """spawn imports the main script again in every new process; a script
    that resolves and launches at its top level would launch from there."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import phalanx\n\n\ndef fn(strategy):\n    return strategy.global_rank\n\n\n"
        "print(phalanx.resolve('ddp_spawn', accelerator='cpu', devices=2).launch(fn))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert 'Put the code that resolves and launches under `if __name__ == "__main__":`' in done.stderr
    assert "WorkerFailedError" in done.stderr
    # The launching process's error says the rank failed before fn, where
    # the guard message is; not that it left no traceback.
    assert "It failed before it could run fn" in done.stderr
    assert "left no Python traceback" not in done.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_a_missing_backend_names_what_to_install_not_phalanx_torch():
    with pytest.raises(UnavailableError) as info:
        phalanx.resolve("xla")
    message = str(info.value)
    assert "torch_xla not installed" in message and "phalanx-xla[xla]" in message, message
    assert "pip install phalanx-torch" not in message
