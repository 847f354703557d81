"""The Strategy: one part of each kind, composed.

:class:`Strategy` is concrete: it is single-process training on one device,
with every collective call forwarded to its :class:`~phalanx_core.Collective`
and every numeric step to its :class:`~phalanx_core.Precision`. A parallel
strategy (DDP, FSDP, Horovod) subclasses it and overrides what it wraps
(:meth:`setup_module`, :meth:`setup_optimizer`, :meth:`no_backward_sync`,
checkpointing). No strategy talks to a backend for communication itself.

Core never imports torch at import time; the few methods that need it
(clipping, checkpoints, the init context) import it when called.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from ._forwarding import CollectiveCalls
from ._modules import is_module, make_optimizer, skip_init, to_device
from .checkpoint import (
    CheckpointIO,
    TorchCheckpointIO,
    _first_line,
    check_module_keys,
    check_module_shapes,
)
from .collective import OPERATIONS, plan_mismatch
from .errors import MisconfigurationError, WorkerFailedError
from .hangs import DEFAULT_HANG_REPORT, HANG_REPORT_VAR, HangWatch, hang_report_seconds, watch_methods
from .launcher import Launcher
from .saving import Agreement, BackgroundSaves, SaveHandle, agreed_failure

if TYPE_CHECKING:
    from .accelerator import Accelerator
    from .checkpoint_directory import CheckpointDirectory
    from .collective import Collective
    from .environment import ClusterEnvironment
    from .precision import Precision

__all__ = ["MissingAttributeError", "Strategy", "set_attribute_hint", "teardown_kept_ranks"]

T = TypeVar("T")


#: Set by the registry as it is imported: what a :class:`MissingAttributeError`
#: adds to its words (``hint(strategy, name)``: which installed strategies
#: have the attribute, and how to run one of them).
_attribute_hint: Callable[[Any, str], str] | None = None


def set_attribute_hint(hint: Callable[[Any, str], str] | None) -> None:
    """Who adds to the words of a :class:`MissingAttributeError` (the
    registry, which knows the installed strategies)."""
    global _attribute_hint
    _attribute_hint = hint


class MissingAttributeError(AttributeError):
    """A strategy lacks a public attribute: the error names the strategy
    and, where the registry can tell, which installed strategies have it and
    how to run one. The words are made only when the error is shown
    (``hasattr`` never pays for them)."""

    def __init__(self, strategy: Any, name: str) -> None:
        super().__init__(name, name=name, obj=strategy)
        self._strategy = strategy
        self._name = name

    def __str__(self) -> str:
        strategy, name = self._strategy, self._name
        plan = vars(strategy).get("plan")
        called = getattr(getattr(plan, "strategy", None), "name", None) or type(strategy).__qualname__
        words = f"strategy {called!r} ({type(strategy).__qualname__}) has no attribute {name!r}"
        if name.startswith("_") or _attribute_hint is None:
            return words
        try:
            return words + _attribute_hint(strategy, name)
        except Exception:  # noqa: BLE001 - the words of an error: never a second error
            return words


def _this_script() -> list[str] | None:
    """What follows ``python`` to run this process's main program again
    (its script or ``-m module``, then its arguments); ``None`` where there
    is no such program (a notebook, a REPL, ``python -c``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None) and spec.name != "__main__":
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return ["-m", name, *sys.argv[1:]]
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path) or hasattr(sys, "ps1"):
        return None
    return [path, *sys.argv[1:]]


#: The strategies this process keeps set up between launches (a warm rank of
#: a launcher that ``keeps_ranks``), by :attr:`Strategy._key`.
_KEPT: dict[str, Strategy] = {}


def _run_rank(strategy: Strategy, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    """What a launcher runs in every rank: set the strategy up, call the
    user's function with it, tear it down. In a warm rank (the launcher
    ``keeps_ranks``), the strategy set up at the first launch is kept and
    used again, and nothing is torn down."""
    if getattr(strategy.launcher, "keeps_ranks", False):
        kept = _KEPT.get(strategy._key)
        if kept is None:
            strategy.setup_environment()
            kept = _KEPT[strategy._key] = strategy
        return fn(kept, *args, **kwargs)
    strategy.setup_environment()
    try:
        return fn(strategy, *args, **kwargs)
    finally:
        strategy.teardown()


def teardown_kept_ranks() -> None:
    """Tear down every strategy this process keeps set up between launches
    (see :attr:`Launcher.keeps_ranks <phalanx_core.Launcher.keeps_ranks>`):
    what a warm rank calls before it ends. Safe to call more than once."""
    while _KEPT:
        _, strategy = _KEPT.popitem()
        strategy.teardown()


@functools.cache
def _core_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("phalanx-core")
    except PackageNotFoundError:
        return "unknown"


#: The methods in which a rank can wait for its peers: watched for hang reports.
_WATCHED = (
    "setup",
    "backward",
    "optimizer_step",
    "clip_gradients",
    "save_checkpoint",
    "load_checkpoint",
    *OPERATIONS,  # those a strategy forwards; the others are not its methods
)


class Strategy(CollectiveCalls):
    """The composition of the six kinds of part, and the training API.

    Constructed by the registry as ``Strategy(accelerator=..., environment=...,
    collective=..., precision=..., launcher=..., parallel_devices=[...],
    num_nodes=..., **options)``; ``parallel_devices`` holds one device per
    local rank.

    Options every strategy takes: ``deterministic`` (``True`` switches on
    torch's deterministic algorithms in every rank, ``"warn"`` only warns
    about the nondeterministic ones), ``checkpoint_io`` (how checkpoint
    files are written) and ``hang_report`` (seconds an operation may wait
    before its rank reports where every rank is, see
    :mod:`phalanx_core.hangs`; default ``PHALANX_HANG_REPORT``, else 300;
    0 for no reports).

    The operations a rank can wait in for its peers (``setup``,
    ``backward``, ``optimizer_step``, ``clip_gradients``, the checkpoint
    methods and every collective) are watched for hang reports, in this
    class and in every subclass that overrides them.
    """

    #: The contract operations this strategy's own traffic needs from its
    #: collective (DDP's gradient buckets: ``all_reduce``; FSDP's shards:
    #: ``all_gather`` and ``reduce_scatter``). A collective that lists one
    #: of them in ``unsupported`` is refused when the strategy is made,
    #: naming it, instead of failing at the first backward pass.
    traffic: ClassVar[frozenset[str]] = frozenset()
    #: Makes the ``checkpoint_io`` of a strategy given none (a plugin's
    #: strategies may read more formats than plain files).
    default_checkpoint_io: ClassVar[type[CheckpointIO]] = TorchCheckpointIO

    _hang_watch: HangWatch | None = None
    _launched_here: bool = False  # set up by launch() with no function
    #: Names this strategy across the processes its copies are pickled to
    #: (a warm rank keeps the one it set up under it).
    _key: str = ""
    #: What this rank keeps between launches. With warm ranks (launcher
    #: ``ray`` with ``keep_alive=True``) the same dict is there at the next
    #: launch of the same strategy, in the same process, with the model a
    #: first launch put in it; elsewhere each launch starts with the
    #: launching process's (empty) dict.
    rank_state: dict[str, Any]
    #: The registry's plan this strategy was built from (``phalanx.Plan``:
    #: ``plan.strategy.name``, each part's name and why it was chosen,
    #: ``plan.options`` as given); ``None`` for a strategy built by hand.
    plan: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        watch_methods(cls, _WATCHED, OPERATIONS)

    def __getattr__(self, name: str) -> Any:
        # Only for what the class and the instance lack: an error that says
        # which strategy this is and, where the registry can tell, which
        # installed strategies have it (a script written for ddp_ft run
        # with plain python resolves another strategy).
        raise MissingAttributeError(self, name)

    def __init__(
        self,
        *,
        accelerator: Accelerator,
        environment: ClusterEnvironment,
        collective: Collective,
        precision: Precision,
        launcher: Launcher,
        parallel_devices: Sequence[Any] = (),
        num_nodes: int = 1,
        checkpoint_io: CheckpointIO | None = None,
        deterministic: bool | str = False,
        hang_report: float | None = None,
    ) -> None:
        if not isinstance(deterministic, (bool, str)) or deterministic not in (True, False, "warn"):
            raise MisconfigurationError(
                f"deterministic={deterministic!r}: give True (torch's deterministic algorithms, an error "
                "where an operation has none), 'warn' (a warning instead of the error) or False"
            )
        self.deterministic = deterministic
        self._key = uuid.uuid4().hex
        self.rank_state = {}
        raw = os.environ.get(HANG_REPORT_VAR) if hang_report is None else None
        #: Seconds before a waiting operation is reported (``inf``: never).
        self.hang_report = (
            hang_report_seconds(raw, where=f"the variable {HANG_REPORT_VAR}")
            if raw
            else hang_report_seconds(
                hang_report if hang_report is not None else DEFAULT_HANG_REPORT, where="strategy option"
            )
        )
        self._deterministic_before: tuple[bool, bool] | None = None
        self.accelerator = accelerator
        self.environment = environment
        self.collective = collective
        self.precision = precision
        self.launcher = launcher
        self.parallel_devices = list(parallel_devices)
        self.num_nodes = num_nodes
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else self.default_checkpoint_io()
        self._saves = BackgroundSaves()
        precision.check_accelerator(accelerator)
        collective.check_accelerator(accelerator)
        collective.check_launcher(launcher, environment)
        self._check_traffic(collective)

    def _check_traffic(self, collective: Collective) -> None:
        missing = sorted(set(self.traffic) & set(getattr(collective, "unsupported", ())))
        if missing:
            raise MisconfigurationError(
                f"strategy {type(self).__name__} sends its training traffic through its collective, and "
                f"collective {getattr(collective, 'name', type(collective).__name__)!r} cannot do "
                f"{', '.join(missing)} (it lists them as unsupported); choose a collective that has "
                f"{', '.join(sorted(self.traffic))}, e.g. collective='torch'"
            )

    # -- where this rank is -------------------------------------------------

    @property
    def global_rank(self) -> int:
        """This process's rank in the job."""
        return self.environment.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.environment.local_rank

    @property
    def node_rank(self) -> int:
        """The rank of this process's node."""
        return self.environment.node_rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the job."""
        return self.environment.world_size

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0 of the job."""
        return self.global_rank == 0

    @property
    def root_device(self) -> Any:
        """The device of this local rank."""
        if not self.parallel_devices:
            return self.accelerator.get_device(0)
        return self.parallel_devices[self.local_rank]

    # -- life cycle ---------------------------------------------------------

    @overload
    def launch(self) -> None: ...

    @overload
    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]: ...

    def launch(self, fn: Callable[..., T] | None = None, *args: Any, **kwargs: Any) -> list[T] | None:
        """Run ``fn(strategy, *args, **kwargs)`` on every rank through the
        launcher; return every rank's result, indexed by global rank (see
        :class:`~phalanx_core.Launcher`). The strategy is set up before
        ``fn`` runs and torn down after.

        With no function (a flat script, as torchrun scripts are written:
        set up, then the loop), ``launch()`` makes this process a rank:

        - where the processes exist already (``phalanx run``, torchrun,
          srun, mpirun, horovodrun, one process alone), it sets this rank
          up (its device, the collective's group) and returns ``None``;
          the rest of the script is the rank's program, and the strategy is
          torn down when the interpreter exits;
        - where the launcher starts them (``python train.py`` with
          ``ddp``, ``ddp_spawn``, ``mpi``, ``horovod``), it runs this script
          again as every rank's program, as ``phalanx run`` does (each
          output line prefixed ``[rankN]:``; there ``launch()`` sets the
          rank up), waits for them, and ends this process (``SystemExit(0)``)
          once every rank has finished: the code after ``launch()`` runs in
          the ranks only. When a rank fails, the others are stopped, and
          this process says which failed first (its traceback is in the
          lines marked with its rank) and exits with its code, as
          ``phalanx run`` does. A launcher that cannot run a script
          (``xla``), or a session with no script (a notebook), is refused:
          give ``launch`` a function there.
        """
        if fn is None:
            if args or kwargs:
                raise MisconfigurationError(
                    "strategy.launch() got arguments but no function; pass the function first "
                    "(strategy.launch(main, *args)), or call launch() alone in a flat script"
                )
            self._launch_here()
            return None
        return self.launcher.launch(_run_rank, self, fn, args, kwargs)

    def _launch_here(self) -> None:
        """``launch()`` with no function (see :meth:`launch`)."""
        if self._launched_here:
            raise MisconfigurationError(
                "strategy.launch() was called already in this process: this rank is set up; call it "
                "once per script"
            )
        launcher = self.launcher
        if launcher.runs_in_place():
            self.setup_environment()
            self._launched_here = True
            atexit.register(self._teardown_at_exit)
            return
        name = getattr(launcher, "name", None) or type(launcher).__name__
        command = _this_script()
        if command is None or type(launcher).run_script is Launcher.run_script:
            why = (
                "this session runs no script file (a notebook, a REPL, python -c)"
                if command is None
                else f"launcher {name!r} runs functions, not scripts"
            )
            raise MisconfigurationError(
                f"strategy.launch() with no function makes this process a rank, but no process of the "
                f"job exists yet and {why}. Put the training code in a function and call "
                "strategy.launch(main), or start the script with `phalanx run` (or torchrun, srun, "
                "mpirun), where launch() sets up the rank the command started"
            )
        try:
            launcher.run_script(command)
        except WorkerFailedError as exc:
            # The ranks' own output, their tracebacks included, is above,
            # each line marked with its rank: say which failed, once.
            sys.stderr.write(f"strategy.launch(): {exc.first_failure()}. The other ranks were stopped.\n")
            raise SystemExit(exc.exit_status) from None
        raise SystemExit(0)

    def _teardown_at_exit(self) -> None:
        if self._launched_here:
            self._launched_here = False
            self.teardown()

    def setup_environment(self) -> None:
        """Prepare this rank: deterministic algorithms where asked for, its
        device, then the collective's group."""
        if self.deterministic:
            self._use_deterministic_algorithms()
        self.accelerator.setup_device(self.root_device)
        self.collective.plan_facts = self.plan_facts()
        self.collective.arrival_report = self.hang_report
        self.collective.setup(self.environment, self.accelerator)
        if self.collective.world_size > 1 and not self.collective.plan_checked:
            self._check_plan_across_nodes()
        if self.world_size > 1 and self.hang_report != float("inf"):
            board = self.collective.board() if self.collective.world_size > 1 else None
            self._hang_watch = HangWatch(
                self.hang_report, self.global_rank, self.world_size, board, timeout=self.collective.timeout
            )
            self._hang_watch.start()

    def plan_facts(self) -> dict[str, str]:
        """What every node of the job must have resolved alike, checked
        across the nodes before the first collective (a node that differs
        would wait in other places than the others, or forever): the world,
        the strategy and its parts, the options, and the versions of phalanx
        and of the parts' distributions. Not the main address: nodes that
        compare their plans have met at it, whatever name each gave it."""
        plan = self.plan
        facts = {
            "world size": str(self.environment.world_size),
            "nodes": str(self.num_nodes),
            "devices per node": str(len(self.parallel_devices) or 1),
        }
        parts = {
            "strategy": self,
            "accelerator": self.accelerator,
            "environment": self.environment,
            "collective": self.collective,
            "precision": self.precision,
            "launcher": self.launcher,
        }
        for kind, part in parts.items():
            choice = getattr(plan, kind, None) if plan is not None else None
            name = getattr(choice, "name", None) or type(part).__qualname__
            provider = getattr(choice, "provider", None)
            facts[kind] = f"{name} ({provider.distribution} {provider.version})" if provider else name
        if plan is not None and plan.options:
            facts["options"] = ", ".join(f"{k}={v!r}" for k, v in sorted(plan.options.items()))
        facts["phalanx-core"] = _core_version()
        return facts

    def _check_plan_across_nodes(self) -> None:
        """The plans of every node, gathered through the collective (for a
        collective that could not compare them before its group existed)."""
        if "all_gather_object" in self.collective.unsupported:
            return
        facts = dict(self.collective.plan_facts or {})
        posts = self.collective.all_gather_object((self.environment.node_rank, facts))
        error = plan_mismatch(dict(posts))
        if error is not None:
            raise error

    def _use_deterministic_algorithms(self) -> None:
        import torch

        self._deterministic_before = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        # cuBLAS is deterministic only with a fixed workspace; torch raises
        # without this variable once deterministic algorithms are on.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=self.deterministic == "warn")

    def setup(self, module: Any, *optimizers: Any) -> Any:
        """Prepare a module and its optimizers for training: precision
        conversion, device placement, then the strategy's wrapping.

        Each optimizer may be an optimizer or a callable that makes one from
        the module's parameters (``functools.partial(torch.optim.SGD,
        lr=0.1)``), which lets the strategy make it after wrapping. Returns
        the module, or ``(module, *optimizers)`` when optimizers are given.
        """
        module = self.precision.convert_module(module)
        module = self.module_to_device(module)
        module = self.setup_module(module)
        made = [self.setup_optimizer(opt) for opt in self._make_optimizers(module, optimizers)]
        return (module, *made) if made else module

    @staticmethod
    def _make_optimizers(module: Any, optimizers: Sequence[Any]) -> list[Any]:
        """Each of ``optimizers`` as an optimizer: factories are called with
        ``module``'s parameters."""
        # An optimizer class (torch.optim.Adam) is a factory, though it has .step
        return [
            opt if hasattr(opt, "step") and not isinstance(opt, type) else make_optimizer(opt, module)
            for opt in optimizers
        ]

    def setup_module(self, module: Any) -> Any:
        """Wrap a module already on its device (DDP, FSDP); the base returns
        it as it is."""
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        """Wrap an optimizer (Horovod's DistributedOptimizer); the base
        returns it as it is."""
        return optimizer

    def unwrap_module(self, module: Any) -> Any:
        """Return the user's module inside a wrapper this strategy made (the
        ``module`` of a DDP wrapper); the base has no wrapper. Checkpoints
        save and load the unwrapped module, so their keys do not depend on
        the strategy."""
        return module

    def module_to_device(self, module: Any) -> Any:
        """Move ``module`` to :attr:`root_device`; return it."""
        return module.to(self.root_device)

    def batch_to_device(self, batch: Any) -> Any:
        """Move every tensor in ``batch`` (nested lists, tuples and dicts)
        to :attr:`root_device`, converted by the precision."""
        return self.precision.convert_input(to_device(batch, self.root_device))

    def setup_dataloader(
        self, dataloader: Any, *, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Prepare a ``torch.utils.data.DataLoader`` for this rank.

        With ``use_distributed_sampler``, the loader is rebuilt with
        phalanx's ``DistributedSampler`` (on one rank too) so that each rank
        reads its own share of the dataset (shuffled if the original loader
        shuffled, with the same seed on every rank; call
        ``loader.set_epoch(epoch)`` each epoch for a new order), and the
        returned loader keeps its position in the epoch for checkpoints
        (``state_dict()``, ``load_state_dict()``, ``epoch``: a resume goes on
        with the rest of the epoch, split over the ranks there are then).
        With ``move_to_device``, every batch is moved to :attr:`root_device`
        (:meth:`batch_to_device`). A loader with its own ``batch_sampler``
        cannot get a sampler injected: it is refused with what to do, unless
        ``use_distributed_sampler=False``.
        """
        from ._data import distribute_loader

        return distribute_loader(
            self, dataloader, use_distributed_sampler=use_distributed_sampler, move_to_device=move_to_device
        )

    def teardown(self) -> None:
        """Leave the group and release what setting up took; in the
        launching process, also what the launcher keeps between launches
        (warm ranks: :meth:`Launcher.teardown <phalanx_core.Launcher.teardown>`).

        A checkpoint save still in flight is finished first (this rank's
        part); if it failed and nobody waited for it, teardown raises its
        :class:`~phalanx_core.errors.CheckpointSaveError` at the end."""
        unwaited = self._saves.close()
        self.launcher.teardown()
        if self._hang_watch is not None:
            self._hang_watch.stop()
            self._hang_watch = None
        self.collective.teardown()
        self.precision.teardown()
        self.accelerator.teardown()
        self.environment.teardown()
        if self._deterministic_before is not None:
            import torch

            enabled, warn_only = self._deterministic_before
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
            self._deterministic_before = None
        if unwaited is not None:
            raise unwaited

    # -- training steps -----------------------------------------------------

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        """The precision's context around the forward pass."""
        return self.precision.forward_context()

    def backward(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        """Run backward from ``tensor`` through the precision."""
        self.precision.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
        """Step ``optimizer`` through the precision."""
        return self.precision.optimizer_step(optimizer, closure)

    def clip_gradients(
        self,
        module: Any,
        optimizer: Any,
        *,
        max_norm: float | None = None,
        clip_val: float | None = None,
        norm_type: float = 2.0,
    ) -> Any:
        """Clip gradients by norm (``max_norm``, returning the total norm)
        or by value (``clip_val``); exactly one of the two."""
        import torch

        if (max_norm is None) == (clip_val is None):
            raise MisconfigurationError(
                "clip_gradients() needs exactly one of max_norm= (clip by norm) or clip_val= "
                f"(clip by value); got max_norm={max_norm!r}, clip_val={clip_val!r}"
            )
        self.precision.unscale_gradients(optimizer)
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(module.parameters(), clip_val)
            return None
        return torch.nn.utils.clip_grad_norm_(module.parameters(), float(max_norm or 0), norm_type=norm_type)

    def no_backward_sync(self, module: Any, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """A context in which backward does not synchronise gradients across
        ranks (gradient accumulation). The base has nothing to synchronise."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """A context in which modules are created directly on
        :attr:`root_device` (no copy from the CPU), in the precision's
        dtype where it converts modules.

        With ``empty_init=True`` the ``torch.nn.init`` functions do nothing
        inside the context, so parameters are left uninitialised: use it when
        a checkpoint will overwrite them. Strategies that shard override this
        (``fsdp`` creates modules on the meta device by default).
        """
        import torch

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.device(self.root_device))
            stack.enter_context(self.precision.module_init_context())
            if empty_init:
                stack.enter_context(skip_init())
            yield

    # -- checkpoints ---------------------------------------------------------

    def save_checkpoint(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, blocking: bool = True
    ) -> SaveHandle:
        """Save ``state`` to ``path``: modules and optimizers in it are saved
        as their ``state_dict()``, with the precision's state under
        ``"precision"``. Rank 0 writes (atomically: ``path`` holds the
        previous checkpoint until the new one is complete and fsynced).
        Every rank must call it.

        With ``blocking`` (the default) every rank returns once the
        checkpoint is complete. With ``blocking=False`` rank 0 copies the
        state into host memory and writes it in the background; every rank
        returns at once with a :class:`~phalanx_core.saving.SaveHandle`
        whose collective ``wait()`` returns once the checkpoint is complete
        (see :mod:`phalanx_core.saving` for the rules: one save in flight,
        failures raised, the host memory it keeps). A save waits for the
        one in flight first."""
        self._check_blocking(blocking)
        self._saves.finish()
        if blocking:
            if self.is_global_zero:
                self.checkpoint_io.save(self._to_state(state), path)
            if self.world_size > 1:
                self.barrier()
            return SaveHandle.finished(path)
        write = None
        if self.is_global_zero:
            staged = self._saves.stager.stage(self._to_state(state))
            write = functools.partial(self.checkpoint_io.save, staged, path)
        return self._saves.start(path, write, self._agreement(path))

    def _check_blocking(self, blocking: Any) -> None:
        if not isinstance(blocking, bool):
            raise MisconfigurationError(
                f"save_checkpoint(blocking={blocking!r}): give True (return once the checkpoint is "
                "written) or False (write it in the background and return a handle)"
            )

    def _agreement(self, path: str | os.PathLike[str]) -> Agreement | None:
        """How the ranks agree on a background save's outcome: every rank's
        failure gathered (None in a job of one rank)."""
        if self.world_size == 1:
            return lambda mine: (
                agreed_failure([(0, _first_line(mine))], mine, os.fspath(path), 0) if mine else None
            )

        def agree(mine: BaseException | None) -> BaseException | None:
            ours = (self.global_rank, _first_line(mine)) if mine is not None else None
            return agreed_failure(self.all_gather_object(ours), mine, os.fspath(path), self.global_rank)

        return agree

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        """Load a checkpoint from ``path``. Modules and optimizers in
        ``state`` are restored in place from it; the remaining entries of
        the file are returned. With ``strict``, a key of ``state`` missing
        from the file is an error, and so are mismatched module keys.

        A file that is not a whole checkpoint (empty, truncated, damaged,
        not written by ``torch.save``), or an entry that does not fit what
        it is loaded into (another model's keys or shapes), is a
        :class:`~phalanx_core.MisconfigurationError` that names the file,
        raised before anything is loaded where it can be told beforehand.

        A save in flight (``blocking=False``) is waited for first."""
        self._saves.finish()
        loaded = self.checkpoint_io.load(path, weights_only=weights_only)
        precision_state = loaded.pop("precision", None)
        # Check every entry before loading any; then load the modules last
        # (an optimizer or another object refuses in its load_state_dict),
        # and the precision's state at the very end.
        targets: list[tuple[bool, str, Any, Any]] = []
        for key, target in (state or {}).items():
            if key not in loaded:
                if strict:
                    raise MisconfigurationError(
                        f"load_checkpoint({os.fspath(path)!r}): the file has no {key!r}; it has "
                        f"{sorted(loaded)}. Pass strict=False to load what is there"
                    )
                continue
            value = loaded.pop(key)
            if not hasattr(target, "load_state_dict"):
                continue
            target = self.unwrap_module(target)
            a_module = is_module(target)
            if a_module:
                if not isinstance(value, Mapping):
                    raise MisconfigurationError(
                        f"load_checkpoint({os.fspath(path)!r}): the entry {key!r} is not a module's state "
                        f"dict (it holds a value of type {type(value).__name__}); give the key under which "
                        "the module was saved"
                    )
                mine = target.state_dict()
                if strict:
                    check_module_keys(path, key, mine, value)
                check_module_shapes(path, key, mine, value)
            targets.append((a_module, key, target, value))
        for a_module, key, target, value in sorted(targets, key=lambda t: t[0]):
            try:
                if a_module:
                    target.load_state_dict(value, strict=strict)
                else:
                    target.load_state_dict(value)
            except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise MisconfigurationError(
                    f"load_checkpoint({os.fspath(path)!r}): the entry {key!r} does not fit the "
                    f"{type(target).__name__} it was given to ({_first_line(exc)}); "
                    "load it into one like the one it was saved from"
                ) from exc
        if precision_state is not None:
            self.precision.load_state_dict(precision_state)
        return loaded

    @property
    def restart_count(self) -> int:
        """How many times the job's ranks were started again after a failure
        (``max_restarts``): 0 on the first start. Read from the launcher's
        rank variables (``TORCHELASTIC_RESTART_COUNT``, as torchrun's ranks
        have it)."""
        from .launching import RESTART_COUNT_VAR

        raw = os.environ.get(RESTART_COUNT_VAR, "0")
        return int(raw) if raw.isdigit() else 0

    def resume(
        self,
        checkpoints: CheckpointDirectory | str | os.PathLike[str],
        state: Mapping[str, Any],
        *,
        strict: bool = True,
        weights_only: bool = True,
    ) -> int:
        """Go on from the newest complete checkpoint of ``checkpoints`` (a
        :class:`~phalanx_core.CheckpointDirectory`, or its folder): load it
        into ``state`` (modules, optimizers, a loader from
        :meth:`setup_dataloader`, anything with ``load_state_dict``) and
        return its step; on a first start (no checkpoint yet) load nothing
        and return 0. Every rank must call it; every rank loads the same
        checkpoint (rank 0's choice). The rest of the checkpoint is
        returned by :meth:`load_checkpoint` as usual; here it is dropped,
        so put what you need back in objects with ``load_state_dict``."""
        from .checkpoint_directory import CheckpointDirectory

        directory = (
            checkpoints if isinstance(checkpoints, CheckpointDirectory) else CheckpointDirectory(checkpoints)
        )
        found = directory.latest_step() if self.is_global_zero else None
        if self.world_size > 1:
            found = self.broadcast_object(found, src=0)
        if found is None:
            return 0
        self.load_checkpoint(directory.path(found), state, strict=strict, weights_only=weights_only)
        return int(found)

    def _to_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        out = {
            k: (self.unwrap_module(v).state_dict() if hasattr(v, "state_dict") else v)
            for k, v in state.items()
        }
        precision_state = self.precision.state_dict()
        if precision_state:
            out["precision"] = precision_state
        return out

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)  # noqa: T201 - the user asked to print

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{kind}={type(getattr(self, kind)).__name__}"
            for kind in ("accelerator", "environment", "collective", "precision", "launcher")
        )
        return f"{type(self).__name__}({parts})"


for _class in (CollectiveCalls, Strategy):
    watch_methods(_class, _WATCHED, OPERATIONS)
