"""``ddp_ft`` (DDP across TorchFT replica groups) and what every strategy
of this plugin shares (:class:`FaultTolerant`)."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from phalanx_core import CheckpointDirectory, Collective, MisconfigurationError, SaveHandle
from phalanx_core.launching import before_threads_join
from phalanx_torch.strategies import DDPStrategy

from ._across import across_groups
from ._loader import QuorumLoader
from ._seams import StepOwner, StepSettled
from ._variables import (
    COMMITTED_FILE_VAR,
    FINISHED_FILE_VAR,
    GROUP_ADDRESS_VAR,
    LIGHTHOUSE_VAR,
    min_replicas,
    replica_group_of_this_process,
)
from .errors import JobFinishedError, NoQuorumError

__all__ = ["DDPFTStrategy", "FaultTolerant"]


class FaultTolerant:
    """What ``ddp_ft`` and ``hsdp_ft`` share, on TorchFT (``torchft``):
    replica groups that come and go while the job trains. A group that is
    lost is dropped at the next step and the others train on without a
    restart; a group that comes back copies the state from a healthy peer
    (no checkpoint is read) and joins at the step after.

    A replica group is ``devices`` ranks (``--devices``) that hold one copy
    of the model; ``phalanx run --strategy ddp_ft --replica-groups N``
    (launcher ``replica_groups``) starts N of them and TorchFT's
    lighthouse, and restarts a group that fails. Within a group the ranks
    are an ordinary job of the strategy it is mixed into (DDP, FSDP) over
    the strategy's collective; across groups each step's gradients are
    averaged over the groups in that step's quorum, through TorchFT's
    ``Manager``, by a second collective of the same kind and options
    (``across``, made by the registry) that forms a group of the quorum's
    members at each new quorum (its ``reconfigure``): the collective a user
    names carries the traffic between the groups too.

    The training loop is every strategy's: ``setup``, ``backward``,
    ``optimizer_step``. Each step is agreed on: the optimizer steps only
    where TorchFT's manager commits the step (every group in the quorum had
    its gradients averaged); otherwise the step's gradients are dropped, on
    every group alike, and :attr:`committed` is ``False``. The optimizer's
    ``zero_grad()`` (or, where the loop calls none before it, the first
    ``backward``) asks the lighthouse for the next step's quorum.

    Options (keywords of :func:`phalanx.resolve`, ``-o NAME=VALUE``), with
    the inner strategy's own:

    - ``across``: the collective between the groups (given by the
      registry: another of the one named with ``collective=``; by hand,
      a collective never set up that declares ``liveness`` and
      ``reconfigure``).
    - ``replica_timeout``: seconds a collective across groups or a healing
      transfer may take (default 10; a step's commit waits twice as long
      for the ranks of its group); also how long a survivor can stall on a
      peer that hangs without dying (a host cut off the network). A peer
      that dies (its sockets close) is noticed at once.
    - ``quorum_timeout``: seconds a training step waits for its quorum
      (default 10): where the lighthouse is lost or cut off, or fewer than
      ``min_replicas`` groups are alive, each group's ranks stop with
      :class:`~phalanx_torchft.NoQuorumError` after this long (and the
      launcher starts the group again). A group's first start waits longer
      for the lighthouse and for its first quorum, 60 s (or
      ``quorum_timeout`` if longer): the hosts of a job need not start at
      once.
    """

    #: The strategy's name, for messages.
    name: ClassVar[str] = "ddp_ft"

    #: Whether a step computes while its quorum forms (its batch dealt by
    #: the last quorum's members), as TorchFT's own loop does.
    compute_during_quorum: ClassVar[bool] = True
    #: TorchFT's quorum in a thread of its own, the step computing while it
    #: forms (``use_async_quorum``); a group that heals takes its peers'
    #: state at the step's commit.
    async_quorum: ClassVar[bool] = True

    def __init__(
        self,
        *,
        replica_timeout: float = 10.0,
        quorum_timeout: float = 10.0,
        across: Collective | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if across is None:  # built by hand: another of the strategy's collective
            across = copy.deepcopy(self.collective)
        missing = sorted({"liveness", "reconfigure"} - set(across.fault_tolerance))
        if missing or across.is_initialized:
            raise MisconfigurationError(
                f"strategy {self.name!r}: across={across!r} carries the traffic between replica groups, "
                "formed again at each quorum: give a collective that was never set up and declares "
                f"liveness and reconfigure (it lacks {', '.join(missing) or 'nothing, but is set up'}), "
                "e.g. TorchCollective()"
            )
        across.check_accelerator(self.accelerator)  # nccl between CPU groups: refused here
        #: The collective that carries the traffic between the replica
        #: groups: the same kind as :attr:`collective`, reconfigured at
        #: each quorum (see :mod:`._across`).
        self.across = across
        for name, value in (("replica_timeout", replica_timeout), ("quorum_timeout", quorum_timeout)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise MisconfigurationError(
                    f"strategy {self.name!r}: {name}={value!r}; expected a number of seconds above 0"
                )
        self.replica_timeout = float(replica_timeout)
        self.quorum_timeout = float(quorum_timeout)
        self._manager: Any = None
        self._step_open = False  # a quorum was asked for and the step not yet committed
        self._verdict: bool | None = None  # should_commit()'s answer for the step
        self._quorum_seen = False  # the open step's quorum came (and the job's end was checked)
        self._registered = 0
        self._setups = 0  # setup() calls: each makes the groups alike in a step of its own
        self._loaders: list[StepSettled] = []
        # Quorums' members as (quorum id, members, this group's index):
        # as TorchFT last configured the groups' gloo group for one (its
        # quorum thread), as of the last quorum this process waited for,
        # and the one the step's batches were dealt by (QuorumLoader).
        self._configured: tuple[int, int, int] | None = None  # quorum_configured's
        self._seen_members: tuple[int, int, int] | None = None
        self._step_basis: tuple[int, int, int] | None = None
        self._mixed = False  # the last _trained_members saw groups in their setup beside others
        self._late = False  # and some group in its setup had waited for the others long enough
        #: Whether the last step was committed (``None`` before the first).
        self.committed: bool | None = None
        self._told_committed = False  # the launcher's file made (COMMITTED_FILE_VAR)

    # -- where this rank is -------------------------------------------------

    @property
    def replica_group(self) -> int:
        """This rank's replica group: 0 .. :attr:`replica_groups` - 1."""
        return replica_group_of_this_process("strategy.replica_group")[0]

    @property
    def replica_groups(self) -> int:
        """How many replica groups the job was started with (those in a
        step's quorum: :attr:`participants`)."""
        return replica_group_of_this_process("strategy.replica_groups")[1]

    @property
    def manager(self) -> Any:
        """TorchFT's ``Manager`` of this rank (made by ``strategy.launch()``),
        for what phalanx does not wrap."""
        if self._manager is None:
            raise MisconfigurationError(
                f"strategy {self.name!r}: strategy.manager is made by strategy.launch(); call it first"
            )
        return self._manager

    @property
    def participants(self) -> int:
        """How many replica groups take part in the current step (its
        quorum's members that are not healing); the gradients are averaged
        over them."""
        self.wait_quorum()
        return int(self.manager.num_participants())

    @property
    def participating(self) -> bool:
        """Whether this group's gradients are part of the current step
        (``False`` in a step where the group heals: TorchFT zeroes them)."""
        self.wait_quorum()
        return bool(self.manager.is_participating())

    def quorum_configured(self, quorum_id: int, members: int, rank: int) -> None:
        """The group across the replica groups was formed for quorum
        ``quorum_id`` of ``members`` groups, this one's rank ``rank``
        among them (:class:`~phalanx_torchft._seams.QuorumSide`)."""
        self._configured = (quorum_id, members, rank)

    def wait_quorum(self) -> None:
        """Wait for the quorum of the step in hand, if one is asked for.
        TorchFT raises its lighthouse client's error where none came (a
        Rust ``TimeoutError`` after ``quorum_timeout``, a refused
        connection); its all-reduce swallows it, and every later step
        waits for it again and fails: here it is one named error, which
        ends the group's ranks (the launcher starts the group again)."""
        if not self._step_open:
            return
        try:
            self.manager.wait_quorum()
        except Exception as exc:  # noqa: BLE001 - the quorum's error, of TorchFT's Rust client or not
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
            group, _ = replica_group_of_this_process(f"strategy {self.name!r}")
            raise NoQuorumError(
                f"replica group {group}: no quorum for step {self.current_step} from TorchFT's "
                f"lighthouse at {os.environ.get(LIGHTHOUSE_VAR)} in time ({type(exc).__name__}: "
                f"{text}). The lighthouse is lost or this host cannot reach it (on several hosts it "
                "lives in node 0's phalanx run, or where --lighthouse points), or fewer than "
                f"min_replicas={min_replicas()} groups are alive. This group stops; phalanx run "
                "starts it again (--max-restarts), and it heals from a peer once a quorum forms. "
                f"quorum_timeout={self.quorum_timeout:g} s is how long a step waits"
            ) from None
        if self._quorum_seen:
            return
        self._quorum_seen = True
        self._seen_members = self._configured
        # Checked once a step, as its quorum comes: a group in step with
        # the one that finished got its last quorum before that one ended.
        finished = os.environ.get(FINISHED_FILE_VAR)
        if finished and os.path.exists(finished):
            group, _ = replica_group_of_this_process(f"strategy {self.name!r}")
            raise JobFinishedError(
                f"replica group {group}: the job has finished (replica group "
                f"{Path(finished).read_text().strip()} ended its script) while this group still asks "
                f"for quorums, at step {self.current_step}: it stops here rather than train on alone, "
                "with no peer to heal from, and is not started again"
            )

    @property
    def current_step(self) -> int:
        """The job's count of committed training steps, the same on every
        group (a healed group takes its peers'). TorchFT's own count
        (``manager.current_step()``, saved in checkpoints) is one more for
        each ``setup`` call, whose step makes the groups alike (every group
        runs the script's setups, a group that joins late too)."""
        return max(int(self.manager.current_step()) - self._setups, 0)

    # -- setting up ------------------------------------------------------------

    def setup_environment(self) -> None:
        super().setup_environment()
        self._manager = self._make_manager()
        # TorchFT's threads (its checkpoint server, its quorum executor) end
        # only when the manager shuts down: a script that ends without a
        # teardown would wait for them forever.
        before_threads_join(self._shut_manager_down)

    def _shut_manager_down(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown(wait=False)

    def _make_manager(self) -> Any:
        from torchft.checkpointing.pg_transport import PGTransport

        group, _ = replica_group_of_this_process(f"strategy {self.name!r}")
        lighthouse = os.environ.get(LIGHTHOUSE_VAR)
        if not lighthouse:
            raise MisconfigurationError(
                f"strategy {self.name!r}: no lighthouse ({LIGHTHOUSE_VAR} is not set); start the job "
                "with phalanx run --strategy ddp_ft --replica-groups N, which starts one, or set "
                f"{LIGHTHOUSE_VAR} to a running lighthouse's URL"
            )
        seconds = timedelta(seconds=self.replica_timeout)
        environment = self.environment
        _quieten_torchft()
        across = across_groups(self, self.across, seconds)
        options = dict(
            pg=across,
            # A healing group receives its peers' state over the groups'
            # own gloo group, not TorchFT's default HTTP server: that one
            # listens on every interface, logs each request to stderr and
            # reads the state when the peer asks, after this group may
            # have stepped.
            checkpoint_transport=PGTransport(across, timeout=seconds, device=torch.device("cpu")),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=min_replicas(),
            timeout=seconds,
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=timedelta(seconds=self._start_wait),
            rank=self.global_rank,
            world_size=self.world_size,
            store_addr=environment.main_address,
            store_port=environment.main_port,
            lighthouse_addr=lighthouse,
            # TorchFT numbers a group's ranks across groups by the digits
            # its replica id ends with.
            replica_id=f"phalanx_group_{group}",
            hostname=os.environ.get(GROUP_ADDRESS_VAR) or _address_toward(lighthouse),
            init_sync=False,  # the groups are made alike in a step of their own: _start_alike
            use_async_quorum=self.async_quorum,
        )
        try:
            return self._manager_type()(**options)
        except RuntimeError as exc:  # the Rust client's: the lighthouse did not answer
            if "connect" not in str(exc):
                raise
            raise NoQuorumError(
                f"replica group {group}: TorchFT's lighthouse at {lighthouse} did not answer within "
                f"{self._start_wait:g} s ({str(exc).strip().splitlines()[0]}). It is lost, not started "
                "yet, or this host cannot reach it (on several hosts it lives in node 0's phalanx "
                "run, or where --lighthouse points)"
            ) from None

    def _manager_type(self) -> Any:
        """The class of TorchFT's manager this strategy makes (TorchFT's own)."""
        from torchft import Manager

        return Manager

    def setup(self, module: Any, *optimizers: Any) -> Any:
        ready = super().setup(module, *optimizers)
        made = ready[1:] if isinstance(ready, tuple) else ()
        self._heal_with(self.unwrap_module(ready[0] if isinstance(ready, tuple) else ready), made)
        return ready

    def setup_optimizer(self, optimizer: Any) -> Any:
        return _StepOptimizer(self, optimizer)

    def _heal_with(self, module: Any, optimizers: tuple[Any, ...]) -> None:
        """What a healing group copies from a peer: the module's and the
        optimizers' state, registered with the manager."""
        inner = [getattr(o, "optim", o) for o in optimizers]

        def state_dict() -> dict[str, Any]:
            # Read in the quorum and sent there (PGTransport, see
            # _make_manager), before this step's update: should_commit, and
            # so the optimizer, waits for the quorum. (TorchFT's HTTP
            # transport served these tensors later, when a healing peer
            # asked: after this group may have stepped them.)
            # Sharded tensors (FSDP's DTensors) go as this rank's shards:
            # rank r of every group holds shard r.
            return {
                "module": _shards(module.state_dict()),
                "optimizers": [_shards(o.state_dict()) for o in inner],
            }

        def load_state_dict(state: dict[str, Any]) -> None:
            module.load_state_dict(_module_state_like(state["module"], module.state_dict()))
            for optimizer, saved in zip(inner, state["optimizers"], strict=True):
                optimizer.load_state_dict(_optimizer_state_like(saved, optimizer))

        self.manager.register_state_dict_fn(f"phalanx_{self._registered}", load_state_dict, state_dict)
        self._registered += 1
        self._start_alike(module)

    def _start_alike(self, module: Any) -> None:
        """Give every group the module state of one, in a step of its own
        (one of TorchFT's count, not of :attr:`current_step`): the groups may have
        initialised their modules unlike (each is seeded its own way), and
        from here on they must be alike. The group that leads the quorum
        (participating rank 0) sends, rank by rank (rank r of each group
        holds the same part of the module: all of it under DDP, shard r
        under FSDP), by an all-reduce in which the others add zeros; a group
        that does not commit this step copies a peer's state at the next
        one, as TorchFT heals. A group that joins a job past its start does
        nothing here: it heals in its first step.

        (TorchFT's own answer, ``init_sync``, has every group but one copy
        that one's state in the first training step; but it picks the group
        to copy from for each rank apart, so the ranks of a group of two
        went on from two different models, seen here.)"""
        from torch.distributed.tensor import DTensor

        manager = self.manager
        self._setups += 1
        while True:
            self.open_step(timeout=self._start_wait)
            self.wait_quorum()
            if manager.current_step() > 0:
                return  # the step this quorum opened is this group's first; it heals in it
            tensors = [
                t.to_local() if isinstance(t, DTensor) else t
                for t in module.state_dict().values()
                if t.dtype != torch.bool
            ]
            leads = manager.participating_rank() == 0
            # As bytes: the sum of the leader's bytes and zeros is the
            # leader's state exactly, whatever the collective across the
            # groups does to floating-point values (compressed rounds them).
            sent = [
                t.detach().reshape(-1).clone().view(torch.uint8)
                if leads
                else torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)
                for t in tensors
            ]
            for tensor in sent:
                manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()
            committed = manager.should_commit(timeout=self._commit_wait)
            self._step_open = False
            if committed:
                with torch.no_grad():
                    for tensor, alike in zip(tensors, sent, strict=True):
                        tensor.copy_(alike.view(tensor.dtype).view(tensor.shape))
                return
            if manager.current_step() > 0:
                return  # a peer committed it: this group copies its state at the next step

    def setup_dataloader(
        self, dataloader: Any, *, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """A loader that deals each step's samples out over the groups in
        that step's quorum (:class:`~phalanx_torchft.QuorumLoader`): the
        samples of a step that is dropped are dealt again over the groups
        that are left, and a group that heals starts where the job is.
        Each sample of an epoch is in exactly one committed step (see the
        class for the epoch's end). With ``use_distributed_sampler=False``
        the loader is as given, split by you (its batches moved to the
        device where asked)."""
        if not use_distributed_sampler:
            return super().setup_dataloader(  # type: ignore[misc]
                dataloader, use_distributed_sampler=False, move_to_device=move_to_device
            )
        loader = QuorumLoader(self, dataloader, move=move_to_device)
        self.manager.register_state_dict_fn(
            f"phalanx_loader_{len(self._loaders)}", loader.heal, loader.state_dict
        )
        self._loaders.append(loader)
        return loader

    # -- checkpoints -------------------------------------------------------------

    def _leads(self) -> bool:
        """Whether this group leads the step's quorum (TorchFT's
        participating rank 0; group 0 before the first quorum): the group
        that writes checkpoints."""
        manager = self._manager
        leader = manager.participating_rank() if manager is not None else None
        if leader is None and (manager is None or manager.current_step() == 0):
            return self.replica_group == 0
        return bool(leader == 0)

    @property
    def is_global_zero(self) -> bool:
        """Rank 0 of the group that leads the step's quorum: the one
        process of the job that writes a checkpoint and prints with
        :meth:`print`."""
        return self.global_rank == 0 and self._leads()

    def save_checkpoint(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, blocking: bool = True
    ) -> SaveHandle:
        """As every strategy's, with TorchFT's own state (its step count)
        under ``"torchft"``. One group writes, the one that leads the step's
        quorum (the groups in it hold the same state); every rank of every
        group calls it at the same step. Call it after ``optimizer_step``,
        where the step's quorum is known."""
        with_torchft = {**state, "torchft": self._torchft_state()}
        return super().save_checkpoint(path, with_torchft, blocking=blocking)

    def _torchft_state(self) -> dict[str, Any]:
        """TorchFT's state as a checkpoint holds it: its manager's (a
        step of its count per training step, and one per ``setup``)."""
        return dict(self.manager.state_dict())

    def _manager_state(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """A checkpoint's TorchFT state as this strategy's manager counts."""
        return dict(saved)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        """As every strategy's; TorchFT's state in it (``"torchft"``, its
        step count) is loaded into the manager, so that the groups start at
        the step the checkpoint was saved at. A group that joins a job that
        is past the checkpoint keeps the job's step and copies its peers'
        state in its first step."""
        loaded = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        torchft_state = loaded.pop("torchft", None)
        if torchft_state is not None:
            torchft_state = self._manager_state(torchft_state)
        # Not behind the step the quorum gave: a group that joins a job past
        # the checkpoint copies its peers' state in this step, and keeps
        # their step.
        if torchft_state is not None and int(torchft_state["step"]) >= self.manager.current_step():
            self.manager.load_state_dict(torchft_state)
        return loaded

    def resume(
        self,
        checkpoints: CheckpointDirectory | str | os.PathLike[str],
        state: Mapping[str, Any],
        *,
        strict: bool = True,
        weights_only: bool = True,
    ) -> int:
        """As every strategy's, in each group: the group's rank 0 finds the
        newest complete checkpoint and the group's ranks load it."""
        directory = (
            checkpoints if isinstance(checkpoints, CheckpointDirectory) else CheckpointDirectory(checkpoints)
        )
        found = directory.latest_step() if self.global_rank == 0 else None
        if self.world_size > 1:
            found = self.broadcast_object(found, src=0)
        if found is None:
            return 0
        self.load_checkpoint(directory.path(found), state, strict=strict, weights_only=weights_only)
        return int(found)

    # -- a step ----------------------------------------------------------------

    @property
    def _start_wait(self) -> float:
        """Seconds a group waits for the lighthouse and its first quorum: a
        group's first start may come before the lighthouse's host has
        started (60 s); a restarted group found it before."""
        return max(self.quorum_timeout, 60.0) if self.restart_count == 0 else self.quorum_timeout

    @property
    def _commit_wait(self) -> timedelta:
        """How long a rank's commit waits for the other ranks of its group
        (TorchFT's ``should_commit`` is a barrier of the group): twice
        ``replica_timeout``. A rank whose all-reduce with a lost group's
        rank gives up only after ``replica_timeout`` comes to the commit
        that much after its group's other ranks, whose all-reduces
        completed; waiting only as long, they could give up first (a
        ``TimeoutError`` out of the step, the group restarted) instead of
        dropping the step with it, as a group of one rank does."""
        return timedelta(seconds=2 * self.replica_timeout)

    def open_step(self, timeout: float | None = None) -> None:
        """Ask for this step's quorum (once per step); wait for it here
        where the step may not compute while it forms."""
        if not self._step_open:
            self.manager.start_quorum(timeout=timedelta(seconds=timeout or self.quorum_timeout))
            self._step_open = True
            self._quorum_seen = False
            self._verdict = None
            if not self.compute_during_quorum:
                self.wait_quorum()

    def deal_basis(self) -> tuple[int, int]:
        """The members a step's batches are dealt to, and this group's
        index among them (:class:`QuorumLoader`): those of the last quorum
        this process waited for, so that the step computes while its own
        quorum forms; where the step's own quorum is in hand already (the
        first step's, waited for; every step's under ``hsdp_ft``), its
        participants, so that a group that heals in it is dealt nothing."""
        if self._step_basis is None:
            if self._seen_members is None:
                self.wait_quorum()
            seen = self._seen_members
            if self._quorum_seen or seen is None:
                manager = self.manager
                quorum_id = seen[0] if seen is not None else -1
                seen = (quorum_id, max(int(manager.num_participants()), 1), manager.participating_rank() or 0)
            self._step_basis = seen
        return self._step_basis[1], self._step_basis[2]

    def _trained_members(
        self, basis: tuple[int, int, int] | bool | None = True, at_setup: bool = False, late: bool = False
    ) -> tuple[int, frozenset[int]]:
        """Which of the members this step's batches were dealt to took
        part in it: one all-reduce across the step's groups, of each
        participant's index and a mark of the quorum it dealt by
        (``basis``: the step's own by default; ``None`` for a group whose
        batches are not trained, one that heals, which adds only that it
        is there; a group that heals under ``ddp_ft`` adds zeros). Where the
        participants dealt by different quorums the step cannot be told
        apart and is dropped on every group (each sees the same sums).
        ``at_setup``: this group is in ``setup``'s step (it counts as one
        that heals); :attr:`_mixed` says whether some groups were and others
        not. ``late``: this group has waited long enough for the others at
        its setup (:attr:`_late`: some group had)."""
        groups = self.replica_groups
        told = torch.zeros(groups + 6, dtype=torch.int64)
        dealt = self._step_basis if basis is True else basis
        if isinstance(dealt, tuple):
            quorum_id, members, member = dealt
            if member < groups:
                told[member] = 1
            mark = (quorum_id + 1) * _MEMBERS_MARK + members
            told[groups], told[groups + 3], told[groups + 4] = 1, mark, mark * mark
        else:
            told[groups + 1] = 1
        told[groups + 2] = int(at_setup)
        told[groups + 5] = int(late)
        manager = self.manager
        manager.allreduce(told, reduce_op=dist.ReduceOp.SUM).wait()
        if manager.errored():
            return 0, frozenset()  # the step is not committed
        counts = [int(n) for n in told[:groups]]
        dealers, healers, setups, total, squares, lates = (int(n) for n in told[groups:])
        self._mixed, self._late = 0 < setups < dealers + healers, lates > 0
        mark = total // max(dealers, 1)
        if (
            total * total != dealers * squares
            or dealers + healers != int(manager.num_participants())
            or max(counts, default=0) > 1
            or mark % _MEMBERS_MARK > groups
        ):
            manager.report_error(
                RuntimeError(
                    f"step {self.current_step}: the groups in it dealt its samples from different quorums; "
                    "dropped, and dealt again"
                )
            )
            return 0, frozenset()
        return mark % _MEMBERS_MARK, frozenset(i for i, n in enumerate(counts) if n)

    def commit_step(self) -> bool:
        """Whether this step is committed (asked once per step, for every
        optimizer)."""
        if self._verdict is None:
            self.open_step()
            self.wait_quorum()
            members, trained = self._trained_members() if self._loaders else (0, frozenset())
            self._verdict = bool(self.manager.should_commit(timeout=self._commit_wait))
            self.committed = self._verdict
            if self._verdict and not self._told_committed:
                self._told_committed = True
                _create(os.environ.get(COMMITTED_FILE_VAR))
            for loader in self._loaders:
                loader.settle(self._verdict, members, trained)
            self._step_open = False
            self._step_basis = None
        return self._verdict

    def backward(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        self.open_step()
        super().backward(tensor, *args, **kwargs)

    def teardown(self) -> None:
        with contextlib.suppress(Exception):  # what failed was said where it failed
            self._shut_manager_down()
        super().teardown()


class DDPFTStrategy(FaultTolerant, DDPStrategy):
    """Data parallel across replica groups (:class:`FaultTolerant`): DDP
    within a group, its buckets averaged across the step's groups by DDP's
    comm hook. Options: :class:`FaultTolerant`'s and DDP's
    (``find_unused_parameters`` is always on, ``static_graph`` refused:
    see ``__init__``)."""

    traffic: ClassVar[frozenset[str]] = frozenset({"all_gather", "broadcast", "all_reduce"})

    def __init__(self, **options: Any) -> None:
        if options.get("static_graph"):
            raise MisconfigurationError(
                "strategy 'ddp_ft': static_graph=True lets DDP reorder its gradient buckets after the "
                "first step, and a group that heals starts with the first order while its peers have "
                "the second: their all-reduce would add up other parameters' gradients. Leave "
                "static_graph out"
            )
        super().__init__(**options)
        # DDP reorders its buckets after the first step unless it looks for
        # unused parameters (the public way to keep the order; TorchFT's own
        # DDP does the same): a healed group's first step would otherwise
        # lay its buckets out unlike its peers', and the sum it gets back
        # would land on other parameters (seen: same gradient norms, other
        # weights). The cost: a walk of the autograd graph each backward,
        # and DDP's C++ warning, once per rank, that no parameter was unused.
        self._ddp_kwargs["find_unused_parameters"] = True

    def setup_module(self, module: Any) -> Any:
        ddp = super().setup_module(module)
        ddp.register_comm_hook(self, _average_over_groups)
        return ddp


def _create(path: str | None) -> None:
    """Create the file ``path`` (where one is given), as a mark."""
    if path:
        with contextlib.suppress(OSError):
            Path(path).touch()


def _quieten_torchft() -> None:
    """TorchFT's own lines that say nothing to a ``ddp_ft`` user: the NCCL
    flight recorder it cannot reset (the groups talk over gloo, which has
    none; said at every new quorum), torch's warnings on the bytes of a
    healing transfer (read-only; a pytree spec's deprecated class); and the
    tracebacks of its failed steps. A survivor's lost peer is one line: its
    message's first line (phalanx's error says what failed and where), not
    the traceback TorchFT logs with it, nor the Python stack (``At: ...``)
    or C++ frames a future's error carries in its message."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message="The given buffer is not writable", module=r"torchft\.")
    # torch 2.10+ on what TorchFT 0.2's PGTransport unpickles (a pytree spec).
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module=r"torchft\."
    )

    for name in _TORCHFT_LOGGERS:
        logger = logging.getLogger(name)
        if _one_line not in logger.filters:
            logger.addFilter(_one_line)


def _one_line(record: Any) -> bool:
    """A TorchFT log record as one line, or ``False`` for one that says
    nothing to a user (see :func:`_quieten_torchft`)."""
    text = record.getMessage()
    if "Unable to reset NCCL flight recorder" in text:
        return False
    record.msg, record.args = text.strip().split("\n", 1)[0].replace(_CALLBACK_WORDS, ""), ()
    record.exc_info = record.exc_text = record.stack_info = None
    return True


#: The loggers of TorchFT's that log a failed step's error (with its traceback).
_TORCHFT_LOGGERS = ("torchft.manager", "torchft.process_group", "torchft.checkpointing.pg_transport")
#: What torch puts before an error raised in a future's callback.
_CALLBACK_WORDS = "Got the following error when running the callback: "


def _shards(state: Any) -> Any:
    """``state`` with each DTensor in it replaced by this rank's shard
    (dicts, lists, tuples)."""
    return _each_dtensor(state, lambda tensor: tensor.to_local())


def _each_dtensor(state: Any, change: Any) -> Any:
    """``state`` with ``change`` made to each DTensor in it (dicts, lists,
    tuples)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return change(state)
    if isinstance(state, dict):
        return {key: _each_dtensor(value, change) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_each_dtensor(value, change) for value in state)
    return state


def _as_shard_of(local: Any, like: Any) -> Any:
    """``local`` as the shard of a DTensor laid out as ``like``, if ``like``
    is one; else ``local``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor) or not isinstance(local, torch.Tensor) or local.dim() == 0:
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def _module_state_like(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """A module state of shards (:func:`_shards`) as the module's own
    state holds them."""
    return {key: _as_shard_of(value, current.get(key)) for key, value in saved.items()}


def _optimizer_state_like(saved: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """An optimizer state of shards as the optimizer would hold them: each
    parameter's state tensors (``exp_avg``, ...) laid out as the parameter."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state = {
        index: {name: _as_shard_of(value, parameters[int(index)]) for name, value in values.items()}
        for index, values in saved["state"].items()
    }
    return {**saved, "state": state}


def _average_over_groups(strategy, bucket):  # type: ignore[no-untyped-def]
    """DDP's comm hook: the bucket averaged within the group (the strategy's
    group), then across the step's groups (TorchFT's manager, which drops a
    failed step instead of raising). Returns a completed future: TorchFT
    0.2's own DDP hook asserts on a failed all-reduce, which killed every
    survivor at the first loss. (No annotations: DDP refuses a hook whose
    annotations are not its own classes, and here they would be strings.)"""
    buffer = bucket.buffer()
    if strategy.world_size > 1:
        dist.all_reduce(buffer, group=strategy.process_group)
        buffer.div_(strategy.world_size)
    strategy.open_step()
    strategy.wait_quorum()  # where none comes, the named error (TorchFT's raises its client's)
    strategy.manager.allreduce(buffer).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


class _StepOptimizer:
    """The optimizer ``setup`` returns: ``zero_grad()`` asks for the next
    step's quorum, ``step()`` steps only where the step is committed.
    Everything else is the wrapped optimizer's (``optim``)."""

    def __init__(self, strategy: StepOwner, optim: Any) -> None:
        self.optim = optim
        self._strategy = strategy

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._strategy.open_step()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:
        if self._strategy.commit_step():
            return self.optim.step() if closure is None else self.optim.step(closure)
        return None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.optim.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optim, name)


#: ``_trained_members``' mark of a quorum: its id + 1 times this, plus its
#: members (fewer than this).
_MEMBERS_MARK = 4096


def _address_toward(url: str) -> str:
    """The address of this host that reaches the lighthouse at ``url``:
    where TorchFT's peers reach this group's manager."""
    import socket
    from urllib.parse import urlsplit

    from phalanx_core.network import route_source

    try:
        return route_source(urlsplit(url).hostname or "127.0.0.1")
    except OSError:
        return socket.gethostname()
