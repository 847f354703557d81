"""``local_sgd_ft``, ``diloco_ft`` and ``diloco_hsdp_ft``: replica groups
that train on their own for a window of steps and agree on the model at its
end (TorchFT's ``LocalSGD`` and ``DiLoCo``), fault tolerant as ``ddp_ft``."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from phalanx_core import MisconfigurationError, SaveHandle
from phalanx_torch.fsdp import FSDPStrategy
from phalanx_torch.strategies import DDPStrategy

from ._variables import COMMITTED_FILE_VAR
from .errors import NoQuorumError
from .strategy import FaultTolerant, _create, _each_dtensor

__all__ = ["DiLoCoFTStrategy", "DiLoCoHSDPFTStrategy", "DiLoCoWindows", "LocalSGDFTStrategy", "Windowed"]


class Windowed(FaultTolerant):
    """What the windowed strategies share: each replica group trains on
    its own (DDP or FSDP within the group, over the strategy's collective)
    for ``sync_every`` steps, a window, and at its end the
    groups in that sync's quorum agree on the model, through TorchFT's
    manager and the collective between the groups (``across``): nothing
    crosses between the groups inside a window.

    A group that is lost is left out of the next sync, and the others go
    on without it; the window it was in is lost with it (its samples are
    dealt again). A group that comes back trains its first window from
    the weights it has, asks for the next sync's quorum, and heals in it:
    it takes the job's model as of the window's start and the state of the
    optimizers from a peer, and adds nothing to that sync (a window
    trained from other weights). Where a sync fails (a group lost in the
    middle of it) no group commits it: each goes back to the model of the
    window's start (``diloco_ft``; ``local_sgd_ft`` keeps its own) and the
    window's samples are dealt again.

    The loader (``setup_dataloader``) deals each window's steps over the
    groups of the window's start, as ``ddp_ft`` deals a step; a window's
    samples are taken where its sync is committed, those of the groups
    that were not in it (lost, or healing) given back. So each sample of
    an epoch is in exactly one committed window, trained by one group.

    :attr:`current_step` counts training steps: the windows committed,
    each ``sync_every`` steps (a fragment's, under ``diloco_ft`` with
    ``fragments``), and the steps of the window in flight. :attr:`committed`
    is the last sync's verdict. Checkpoints are saved at a sync (where
    :attr:`at_sync` is true), with the window's starting model.

    Options, with :class:`FaultTolerant`'s (``replica_timeout``,
    ``quorum_timeout``, ``across``) and DDP's:

    - ``sync_every``: the steps of a window (``H``).
    """

    #: TorchFT's quorum in the training thread: a group that heals has its
    #: peers' state before the sync's all-reduce (TorchFT's DiLoCo needs it).
    async_quorum: ClassVar[bool] = False
    #: Whether a sync that is not committed leaves each group what it
    #: trained in the window (``LocalSGD``), rather than the model of the
    #: window's start (``DiLoCo``).
    keeps_failed_windows: ClassVar[bool] = False
    #: The loader settles a window of steps at its sync (QuorumLoader).
    settles_windows: ClassVar[bool] = True

    def __init__(self, *, sync_every: int, **options: Any) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise MisconfigurationError(
                f"strategy {self.name!r}: sync_every={sync_every!r}; expected the number of training "
                "steps between two syncs of the groups, an int of at least 1"
            )
        super().__init__(**options)
        self.sync_every = sync_every
        self._module: Any = None  # the module set up, unwrapped
        self._inner: Any = None  # the optimizer set up (torch's)
        self._algorithm: Any = None  # TorchFT's LocalSGD or DiLoCo, made at the first step
        self._local = 0  # steps of the window in flight
        self._window_start: list[Any] = []  # the model at the window's start (on the CPU)
        # The members the window's batches are dealt to: (quorum id, members,
        # this group's index), as of the sync that started it; None before one.
        self._window_basis: tuple[int, int, int] | None = None
        self._healed = False  # this group took its peers' state in the sync's quorum
        self._starting = False  # in ddp_ft's _start_alike, in the quorum asked for before it
        self._in_sync = False  # this step's end asks for the sync's quorum
        self._asked = False  # _start_alike's quorum is asked for, not yet used
        self._sync_step = 0  # TorchFT's step as of the last sync's quorum
        self._window_began = time.monotonic()  # when the window in flight took its first step
        self._told: tuple[int, frozenset[int]] = (0, frozenset())  # the sync's dealt-to, trained
        # The sync's quorum was asked for before the window's last step (a
        # fragment's delay): its groups check in again before the commit.
        self._check_in = False
        #: Whether this group's window was in the last sync (committed, and
        #: the group neither healed in it nor had its window dealt by
        #: another quorum): its samples were trained. ``None`` before one.
        self.contributed: bool | None = None

    # -- what a subclass says -----------------------------------------------------

    @property
    def steps_per_sync(self) -> int:
        """Training steps between two syncs (``sync_every``; a fragment's
        under ``diloco_ft``)."""
        return self.sync_every

    @property
    def _quorum_at(self) -> int:
        """The step of the window at whose end TorchFT's algorithm asks for
        the sync's quorum (before its last, ``fragment_sync_delay``)."""
        return self.steps_per_sync

    def _make_algorithm(self, module: Any, optimizer: Any) -> Any:
        """TorchFT's algorithm over ``module`` and the inner ``optimizer``
        (a context manager): each strategy of this kind names its own."""
        raise NotImplementedError(f"{type(self).__name__} names no TorchFT algorithm (_make_algorithm)")

    # -- where the job is ---------------------------------------------------------

    @property
    def current_step(self) -> int:
        """Training steps of the job: those of the committed windows (the
        same on every group; a healed group takes its peers') and those of
        the window in flight."""
        return max(int(self.manager.current_step()) - self._setups, 0) * self.steps_per_sync + self._local

    @property
    def at_sync(self) -> bool:
        """Whether the last step ended a window (or none was taken): the
        model is the one the groups agreed on, and a checkpoint may be saved."""
        return self._local == 0

    # -- setting up -----------------------------------------------------------------

    def setup(self, module: Any, *optimizers: Any) -> Any:
        if self._module is not None:
            raise MisconfigurationError(
                f"strategy {self.name!r}: setup() was called already; its groups agree on one model "
                "and one optimizer (TorchFT's algorithm wraps both): set them up together, once"
            )
        if len(optimizers) != 1:
            raise MisconfigurationError(
                f"strategy {self.name!r}: setup() takes the module and one optimizer (the inner one, "
                f"stepped each training step), got {len(optimizers)} optimizers"
            )
        return super().setup(module, *optimizers)

    def setup_optimizer(self, optimizer: Any) -> Any:
        self._inner = optimizer
        return _WindowOptimizer(self, optimizer)

    def _heal_with(self, module: Any, optimizers: tuple[Any, ...]) -> None:
        self._module = module
        self._window_start = _copies(module)
        super()._heal_with(module, optimizers)

    def _register_window(self, module: Any) -> None:
        """The window's starting model as state a healing group copies,
        registered after the module's (its load comes after the module's)
        and before the first quorum this group asks for, which may heal it
        (a group that joins as the others sync heals in its setup)."""

        def state_dict() -> dict[str, Any]:
            return {"start": self._window_start}

        def load_state_dict(state: dict[str, Any]) -> None:
            # The model of the window's start, so that this group, which
            # trained its window from other weights, adds nothing to the sync.
            self._window_start = [t.clone() for t in state["start"]]
            _load_into(module, self._window_start)
            self._healed = True

        self.manager.register_state_dict_fn("phalanx_window", load_state_dict, state_dict)

    def _start_alike(self, module: Any) -> None:
        """As ``ddp_ft``'s, in a quorum of every group of the job: a group
        synced only at a window's end could otherwise train a window from
        its own start with the groups that came first, while the others
        made a start of their own at the same step of TorchFT's (two
        models, neither healed from the other). The groups at their setup wait for one
        another up to the group's first wait (60 s), then go on if a
        majority is there; fewer after ``quorum_timeout`` more is
        :class:`NoQuorumError`. A group that joins a job that has trained
        (the launcher's mark), or whose quorum finds the others at a sync,
        heals at its first sync instead."""
        self._register_window(module)
        committed = os.environ.get(COMMITTED_FILE_VAR)
        if committed and os.path.exists(committed):
            self._setups += 1
            return
        deadline = time.monotonic() + self._start_wait
        groups = self.replica_groups
        majority = groups // 2 + 1
        while True:
            self._ask_quorum(timeout=self._start_wait)
            self._trained_members(basis=None, at_setup=True, late=time.monotonic() > deadline)
            if self._mixed or self.manager.current_step() > 0:
                # The others are past their start: this group heals at its
                # first sync, behind them. Where this quorum was one of their
                # syncs, TorchFT healed it here, to their step, before its
                # loader was set up (setup_dataloader comes after setup):
                # back to step 0, so that its first sync heals it whole.
                self._setups += 1
                self.manager.load_state_dict({**self.manager.state_dict(), "step": 0})
                return
            members = int(self.manager.num_participants())
            if members >= groups or (members >= majority and self._late):
                break
            if time.monotonic() > deadline + self.quorum_timeout:
                raise NoQuorumError(
                    f"replica group {self.replica_group}: {members} of the job's {groups} groups started "
                    f"within {self._start_wait + self.quorum_timeout:g} s; a window's groups start "
                    f"together, at least a majority ({majority}). The others failed or are slow to start "
                    "(their output says which)"
                )
            time.sleep(_START_POLL)
        self._asked = True
        self._starting = True
        try:
            super()._start_alike(module)  # in the quorum asked for above
        finally:
            self._starting = False
        self._window_start = _copies(module)
        self._window_basis = self._quorum_basis()

    def open_step(self, timeout: float | None = None) -> None:
        """A quorum is asked for at a sync only (:meth:`_sync_quorum`); the
        step ``_start_alike`` makes the groups alike in is in the quorum it
        asked for (and, where that step is not committed, in a new one)."""
        if not self._starting or self._step_open:
            return
        if self._asked:
            self._asked = False
            self._step_open, self._quorum_seen, self._verdict = True, False, None
            return
        super().open_step(timeout)

    def backward(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        # The strategy within the group's (DDP's, FSDP's): a step between
        # two syncs asks for no quorum (ddp_ft's backward opens a step).
        super(FaultTolerant, self).backward(tensor, *args, **kwargs)

    # -- a sync -------------------------------------------------------------------

    def _ask_quorum(self, timeout: float | None = None) -> None:
        """Ask the lighthouse for a quorum and wait for it (a group behind
        heals in it); where none comes, :class:`NoQuorumError`."""
        self._healed = False
        self.manager.start_quorum(timeout=timedelta(seconds=timeout or self.quorum_timeout))
        self._step_open, self._quorum_seen = True, False
        self.wait_quorum()
        self._step_open = False

    def _quorum_basis(self) -> tuple[int, int, int] | None:
        """The last quorum's (id, members, this group's index), as the
        groups' collective was configured for it."""
        return self._configured

    def _sync_members(self, at_setup: bool = False) -> tuple[int, frozenset[int]]:
        """Which of the groups the window was dealt to trained it (see
        :meth:`FaultTolerant._trained_members`), learned by the groups in
        the sync's quorum together (a group in its setup counts as one that
        heals; :attr:`_mixed`: some were, others at a sync)."""
        healer = at_setup or self._healed or self._window_basis is None
        return self._trained_members(basis=None if healer else self._window_basis, at_setup=at_setup)

    def _before_step(self) -> None:
        """Before a training step: TorchFT's algorithm made (at the first),
        and, at the step whose end asks for the sync's quorum, that quorum
        asked for here first, with the groups' word on the window's samples."""
        if self._algorithm is None:
            self._algorithm = self._make_algorithm(self._module, self._inner)
            self._algorithm.__enter__()
        if self._local == 0:
            self._window_began = time.monotonic()
        self._local += 1
        # This step's end asks for the sync's quorum (TorchFT's algorithm,
        # in the optimizer's hook): the manager's start_quorum then learns
        # the groups' word on the window in it (_WindowManager).
        self._in_sync = self._local == self._quorum_at

    def _sync_quorum(self, start: Callable[..., None]) -> None:
        """The sync's quorum, asked for by TorchFT's algorithm (``start``:
        the manager's own ``start_quorum``), and in it, before the
        algorithm's all-reduce, the groups' word on the window (one
        all-reduce: which of them trained it). Where some group in it is in
        its setup (it joined as the others synced), the others ask again,
        without it. A group's first sync after it joined waits for the
        others' sync, up to a window of theirs: ``quorum_timeout`` and three
        times its own first window's time."""
        self._in_sync = self._check_in = False
        wait = self.quorum_timeout
        if self._window_basis is None:
            wait += 3 * (time.monotonic() - self._window_began)
        while True:
            self._healed = False
            try:
                start(timeout=timedelta(seconds=wait))
            finally:
                self._step_open, self._quorum_seen = True, False
                try:
                    self.wait_quorum()  # NoQuorumError where none came; the job's end
                finally:
                    self._step_open = False
            self._told = self._sync_members()
            self._sync_step = int(self.manager.current_step())  # a group that healed: its peers' step
            if not self._mixed:
                self._check_in = self._quorum_at < self.steps_per_sync
                return

    def _checked_in(self) -> None:
        """Before a delayed sync's commit (``fragment_sync_delay``): every
        group of its quorum says it trained the window to its end, in one
        all-reduce (a group lost in the delay fails it, and with it the
        sync, as a group lost in the fragment's all-reduce would: each
        group's window goes back, and its samples are dealt again). Without
        it a sync whose all-reduce ended before a group was lost would be
        committed, and the loader would take that group's steps of the
        delay, which it never trained."""
        self._check_in = False
        manager = self.manager
        here = torch.ones(1, dtype=torch.int64)
        manager.allreduce(here, reduce_op=dist.ReduceOp.SUM).wait()
        if not manager.errored() and int(here) != int(manager.num_participants()):
            manager.report_error(
                RuntimeError(
                    f"step {self.current_step}: {int(here)} of the sync's {manager.num_participants()} "
                    "groups checked in at its commit; not committed"
                )
            )

    def _manager_type(self) -> Any:
        return _window_manager()

    def _make_manager(self) -> Any:
        manager = super()._make_manager()
        manager.phalanx_strategy = self
        return manager

    def _after_step(self, before: int) -> None:
        """After a training step: at a window's end, its verdict (TorchFT's
        algorithm stepped the manager where the sync was committed)."""
        self._in_sync = False
        if self._local < self.steps_per_sync:
            return
        committed = int(self.manager.current_step()) > max(before, self._sync_step)
        members, trained = self._told if committed else (0, frozenset())
        basis = self._window_basis
        self.committed = committed
        self.contributed = bool(committed and not self._healed and basis is not None and basis[2] in trained)
        self._local = 0
        if committed:
            self._window_start = _copies(self._module)
            if not self._told_committed:
                self._told_committed = True
                _create(os.environ.get(COMMITTED_FILE_VAR))
        elif self.keeps_failed_windows:
            # Each group keeps what it trained, and the next sync averages
            # it in: the window's samples are settled with the next one's,
            # both dealt by the same groups.
            return
        self._window_basis = self._quorum_basis()
        for loader in self._loaders:
            loader.settle(committed, members, trained)

    def deal_basis(self) -> tuple[int, int]:
        """The members a window's batches are dealt to, and this group's
        index among them: the quorum of the sync that started the window
        (one member, before this group has seen one: its batches are then
        not trained, and given back)."""
        basis = self._window_basis or (-1, 1, 0)
        return basis[1], basis[2]

    # -- checkpoints ----------------------------------------------------------------

    def save_checkpoint(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, blocking: bool = True
    ) -> SaveHandle:
        """As ``ddp_ft``'s, at a sync only (:attr:`at_sync`: the model is
        the one the groups agreed on), with the window's algorithm's state
        (``"window"``: the outer optimizer's, under ``diloco_ft``)."""
        if not self.at_sync:
            raise MisconfigurationError(
                f"save_checkpoint() under {self.name!r} at step {self.current_step}, {self._local} steps "
                f"into a window of {self.steps_per_sync}: each group's model is its own until the "
                "window's sync. Save where strategy.at_sync is true (every sync_every steps)"
            )
        return super().save_checkpoint(path, {**state, "window": self._window_state()}, blocking=blocking)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        if self._algorithm is not None:
            raise MisconfigurationError(
                f"load_checkpoint() under {self.name!r} after the first training step: TorchFT's "
                f"algorithm holds the window's starting model from there on. Load (or resume) before "
                "training"
            )
        loaded = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        window = loaded.pop("window", None)
        if window is not None:
            self._load_window_state(window)
        if self._module is not None:
            self._window_start = _copies(self._module)
        return loaded

    def _torchft_state(self) -> dict[str, Any]:
        # As ddp_ft counts: a step of TorchFT's for each training step (and
        # each setup), so that the checkpoint goes on under ddp_ft too.
        return {**self.manager.state_dict(), "step": self.current_step + self._setups}

    def _manager_state(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        steps = int(saved["step"]) - self._setups
        if steps % self.steps_per_sync:
            raise MisconfigurationError(
                f"the checkpoint was saved at step {steps}, inside a window of {self.steps_per_sync} steps "
                f"of {self.name!r}: resume it under a strategy whose syncs fall on that step (a "
                "sync_every that divides it), or under ddp_ft"
            )
        return {**saved, "step": steps // self.steps_per_sync + self._setups}

    def _window_state(self) -> dict[str, Any]:
        return {}

    def _load_window_state(self, state: Mapping[str, Any]) -> None:
        return None

    def teardown(self) -> None:
        algorithm, self._algorithm = self._algorithm, None
        if algorithm is not None:
            algorithm.__exit__(None, None, None)
        super().teardown()


class LocalSGDFTStrategy(Windowed, DDPStrategy):
    """Local SGD across replica groups (TorchFT's ``LocalSGD``,
    :class:`Windowed`): each group takes ``sync_every`` steps of its own
    optimizer, then the groups' parameters are averaged. A sync that is not
    committed leaves each group its own parameters.

    Options: :class:`Windowed`'s (``sync_every``, default 16) and DDP's."""

    name: ClassVar[str] = "local_sgd_ft"
    keeps_failed_windows: ClassVar[bool] = True
    traffic: ClassVar[frozenset[str]] = frozenset({"all_gather", "broadcast", "all_reduce"})

    def __init__(self, *, sync_every: int = 16, **options: Any) -> None:
        super().__init__(sync_every=sync_every, **options)

    def _make_algorithm(self, module: Any, optimizer: Any) -> Any:
        from torchft.local_sgd import LocalSGD

        return LocalSGD(self.manager, module, optimizer, self.sync_every)


class DiLoCoWindows(Windowed):
    """DiLoCo across replica groups (TorchFT's ``DiLoCo``, :class:`Windowed`):
    each group takes ``sync_every`` steps of its own optimizer (the inner
    one, ``setup``'s), then the groups average their change over the
    window (the pseudo-gradient) and an outer optimizer steps the window's
    starting model with it. With ``fragments`` the model is synced in
    parts, one every ``sync_every / fragments`` steps (Streaming DiLoCo).
    Within a group: DDP (``diloco_ft``) or FSDP (``diloco_hsdp_ft``).

    Options, with :class:`Windowed`'s (``sync_every``, default 500, the
    DiLoCo paper's ``H``):

    - ``outer_lr``, ``outer_momentum``: the outer optimizer, SGD with
      Nesterov momentum (the paper's: 0.7 and 0.9).
    - ``outer_optimizer``: instead, a callable that makes the outer
      optimizer from an iterable of parameters (Python only).
    - ``fragments``: parts the model is synced in, each a run of the
      module's top-level children (default 1).
    - ``fragment_sync_delay``: steps a fragment's all-reduce overlaps with
      training before its sync waits for it (default 0). The fragment's
      change is taken as of the delay's start; the window's samples are
      settled at the sync, the delay's steps with them, and the groups
      check in once more before the commit (a group lost in the delay
      fails the sync, as one lost in its all-reduce does).
    - ``fragment_update_alpha``: how much of a fragment's own steps in the
      delay is kept at its sync (0: none, TorchFT's default; the other
      fragments keep those steps whole).
    """

    def __init__(
        self,
        *,
        sync_every: int = 500,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        outer_optimizer: Callable[..., Any] | None = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(sync_every=sync_every, **options)
        if outer_optimizer is not None and (outer_lr is not None or outer_momentum is not None):
            raise MisconfigurationError(
                f"strategy {self.name!r}: outer_optimizer is given with outer_lr or outer_momentum, which "
                "set the default outer optimizer's: give the one or the others"
            )
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise MisconfigurationError(
                f"strategy {self.name!r}: outer_optimizer={outer_optimizer!r}; expected a callable that "
                "makes an optimizer from parameters, e.g. functools.partial(torch.optim.SGD, lr=0.7, "
                "momentum=0.9, nesterov=True)"
            )
        for option, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
            ):
                raise MisconfigurationError(
                    f"strategy {self.name!r}: {option}={value!r}; expected a number >= 0"
                )
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
            raise MisconfigurationError(
                f"strategy {self.name!r}: fragments={fragments!r}; expected the number of parts the model "
                "is synced in, an int of at least 1"
            )
        if sync_every % fragments:
            raise MisconfigurationError(
                f"strategy {self.name!r}: sync_every={sync_every} is not a multiple of "
                f"fragments={fragments}: a fragment is synced every sync_every / fragments steps"
            )
        per_fragment = sync_every // fragments
        if (
            isinstance(fragment_sync_delay, bool)
            or not isinstance(fragment_sync_delay, int)
            or not 0 <= fragment_sync_delay < per_fragment
        ):
            raise MisconfigurationError(
                f"strategy {self.name!r}: fragment_sync_delay={fragment_sync_delay!r}; expected an int "
                f"from 0 to {per_fragment - 1} (a fragment is synced every {per_fragment} steps, and its "
                "all-reduce must end before its next one starts)"
            )
        if (
            isinstance(fragment_update_alpha, bool)
            or not isinstance(fragment_update_alpha, (int, float))
            or not (0 <= fragment_update_alpha <= 1)
        ):
            raise MisconfigurationError(
                f"strategy {self.name!r}: fragment_update_alpha={fragment_update_alpha!r}; expected a number "
                "from 0 to 1"
            )
        momentum = 0.9 if outer_momentum is None else float(outer_momentum)
        self.outer_optimizer = outer_optimizer or functools.partial(
            torch.optim.SGD,
            lr=0.7 if outer_lr is None else float(outer_lr),
            momentum=momentum,
            nesterov=momentum > 0,  # torch's SGD takes Nesterov only with momentum
        )
        try:  # a factory that cannot make an optimizer: said here, not in every rank
            self.outer_optimizer([torch.zeros(1, requires_grad=True)])
        except Exception as exc:  # noqa: BLE001 - whatever the factory raises
            raise MisconfigurationError(
                f"strategy {self.name!r}: the outer optimizer could not be made "
                f"({type(exc).__name__}: {exc}); outer_optimizer must make an optimizer from an "
                "iterable of parameters"
            ) from None
        self.fragments = fragments
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = float(fragment_update_alpha)
        self._outer: list[Any] = []  # an outer optimizer per fragment
        self._parts: list[Any] = []

    @property
    def steps_per_sync(self) -> int:
        return self.sync_every // self.fragments

    @property
    def _quorum_at(self) -> int:
        return self.steps_per_sync - self.fragment_sync_delay

    def _heal_with(self, module: Any, optimizers: tuple[Any, ...]) -> None:
        self._parts = _fragments(module, self.fragments, self.name)
        self._outer = [self.outer_optimizer(part.parameters()) for part in self._parts]
        super()._heal_with(module, optimizers)

    def _make_algorithm(self, module: Any, optimizer: Any) -> Any:
        from torchft.local_sgd import DiLoCo

        return DiLoCo(
            self.manager,
            self._parts,
            optimizer,
            self._outer,
            sync_every=self.sync_every,
            fragment_sync_delay=self.fragment_sync_delay,
            fragment_update_alpha=self.fragment_update_alpha,
        )

    def _window_state(self) -> dict[str, Any]:
        # Whole tensors (FSDP's shards gathered within the group): a
        # checkpoint loads under any strategy and number of ranks.
        return {"outer": [_whole(o.state_dict()) for o in self._outer]}

    def _load_window_state(self, state: Mapping[str, Any]) -> None:
        outer = state.get("outer", [])
        if len(outer) != len(self._outer):
            raise MisconfigurationError(
                f"the checkpoint holds {len(outer)} outer optimizer(s) and this {self.name} job has "
                f"fragments={self.fragments}: resume with the fragments it was saved with"
            )
        for optimizer, saved in zip(self._outer, outer, strict=True):
            optimizer.load_state_dict(_laid_out_as(saved, optimizer))


class DiLoCoFTStrategy(DiLoCoWindows, DDPStrategy):
    """``diloco_ft``: DiLoCo across replica groups (:class:`DiLoCoWindows`),
    DDP within each."""

    name: ClassVar[str] = "diloco_ft"
    traffic: ClassVar[frozenset[str]] = frozenset({"all_gather", "broadcast", "all_reduce"})


class DiLoCoHSDPFTStrategy(DiLoCoWindows, FSDPStrategy):
    """``diloco_hsdp_ft``: DiLoCo across replica groups (:class:`DiLoCoWindows`),
    FSDP (torch's ``fully_shard``) within each: a group's ranks hold shards
    of the model and of both optimizers' state, and at a sync rank r of
    every group averages the pseudo-gradient of shard r (TorchFT's DiLoCo
    works on the shards). As under ``fsdp``, ``setup`` takes the inner
    optimizer's factory (``functools.partial(torch.optim.AdamW, lr=1e-3)``);
    FSDP's options (``shard_modules``, ``mp_policy``, ``state_dict_type``,
    ...) are this strategy's too. Checkpoints (at a sync) are written by the
    group that leads the sync's quorum, as under ``hsdp_ft``."""

    name: ClassVar[str] = "diloco_hsdp_ft"
    traffic: ClassVar[frozenset[str]] = frozenset({"all_gather", "reduce_scatter", "all_reduce", "broadcast"})

    def save_checkpoint(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, blocking: bool = True
    ) -> SaveHandle:
        if self.at_sync and not self._leads():
            return SaveHandle.finished(path)  # the leading group writes (its shards or its whole state)
        return super().save_checkpoint(path, state, blocking=blocking)


class _WindowOptimizer:
    """The optimizer ``setup`` returns under a windowed strategy: each
    ``step()`` is the inner optimizer's (TorchFT's algorithm syncs the
    groups after the window's last); everything else is the wrapped
    optimizer's (``optim``)."""

    def __init__(self, strategy: Windowed, optim: Any) -> None:
        self.optim = optim
        self._strategy = strategy

    def step(self, closure: Any = None) -> Any:
        strategy = self._strategy
        strategy._before_step()
        before = int(strategy.manager.current_step())
        result = self.optim.step() if closure is None else self.optim.step(closure)
        strategy._after_step(before)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.optim.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optim, name)


@functools.cache
def _window_manager() -> Any:
    """TorchFT's ``Manager`` whose ``start_quorum``, where TorchFT's
    algorithm asks for a sync's quorum, goes through the strategy
    (:meth:`Windowed._sync_quorum`)."""
    from torchft import Manager

    class _WindowManager(Manager):  # type: ignore[misc]
        phalanx_strategy: Windowed | None = None

        def start_quorum(self, *args: Any, **kwargs: Any) -> None:
            strategy = self.phalanx_strategy
            if strategy is None or not strategy._in_sync:
                return super().start_quorum(*args, **kwargs)
            strategy._sync_quorum(functools.partial(super().start_quorum, *args, **kwargs))
            return None

        def should_commit(self, *args: Any, **kwargs: Any) -> bool:
            strategy = self.phalanx_strategy
            if strategy is not None and strategy._check_in:
                strategy._checked_in()
            return bool(super().should_commit(*args, **kwargs))

    return _WindowManager


#: Seconds between two quorums of groups that wait at their setup for the others.
_START_POLL = 0.25


def _local(tensor: Any) -> Any:
    """This rank's shard of a DTensor (FSDP's parameters); else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copies(module: Any) -> list[Any]:
    """The module's parameters (this rank's shards), copied to the CPU."""
    return [_local(p.detach()).to("cpu", copy=True) for p in module.parameters()]


def _load_into(module: Any, tensors: list[Any]) -> None:
    with torch.no_grad():
        for parameter, tensor in zip(module.parameters(), tensors, strict=True):
            _local(parameter).copy_(tensor)


def _whole(state: Any) -> Any:
    """``state`` with each DTensor in it gathered whole (a collective of the
    group's ranks)."""
    return _each_dtensor(state, lambda tensor: tensor.full_tensor())


def _laid_out_as(saved: Mapping[str, Any], optimizer: Any) -> dict[str, Any]:
    """An optimizer's saved state of whole tensors (:func:`_whole`) as the
    optimizer holds it: each state tensor of a sharded parameter's shape
    (SGD's momentum, Adam's moments) split as the parameter is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    parameters = [p for group in optimizer.param_groups for p in group["params"]]

    def like(value: Any, parameter: Any) -> Any:
        if not isinstance(parameter, DTensor) or not isinstance(value, torch.Tensor):
            return value
        if tuple(value.shape) != tuple(parameter.shape):
            return value
        # Each rank takes its own part of the whole tensor it read (no collective).
        return distribute_tensor(
            value.to(parameter.device), parameter.device_mesh, parameter.placements, src_data_rank=None
        )

    state = {
        index: {name: like(value, parameters[int(index)]) for name, value in values.items()}
        for index, values in saved.get("state", {}).items()
    }
    return {**saved, "state": state}


def _fragments(module: Any, count: int, name: str) -> list[Any]:
    """``module``'s top-level children in ``count`` runs of about the same
    number of parameters, each an ``nn.ModuleList`` (TorchFT's DiLoCo
    syncs a fragment's parameters at a time)."""
    from torch import nn

    if count == 1:
        return [module]
    children = [child for child in module.children() if any(True for _ in child.parameters())]
    own = [p for _, p in module.named_parameters(recurse=False)]
    if own:
        raise MisconfigurationError(
            f"strategy {name!r}: fragments={count}: the module has parameters of its own "
            f"({len(own)}), outside its children; fragments are runs of its children. Put them in a "
            "child module, or leave fragments at 1"
        )
    if len(children) < count:
        raise MisconfigurationError(
            f"strategy {name!r}: fragments={count}, and the module has {len(children)} top-level "
            "children with parameters to split into them: lower fragments"
        )
    sizes = [sum(p.numel() for p in child.parameters()) for child in children]
    total, parts, run, filled = sum(sizes), [], [], 0
    for index, (child, size) in enumerate(zip(children, sizes, strict=True)):
        run.append(child)
        filled += size
        left_children, left_parts = len(children) - index - 1, count - len(parts) - 1
        if left_parts and (filled >= total * (len(parts) + 1) / count or left_children == left_parts):
            parts.append(nn.ModuleList(run))
            run = []
    parts.append(nn.ModuleList(run))
    return parts
