"""The fsdp strategy (torch's fully_shard), with real ranks: two processes
over gloo on the CPU. What runs in the ranks is defined at the top level of
this module (spawned ranks import it by name); most tests fork, which
starts faster.

Every launch is bounded: the collective's timeout fails a rank that waits
on another, and the launcher stops the others.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

import phalanx
from phalanx_core import MisconfigurationError

pytestmark = pytest.mark.subprocess

#: Seconds a collective may wait before its rank fails.
TIMEOUT = 60


def fsdp(launcher: str = "fork", **options):
    return phalanx.resolve(
        "fsdp", accelerator="cpu", devices=2, launcher=launcher, timeout=TIMEOUT, **options
    )


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))


def data(n: int = 16):
    """A regression batch: ``n`` samples, the same in every process."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return x, torch.stack([x.sum(dim=1), x[:, 0] - x[:, 1]], dim=1)


def my_half(strategy, x, y):
    """This rank's half of a batch."""
    half = len(x) // strategy.world_size
    lo = strategy.global_rank * half
    return x[lo : lo + half], y[lo : lo + half]


def loss_of(model, x, y):
    # In float32 whatever the model computes in: torch 2.9's mse_loss cannot
    # take the backward of a bfloat16 output against a float32 target.
    return nn.functional.mse_loss(model(x).float(), y.float())


def full(tensor) -> torch.Tensor:
    """A parameter or gradient whole (gathered from the ranks), detached."""
    tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return tensor.detach().clone()


def train(strategy, model, optimizer, steps, x, y):
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with strategy.forward_context():
            loss = loss_of(model, x, y)
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        losses.append(loss.item())
    return losses


def single_process(steps, lr=0.1):
    """What one process training on the whole batch gets: the reference."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = data()
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- what the ranks run ---------------------------------------------------------------------------


def train_sharded(strategy):
    """Train on this rank's half of the data; report the loss curve, the
    share of each parameter this rank holds, and the full parameters."""
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.Adam, lr=0.02))
    losses = train(strategy, model, optimizer, 60, *my_half(strategy, *data()))
    shares = {
        name: (tuple(p.to_local().shape), tuple(p.shape), type(p).__name__)
        for name, p in model.named_parameters()
    }
    return losses, shares, type(model).__name__, {name: full(p) for name, p in model.named_parameters()}


def sgd_steps(strategy, steps):
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.SGD, lr=0.1))
    train(strategy, model, optimizer, steps, *my_half(strategy, *data()))
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    return units, {name: full(p) for name, p in model.named_parameters()}


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Scaled(nn.Module):
    """A layer with a parameter of its own and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x * self.scale


def meta_init(strategy):
    with strategy.module_init_context():
        model = make_model()
    before = {p.device.type for p in model.parameters()}
    model, optimizer = strategy.setup(model, functools.partial(torch.optim.Adam, lr=0.02))
    after = {p.device.type for p in model.parameters()}
    first = full(model[0].weight)
    finite = all(torch.isfinite(full(p)).all() for p in model.parameters())
    losses = train(strategy, model, optimizer, 60, *my_half(strategy, *data()))

    with strategy.module_init_context():
        refused = nn.Sequential(nn.Linear(4, 2), Scaled())
    try:
        strategy.setup(refused)
    except MisconfigurationError as exc:
        message = str(exc)
    else:
        message = ""
    with strategy.module_init_context(empty_init=True):
        allowed = nn.Sequential(nn.Linear(4, 2), Scaled())
    allowed = strategy.setup(allowed)
    with strategy.module_init_context(empty_init=False):
        whole = nn.Linear(4, 2)
    return (
        before,
        after,
        first,
        finite,
        losses,
        message,
        allowed[1].scale.device.type,
        whole.weight.device.type,
    )


def sharded_round_trip(strategy, path):
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.AdamW, lr=0.01))
    x, y = my_half(strategy, *data())
    train(strategy, model, optimizer, 3, x, y)
    extra = {"epoch": 1, "empty": {}, 3: "int key"}
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer, "step": 7, "extra": extra})

    fresh, fresh_optimizer = strategy.setup(make_model(seed=1), functools.partial(torch.optim.AdamW, lr=0.01))
    differed = not torch.equal(fresh[0].weight.to_local(), model[0].weight.to_local())
    rest = strategy.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    same_params = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters())
    )
    saved_state, loaded_state = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    same_optimizer = sorted(saved_state) == sorted(loaded_state) and all(
        torch.equal(_local(saved_state[i][name]), _local(loaded_state[i][name]))
        for i in saved_state
        for name in ("step", "exp_avg", "exp_avg_sq")
    )
    # The same next step from both: the optimizer state really is restored.
    train(strategy, model, optimizer, 1, x, y)
    train(strategy, fresh, fresh_optimizer, 1, x, y)
    same_after = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters())
    )

    errors = []
    for call in (
        lambda: strategy.load_checkpoint(path, {"scheduler": fresh_optimizer}),
        lambda: strategy.load_checkpoint(Path(path).parent / "missing"),
        lambda: strategy.save_checkpoint(Path(path).parent / "other", {"optimizer": optimizer}),
    ):
        try:
            call()
        except (MisconfigurationError, FileNotFoundError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    partial = strategy.load_checkpoint(path, {"model": fresh, "scheduler": fresh_optimizer}, strict=False)

    other = strategy.setup(nn.Sequential(nn.Linear(4, 16)))
    try:
        strategy.load_checkpoint(path, {"model": other})
    except MisconfigurationError as exc:
        errors.append(str(exc))
    # A value that is not plain data: refused by weights_only (nothing runs),
    # naming the entry and weights_only=False for a file the user trusts.
    unsafe = Path(path).parent / "unsafe"
    strategy.save_checkpoint(unsafe, {"model": model, "point": Point(1, 2)})
    try:
        strategy.load_checkpoint(unsafe)
    except MisconfigurationError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    point = strategy.load_checkpoint(unsafe, weights_only=False)["point"]
    return differed, rest, same_params, same_optimizer, same_after, errors, sorted(partial, key=str), point


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def full_save(strategy, path):
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.AdamW, lr=0.01))
    train(strategy, model, optimizer, 3, *my_half(strategy, *data()))
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer, "step": 3})
    fresh, fresh_optimizer = strategy.setup(make_model(seed=1), functools.partial(torch.optim.AdamW, lr=0.01))
    rest = strategy.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    same = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters())
    )
    saved_state, loaded_state = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    same_optimizer = all(
        torch.equal(_local(saved_state[i][name]), _local(loaded_state[i][name]))
        for i in saved_state
        for name in ("step", "exp_avg", "exp_avg_sq")
    )
    # A mismatch is every rank's error, though only rank 0 reads the file.
    try:
        strategy.load_checkpoint(path, {"model": strategy.setup(nn.Sequential(nn.Linear(4, 16)))})
    except MisconfigurationError as exc:
        mismatch = str(exc)
    return rest, same, same_optimizer, {name: full(p) for name, p in model.named_parameters()}, mismatch


def plain_load(strategy, path):
    """single_device: load a full checkpoint fsdp wrote, step, save."""
    model, optimizer = strategy.setup(make_model(seed=1), functools.partial(torch.optim.AdamW, lr=0.01))
    rest = strategy.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
    train(strategy, model, optimizer, 1, *data())
    strategy.save_checkpoint(Path(path).with_name("plain.pt"), {"model": model, "optimizer": optimizer})
    return rest, loaded, {name: p.detach().clone() for name, p in model.named_parameters()}


def full_load(strategy, path):
    """fsdp: load a checkpoint file single_device wrote."""
    model, optimizer = strategy.setup(make_model(seed=2), functools.partial(torch.optim.AdamW, lr=0.01))
    strategy.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    steps = {float(_local(s["step"])) for s in optimizer.state_dict()["state"].values()}
    return {name: full(p) for name, p in model.named_parameters()}, steps


def accumulate(strategy):
    """One batch of 8 on one model; two micro-batches of 4 with
    no_backward_sync on another: the same update."""
    x, y = my_half(strategy, *data())
    whole, whole_optimizer = strategy.setup(make_model(), functools.partial(torch.optim.SGD, lr=0.1))
    strategy.backward(loss_of(whole, x, y))
    strategy.optimizer_step(whole_optimizer)

    micro, micro_optimizer = strategy.setup(make_model(), functools.partial(torch.optim.SGD, lr=0.1))
    with strategy.no_backward_sync(micro):
        strategy.backward(0.5 * loss_of(micro, x[:4], y[:4]))
    unreduced = all(p.grad is None for p in micro.parameters())  # nothing was reduce-scattered
    strategy.backward(0.5 * loss_of(micro, x[4:], y[4:]))
    reduced = all(p.grad is not None for p in micro.parameters())
    strategy.optimizer_step(micro_optimizer)
    return (
        unreduced,
        reduced,
        {name: full(p) for name, p in whole.named_parameters()},
        {name: full(p) for name, p in micro.named_parameters()},
    )


def clip(strategy):
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.SGD, lr=0.1))
    x, y = my_half(strategy, *data())

    def backward():
        optimizer.zero_grad()
        strategy.backward(loss_of(model, x, y))

    norms = {}
    for norm_type in (2.0, 1.0, float("inf")):
        backward()
        norm = strategy.clip_gradients(model, optimizer, max_norm=1e9, norm_type=norm_type)
        norms[norm_type] = (type(norm).__name__, norm.item())
    backward()
    strategy.clip_gradients(model, optimizer, max_norm=0.5)
    clipped_norm = strategy.clip_gradients(model, optimizer, max_norm=1e9).item()
    backward()
    assert strategy.clip_gradients(model, optimizer, clip_val=0.05) is None
    by_value = {name: full(p.grad) for name, p in model.named_parameters()}
    return norms, clipped_norm, by_value


# -- the tests ---------------------------------------------------------------------------------


def test_training_shards_the_parameters_and_the_loss_goes_down():
    results = fsdp("spawn", shard_modules={nn.Linear}).launch(train_sharded)
    (losses0, shares0, cls, params0), (losses1, shares1, _, params1) = results
    assert losses0[-1] < 0.2 * losses0[0] and losses1[-1] < 0.2 * losses1[0]
    assert cls == "FSDPSequential"  # fully_shard changes the class in place
    for name, (local, whole, kind) in shares0.items():
        assert kind == "DTensor"
        other = shares1[name][0]
        assert local[0] + other[0] == whole[0] and local[1:] == whole[1:] == other[1:]
        if whole[0] % 2 == 0:
            assert local[0] == other[0] == whole[0] // 2, name  # each rank holds half of it
    for name in params0:
        assert torch.equal(params0[name], params1[name])


@pytest.mark.parametrize(
    ("options", "units"),
    [
        ({}, 1),
        ({"reshard_after_forward": False, "shard_modules": {nn.Linear}}, 4),
        ({"shard_modules": lambda m: isinstance(m, nn.Linear) and m.out_features == 16}, 2),
    ],
    ids=["root-only", "per-layer-no-reshard", "callable"],
)
def test_sgd_steps_equal_one_process_on_the_whole_batch(options, units):
    steps = 5
    (units0, first), (units1, second) = fsdp(**options).launch(sgd_steps, steps)
    assert units0 == units1 == units  # the root, and each submodule shard_modules chose
    expected = single_process(steps)
    assert first.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(first[name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(second[name], value, rtol=1e-5, atol=1e-6)


def test_a_model_made_on_the_meta_device_is_materialised_and_trains():
    (before, after, first0, finite, losses, message, allowed, whole), (_, _, first1, *_) = fsdp().launch(
        meta_init
    )
    assert before == {"meta"} and after == {"cpu"}
    assert finite
    assert torch.equal(first0, first1)  # one tensor, gathered on both ranks
    assert not torch.equal(first0[:8], first0[8:])  # the ranks' shards are drawn apart
    assert losses[-1] < 0.2 * losses[0]
    assert "scale (Scaled)" in message and "reset_parameters()" in message
    assert allowed == "cpu" and whole == "cpu"


def test_a_sharded_checkpoint_round_trip(tmp_path):
    path = tmp_path / "ckpt"
    results = fsdp().launch(sharded_round_trip, str(path))
    for differed, rest, same_params, same_optimizer, same_after, errors, partial, point in results:
        assert differed and same_params and same_optimizer and same_after
        assert rest == {"step": 7, "extra": {"epoch": 1, "empty": {}, 3: "int key"}}
        assert "MisconfigurationError: load_checkpoint(" in errors[0]
        assert (
            "the checkpoint has no 'scheduler'; it has ['extra', 'model', 'optimizer', 'step']" in errors[0]
        )
        assert (
            errors[1].startswith("FileNotFoundError: load_checkpoint(") and "no checkpoint there" in errors[1]
        )
        assert "Put its module in the state too" in errors[2]
        assert partial == ["extra", "optimizer", "step"]
        assert "the module under 'model' does not match the checkpoint" in errors[3]
        assert (
            "in the checkpoint, not in the module: ['2.bias', '2.weight', '4.bias', '4.weight']" in errors[3]
        )
        assert errors[4].startswith(
            "MisconfigurationError: cannot load the entry 'point' of the checkpoint"
        ), errors[4]
        assert "weights_only=False" in errors[4] and "nothing in it was run" in errors[4], errors[4]
        assert point == Point(1, 2)
    assert path.is_dir() and (path / ".metadata").is_file()
    assert len(list(path.glob("*.distcp"))) == 2  # one file per rank


def test_a_full_checkpoint_round_trip_and_into_single_device(tmp_path):
    path = tmp_path / "full.pt"
    (rest, same, same_optimizer, params, mismatch), (*_, mismatch1) = fsdp(state_dict_type="full").launch(
        full_save, str(path)
    )
    assert rest == {"step": 3} and same and same_optimizer
    assert mismatch == mismatch1 and "the module under 'model' does not match the checkpoint" in mismatch
    saved = torch.load(path, weights_only=True)
    assert sorted(saved) == ["model", "optimizer", "step"]
    assert sorted(saved["optimizer"]["state"]) == list(range(6))  # keyed as optimizer.state_dict() is
    for name, value in params.items():
        assert torch.equal(saved["model"][name], value)

    # A plain model loads what fsdp wrote, steps and saves; fsdp loads that.
    [(rest, loaded, stepped)] = phalanx.resolve("single_device", accelerator="cpu").launch(
        plain_load, str(path)
    )
    assert rest == {"step": 3}
    for name, value in params.items():
        assert torch.equal(loaded[name], value)
    for (params0, steps0), (params1, _) in [fsdp().launch(full_load, str(tmp_path / "plain.pt"))]:
        assert steps0 == {4.0}  # 3 steps by fsdp, 1 by single_device
        for name, value in stepped.items():
            assert torch.equal(params0[name], value) and torch.equal(params1[name], value)


def test_an_optimizer_made_before_sharding_is_refused():
    strategy = fsdp()
    model = make_model()
    with pytest.raises(
        MisconfigurationError, match=r"functools\.partial\(torch\.optim\.AdamW, lr=1e-3\)"
    ) as info:
        strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "got an optimizer instance (SGD)" in str(info.value)
    with pytest.raises(
        MisconfigurationError, match=r"setup\(module\) needs the process group.*strategy\.launch\(\) first"
    ):
        strategy.setup(model, functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(MisconfigurationError, match=r"no_backward_sync.* got Sequential"):
        strategy.no_backward_sync(model)


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("reshard_after_forward", "yes", "give True"),
        ("reshard_after_forward", 2, "give True"),
        ("cpu_offload", 1, "give True"),
        ("mp_policy", "bf16", "MixedPrecisionPolicy"),
        ("state_dict_type", "local", "'sharded'.* or 'full'"),
        ("shard_modules", "Linear", "a module class or a set of them"),
        ("shard_modules", {int}, "a module class or a set of them"),
    ],
)
def test_bad_options_are_refused(option, value, allowed):
    with pytest.raises(MisconfigurationError, match=rf"{option}={value!r}.*{allowed}"):
        fsdp(**{option: value})


def test_no_backward_sync_accumulates_like_one_big_batch():
    for unreduced, reduced, whole, micro in fsdp().launch(accumulate):
        assert unreduced and reduced
        for name, value in whole.items():
            torch.testing.assert_close(micro[name], value, rtol=1e-5, atol=1e-6)


def test_clip_gradients_uses_the_norm_of_the_whole_gradient():
    results = fsdp().launch(clip)
    model = make_model()
    x, y = data()
    loss_of(model, x, y).backward()
    grads = [p.grad for p in model.parameters()]
    for norms, clipped_norm, by_value in results:
        for norm_type, (kind, norm) in norms.items():
            assert kind == "Tensor"
            expected = torch.nn.utils.get_total_norm(grads, norm_type=norm_type).item()
            assert norm == pytest.approx(expected, rel=1e-5), norm_type
        assert clipped_norm == pytest.approx(0.5, rel=1e-4)
        for (name, _), grad in zip(model.named_parameters(), grads):
            torch.testing.assert_close(by_value[name], grad.clamp(-0.05, 0.05), rtol=1e-5, atol=1e-7)


def train_with(strategy):
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.Adam, lr=0.02))
    x, y = strategy.batch_to_device(my_half(strategy, *data()))
    with strategy.forward_context():
        out = model(x)
    losses = train(strategy, model, optimizer, 40, x, y)
    return losses[0], losses[-1], str(next(model.parameters()).dtype), str(out.dtype)


@pytest.mark.parametrize(
    ("options", "param_dtype", "out_dtype"),
    [
        ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}, "torch.float32", "torch.bfloat16"),
        ({"cpu_offload": True, "reshard_after_forward": False}, "torch.float32", "torch.float32"),
        ({"precision": "bf16-true"}, "torch.bfloat16", "torch.bfloat16"),
        ({"precision": "bf16-mixed"}, "torch.float32", "torch.bfloat16"),
    ],
    ids=["mp_policy", "cpu_offload", "bf16-true", "bf16-mixed"],
)
def test_options_and_precisions_train(options, param_dtype, out_dtype):
    for first, last, params, out in fsdp(**options).launch(train_with):
        assert (params, out) == (param_dtype, out_dtype)
        assert last < 0.5 * first


# -- tied weights, every way a checkpoint crosses strategies ---------------------------------


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, as GPTs tie them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.mid(self.emb(idx))))


def _tied_step(strategy, model, optimizer, step):
    g = torch.Generator().manual_seed(10 * step + strategy.global_rank)
    idx = torch.randint(0, 8, (6,), generator=g)
    optimizer.zero_grad()
    strategy.backward(nn.functional.cross_entropy(model(idx), idx))
    strategy.optimizer_step(optimizer)


def _tied_state(strategy, model, optimizer):
    """Every parameter and its AdamW moments by (first) name, whole."""
    names = [name for name, _ in strategy.unwrap_module(model).named_parameters()]
    state = optimizer.state_dict()["state"]
    params = {name: full(p) for name, p in strategy.unwrap_module(model).named_parameters()}
    moments = {names[i]: (full(s["exp_avg"]), full(s["exp_avg_sq"])) for i, s in state.items()}
    return params, moments


def tied_save(strategy, path):
    torch.manual_seed(0)
    model, optimizer = strategy.setup(Tied(), functools.partial(torch.optim.AdamW, lr=0.05))
    for step in range(2):
        _tied_step(strategy, model, optimizer, step)
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer})
    return _tied_state(strategy, model, optimizer)


def tied_load(strategy, path):
    torch.manual_seed(1)
    model, optimizer = strategy.setup(Tied(), functools.partial(torch.optim.AdamW, lr=0.05))
    strategy.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    loaded = _tied_state(strategy, model, optimizer)
    _tied_step(strategy, model, optimizer, 2)  # and it trains on
    return loaded


TIED_SAVERS = {
    "fsdp-full": lambda: fsdp(state_dict_type="full"),
    "fsdp-sharded": lambda: fsdp(),
    "ddp": lambda: phalanx.resolve("ddp_fork", accelerator="cpu", devices=2, timeout=TIMEOUT),
    "single_device": lambda: phalanx.resolve("single_device", accelerator="cpu"),
}


@pytest.mark.parametrize(
    ("saver", "loader"),
    [
        ("fsdp-full", "fsdp-full"),
        ("fsdp-sharded", "fsdp-sharded"),
        ("fsdp-full", "single_device"),
        ("fsdp-full", "ddp"),
        ("single_device", "fsdp-full"),
        ("ddp", "fsdp-full"),
    ],
)
def test_a_model_with_tied_weights_resumes_across_strategies(saver, loader, tmp_path):
    path = str(tmp_path / ("ckpt" if saver == "fsdp-sharded" else "ckpt.pt"))
    params, moments = TIED_SAVERS[saver]().launch(tied_save, path)[0]
    assert "head.weight" not in params  # the tie: named once, by its first name
    for loaded_params, loaded_moments in TIED_SAVERS[loader]().launch(tied_load, path):
        assert loaded_params.keys() == params.keys()
        for name in params:
            torch.testing.assert_close(loaded_params[name], params[name], rtol=0, atol=0)
        assert loaded_moments.keys() == moments.keys()
        for name, (avg, avg_sq) in moments.items():
            torch.testing.assert_close(loaded_moments[name][0], avg, rtol=0, atol=0)
            torch.testing.assert_close(loaded_moments[name][1], avg_sq, rtol=0, atol=0)


def different_seeds(strategy):
    torch.manual_seed(strategy.global_rank)  # each rank makes its own initial weights
    model = strategy.setup(make_model(seed=strategy.global_rank))
    return {name: full(p) for name, p in model.named_parameters()}


def test_every_rank_starts_from_rank_0s_initial_weights():
    zero = {name: p.detach() for name, p in make_model(seed=0).named_parameters()}
    for params in fsdp().launch(different_seeds):
        assert params.keys() == zero.keys()
        for name in zero:
            torch.testing.assert_close(params[name], zero[name], rtol=0, atol=0)


def save_after_evaluation(strategy, path):
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.AdamW, lr=0.01))
    train(strategy, model, optimizer, 1, *my_half(strategy, *data()))
    with torch.no_grad():
        model(data()[0])  # a forward pass without backward: the root keeps its whole parameters
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer})
    fresh, fresh_optimizer = strategy.setup(make_model(seed=1), functools.partial(torch.optim.AdamW, lr=0.01))
    strategy.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    return all(torch.equal(full(a), full(b)) for a, b in zip(model.parameters(), fresh.parameters()))


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_save_after_an_evaluation_pass_works(kind, tmp_path):
    path = str(tmp_path / ("ckpt.pt" if kind == "full" else "ckpt"))
    assert fsdp(state_dict_type=kind).launch(save_after_evaluation, path) == [True, True]


def sgd_save(strategy, path):
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.SGD, lr=0.05))
    train(strategy, model, optimizer, 1, *my_half(strategy, *data()))
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer})
    return {name: full(p) for name, p in model.named_parameters()}


def sgd_load(strategy, path):
    model, optimizer = strategy.setup(make_model(seed=1), functools.partial(torch.optim.SGD, lr=0.5))
    strategy.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    return {name: full(p) for name, p in model.named_parameters()}, optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("saver", ["single_device", "fsdp-full"])
def test_an_optimizer_without_state_loads_from_a_full_checkpoint(saver, tmp_path):
    """Plain SGD keeps no tensors; torch's own loader cannot place such a
    state, and fsdp restores its hyperparameters instead."""
    path = str(tmp_path / "ckpt.pt")
    params = TIED_SAVERS[saver]().launch(sgd_save, path)[0]
    for loaded, lr in fsdp(state_dict_type="full").launch(sgd_load, path):
        assert lr == 0.05
        for name in params:
            torch.testing.assert_close(loaded[name], params[name], rtol=0, atol=0)
