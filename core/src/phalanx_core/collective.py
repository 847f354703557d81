"""The Collective interface: how ranks talk.

One contract, written once here, that every implementation meets — over
torch.distributed, Horovod, XLA, MPI or a single process. Strategies only
forward to it; they never talk to a backend themselves.

The contract
============

**Ranks.** :attr:`~Collective.rank` and :attr:`~Collective.world_size` are
this collective's own: in a subgroup made by :meth:`~Collective.new_group`,
ranks are ``0 .. len(ranks) - 1`` in increasing order of the ranks they had
in the parent (as torch.distributed, Horovod process sets and
``MPI_Comm_split`` order them), whatever order they were given in, and
every ``src`` / ``dst`` argument is a rank *of that group*.
:attr:`~Collective.global_ranks` maps them back to the ranks of the world.

**Calls.** Every operation is collective: every rank of the group calls it,
in the same order, with tensors of the same shape and dtype (except where an
operation says otherwise). ``send`` and ``recv`` are the exceptions: only the
two ranks involved call them.

**In place or not.** ``broadcast``, ``all_reduce``, ``scatter`` and ``recv``
write their result into the tensor they are given and return that same
tensor; ``reduce`` writes the result into the tensor on ``dst`` (on other
ranks the tensor's contents afterwards are unspecified: backends use it as
scratch space). ``all_gather``, ``gather``, ``reduce_scatter`` and
``all_to_all`` return new tensors and leave their inputs unchanged. An
implementation whose backend returns new tensors (XLA) copies the result
back where the contract says "in place".

**Into a given output.** ``all_gather_into`` and ``reduce_scatter_into``
are ``all_gather`` and ``reduce_scatter`` writing into one flat tensor the
caller gives (as ``torch.distributed.all_gather_into_tensor`` and
``reduce_scatter_tensor``, which FSDP calls for every layer): the output
of ``all_gather_into`` holds ``world_size`` times the input's elements,
rank ``i``'s in the ``i``-th equal chunk of its flat view; the input of
``reduce_scatter_into`` holds ``world_size`` times the output's elements,
and this rank's reduced chunk lands in the output. Both tensors are
contiguous and of one dtype. The base class gives both, by the operation
they extend and one copy; a collective whose backend writes into a given
buffer overrides them and saves that copy.

**Reduce ops** are named: ``"sum"``, ``"mean"``, ``"min"``, ``"max"``,
``"product"`` (:data:`REDUCE_OPS`); an implementation may accept more
(Horovod's ``"adasum"``) and lists them in :attr:`~Collective.reduce_ops`.
``"mean"`` is the sum divided by the group's size; for integer tensors the
division is floor division (as Python's ``//``) and the dtype is kept — the
mean of ``[1, 2]`` over two ranks is ``1``. For bool tensors only ``"min"``
(logical and) and ``"max"`` (logical or) are defined. An unknown name raises
:class:`~phalanx_core.MisconfigurationError` listing the names that exist.

**Async.** Tensor operations take ``async_op=True`` and then return a
:class:`Work` handle at once; ``handle.wait()`` blocks until the operation
is done and returns what the synchronous call would have returned. Object
operations and ``send`` / ``recv`` are synchronous. Until ``wait()``
returns, the collective keeps alive every buffer its backend still reads or
writes: the caller may have dropped its own references to the inputs (a
process group built on the collective gets such inputs from FSDP). A handle
may also notify when it is done (:meth:`Work.on_done`), which lets torch's
DDP learn of a finished gradient bucket without a thread that waits.

**Subgroups.** ``new_group(ranks)`` is itself collective: every rank of this
collective calls it with the same ``ranks``. Members get a collective over
the subgroup. Non-members get a collective whose :attr:`~Collective.is_member`
is false, whose ``rank`` is ``-1``, and whose every operation raises
:class:`~phalanx_core.NotInGroupError` naming the group's ranks (see
:class:`NonMember`, which implementations return for that).

**Timeouts.** Each collective object has a timeout (seconds, given to its
constructor, ``1800`` by default). An operation that does not complete
within it raises :class:`~phalanx_core.CollectiveTimeoutError` naming the
operation and, where the backend can tell, the ranks that did not arrive.

**Refusals.** A collective that cannot do an operation lists it in
:attr:`~Collective.unsupported` and does not implement it; calling it raises
:class:`~phalanx_core.UnavailableError` naming the operation and the
collective. Nothing is skipped silently.

**Object operations** (``broadcast_object``, ``all_gather_object``,
``gather_object``, ``scatter_object``) carry any picklable object. A rank
receives an unpickled copy; the rank an object came from may get the object
itself back.

**Bad arguments** (a ``src`` outside the group, an op name that does not
exist, a ``scatter_list`` of the wrong length, ``send`` to oneself) raise
:class:`~phalanx_core.MisconfigurationError` before anything is sent.

**When peers come and go** (the fault-tolerance capabilities,
:data:`FAULT_TOLERANCE`). A collective declares what it can do in
:attr:`~Collective.fault_tolerance`, as it declares ``unsupported``; the
conformance suite checks every claim, and a strategy that needs one (the
``*_ft`` strategies need ``liveness`` and ``reconfigure``) refuses, when it
is resolved, a collective that does not declare it.

- ``liveness``: an operation whose peer died raises
  :class:`~phalanx_core.CollectiveConnectionError`, and one whose peer
  stalls :class:`~phalanx_core.CollectiveTimeoutError`, within the
  collective's timeout: never a hang. :meth:`~Collective.abort` ends every
  pending operation of this rank (they raise) and leaves the group; an
  operation after it raises :class:`~phalanx_core.CollectiveConnectionError`
  until the next :meth:`~Collective.reconfigure`.
- ``reconfigure``: :meth:`~Collective.reconfigure` forms a new group of the
  members a :class:`Membership` names (this rank's place, their number, the
  store they meet at and the configuration's prefix there), in place, on a
  collective that was never set up or was set up before: the previous
  group's pending operations are aborted, and every operation after it runs
  over the new group, with the new ranks. It can be called any number of
  times in one process, twice in a row before any operation too, and no
  operation of one configuration meets another's. ``new_group`` is not part
  of it: a reconfigured group makes no subgroups.
- ``shrink``: :meth:`~Collective.shrink` drops the given ranks from the
  group in place (torch's ``shrink_group``, where the backend has it).

A collective that does not declare a capability refuses its method with
:class:`~phalanx_core.UnavailableError` naming the capability.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ._checks import (
    check_into,
    check_one_per_rank,
    check_rank,
    check_reduce_op,
    check_scatter_list,
    plan_mismatch,
    poll,
    timed_out,
)
from ._membership import FAULT_TOLERANCE, Membership, check_capabilities
from ._operations import DEFAULT_TIMEOUT, EXTENDS, OPERATIONS, REDUCE_OPS, Tensor
from ._work import CompletedWork, Work, _Then
from .errors import (
    MisconfigurationError,
    NotInGroupError,
    UnavailableError,
)

if TYPE_CHECKING:
    from .accelerator import Accelerator
    from .environment import ClusterEnvironment
    from .hangs import Board
    from .launcher import Launcher

__all__ = [
    "DEFAULT_TIMEOUT",
    "FAULT_TOLERANCE",
    "OPERATIONS",
    "REDUCE_OPS",
    "Collective",
    "CompletedWork",
    "Membership",
    "NonMember",
    "Tensor",
    "Work",
    "check_into",
    "check_one_per_rank",
    "check_rank",
    "check_reduce_op",
    "check_scatter_list",
    "plan_mismatch",
    "poll",
    "timed_out",
]


class Collective(ABC):
    """How ranks talk: the operations of the contract in this module's
    docstring, for one backend.

    Constructed by the registry as ``Collective(**spec_options)`` (at least
    ``timeout``); :meth:`setup` joins (or adopts) the backend's group in each
    rank, :meth:`teardown` leaves it.

    Attributes:
        name: the collective's name, for messages.
        reduce_ops: the reduce op names this collective accepts.
        unsupported: operations this collective cannot do. Do not implement
            them: the base class makes each raise
            :class:`~phalanx_core.UnavailableError` naming it.
        subgroups: ``False`` where :meth:`new_group` can make only the
            group of every rank (XLA runs each collective on all replicas):
            a smaller group raises :class:`~phalanx_core.UnavailableError`
            naming ``new_group``. The conformance suite checks both halves.
        fault_tolerance: what this collective can do when its peers come
            and go (``"liveness"``, ``"reconfigure"``, ``"shrink"``: see the
            contract's "When peers come and go"). Declare only what the
            conformance suite's fault-tolerance tests pass; a collective made
            of others declares what all of them can (per instance).
    """

    name: ClassVar[str] = "collective"
    reduce_ops: ClassVar[tuple[str, ...]] = REDUCE_OPS
    unsupported: ClassVar[frozenset[str]] = frozenset()
    subgroups: ClassVar[bool] = True
    fault_tolerance: ClassVar[frozenset[str]] = frozenset()
    #: What every node of the job must have resolved alike (field -> value),
    #: set by the strategy before :meth:`setup` (``Strategy.plan_facts()``).
    #: A collective that can compare it across the nodes before its group
    #: exists (the torch one, through its rendezvous store) does so in
    #: ``setup`` and sets :attr:`plan_checked`; otherwise the strategy
    #: compares it with :meth:`all_gather_object` right after ``setup``.
    plan_facts: Mapping[str, str] | None = None
    #: Set by a collective whose ``setup`` compared :attr:`plan_facts`
    #: across the nodes itself.
    plan_checked: bool = False
    #: Seconds a collective whose ``setup`` waits for every rank to arrive
    #: lets pass before it says which ranks have not (and again each time
    #: as long); set by the strategy before :meth:`setup` (its
    #: ``hang_report``). ``inf``: it waits without a word.
    arrival_report: float = float("inf")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.unsupported) - set(OPERATIONS)
        if unknown:
            raise TypeError(
                f"{cls.__qualname__}.unsupported names {sorted(unknown)}, which are not "
                f"operations of the contract ({', '.join(OPERATIONS)})"
            )
        cls.fault_tolerance = check_capabilities(
            cls.fault_tolerance, where=f"{cls.__qualname__}.fault_tolerance"
        )
        derived = {op for op, base in EXTENDS.items() if base in cls.unsupported and op not in cls.__dict__}
        if derived - set(cls.unsupported):
            cls.unsupported = frozenset(cls.unsupported) | derived
        for op in cls.unsupported:
            if op not in cls.__dict__:
                setattr(cls, op, _refusing(op))
        for op in EXTENDS:
            # A parent's refusal of an operation this class can do (through
            # the default) is not inherited.
            if op not in cls.unsupported and getattr(getattr(cls, op), "_phalanx_refusal", False):
                setattr(cls, op, vars(Collective)[op])

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise MisconfigurationError(
                f"{type(self).__name__}(timeout={timeout!r}): the timeout is a positive number of seconds"
            )
        self.timeout = float(timeout)

    def _refusal(self, operation: str) -> Exception:
        return UnavailableError(
            f"{operation}() is not available on the {self.name!r} collective "
            f"({type(self).__module__}.{type(self).__qualname__}); it cannot do "
            f"{', '.join(sorted(self.unsupported))}. Use another collective for this "
            "operation, e.g. resolve(..., collective='torch')"
        )

    # -- life cycle -------------------------------------------------------

    @abstractmethod
    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        """Join the backend's group as ``environment.global_rank`` of
        ``environment.world_size`` (rendezvous at ``main_address`` /
        ``main_port`` where the backend needs it), or adopt a group the user
        already made. ``accelerator`` tells the default transport (its
        ``collective_backend``). Calling it again once set up does nothing."""

    def check_accelerator(self, accelerator: Accelerator) -> None:  # noqa: B027 - optional check
        """Refuse, saying what to use instead, an accelerator whose devices
        this collective cannot use (nccl with the CPU). The strategy's
        constructor calls it, so a bad pair fails when resolving, before any
        process starts. The base accepts every accelerator."""

    def check_launcher(self, launcher: Launcher, environment: ClusterEnvironment) -> None:  # noqa: B027
        """Refuse, saying what to use instead, processes this collective
        cannot talk among: Horovod's collective needs ranks that horovodrun
        or its own launcher started. ``environment`` is the one detected
        here (``horovod`` under horovodrun, where the launcher runs ``fn``
        in place). The strategy's constructor calls it after
        :meth:`check_accelerator`, so the pair fails when resolving, before
        any process starts. The base accepts every launcher."""

    @abstractmethod
    def teardown(self) -> None:
        """Leave the group this collective made (not one it adopted). Safe
        to call more than once."""

    @property
    @abstractmethod
    def is_initialized(self) -> bool:
        """Whether :meth:`setup` ran (or a group was adopted)."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in this collective's group (``-1`` for a non-member)."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of ranks in this collective's group."""

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The world rank of each rank of this group, in group-rank order."""
        return tuple(range(self.world_size))

    @property
    def is_member(self) -> bool:
        """Whether this process belongs to the group (see :meth:`new_group`)."""
        return True

    # -- tensor operations -------------------------------------------------

    @abstractmethod
    def barrier(self, *, async_op: bool = False) -> Work | None:
        """Block until every rank of the group has called it."""

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int = 0, *, async_op: bool = False) -> Tensor | Work:
        """Copy ``src``'s ``tensor`` into ``tensor`` on every rank, in place;
        return ``tensor``."""

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: str = "sum", *, async_op: bool = False) -> Tensor | Work:
        """Reduce ``tensor`` across the group with ``op``, in place on every
        rank; return ``tensor``."""

    @abstractmethod
    def reduce(
        self, tensor: Tensor, dst: int = 0, op: str = "sum", *, async_op: bool = False
    ) -> Tensor | Work:
        """Reduce ``tensor`` across the group into ``tensor`` on ``dst``;
        return ``tensor`` (whose contents on other ranks are unspecified)."""

    @abstractmethod
    def all_gather(self, tensor: Tensor, *, async_op: bool = False) -> list[Tensor] | Work:
        """Return a new list of ``world_size`` tensors: element ``i`` is rank
        ``i``'s ``tensor``."""

    def all_gather_into(self, output: Tensor, tensor: Tensor, *, async_op: bool = False) -> Tensor | Work:
        """Write every rank's ``tensor`` into ``output``, rank ``i``'s in the
        ``i``-th of ``world_size`` equal chunks of its elements; return
        ``output``. This default runs :meth:`all_gather` and copies into
        ``output``; override it where the backend writes into a buffer."""
        check_into(output, tensor, self.world_size, operation="all_gather_into")
        gathered = self.all_gather(tensor, async_op=async_op)

        def finish(parts: Sequence[Tensor]) -> Tensor:
            for chunk, part in zip(output.view(len(parts), -1), parts, strict=True):
                chunk.copy_(part.reshape(-1))
            return output

        return _Then(gathered, finish) if async_op else finish(gathered)  # type: ignore[arg-type]

    @abstractmethod
    def gather(self, tensor: Tensor, dst: int = 0, *, async_op: bool = False) -> list[Tensor] | Work:
        """On ``dst`` return the list ``all_gather`` would; on other ranks
        return an empty list."""

    @abstractmethod
    def scatter(
        self,
        tensor: Tensor,
        scatter_list: Sequence[Tensor] | None = None,
        src: int = 0,
        *,
        async_op: bool = False,
    ) -> Tensor | Work:
        """Copy ``scatter_list[i]`` from ``src`` into ``tensor`` on rank ``i``,
        in place; return ``tensor``. ``scatter_list`` is given on ``src``
        only (``world_size`` tensors shaped like ``tensor``)."""

    @abstractmethod
    def reduce_scatter(self, tensor: Tensor, op: str = "sum", *, async_op: bool = False) -> Tensor | Work:
        """Reduce ``tensor`` across the group with ``op`` and return a new
        tensor holding this rank's slice of the result along dimension 0
        (``tensor.shape[0]`` must be divisible by ``world_size``)."""

    def reduce_scatter_into(
        self, output: Tensor, tensor: Tensor, op: str = "sum", *, async_op: bool = False
    ) -> Tensor | Work:
        """Reduce ``tensor`` across the group with ``op`` and write this
        rank's chunk of the result (the ``rank``-th of ``world_size`` equal
        chunks of its elements) into ``output``; return ``output``. This
        default runs :meth:`reduce_scatter` and copies into ``output``;
        override it where the backend writes into a buffer."""
        check_into(output, tensor, self.world_size, operation="reduce_scatter_into")
        scattered = self.reduce_scatter(tensor.view(self.world_size, -1), op, async_op=async_op)

        def finish(part: Tensor) -> Tensor:
            output.view(-1).copy_(part.reshape(-1))
            return output

        return _Then(scattered, finish) if async_op else finish(scattered)

    @abstractmethod
    def all_to_all(self, tensors: Sequence[Tensor], *, async_op: bool = False) -> list[Tensor] | Work:
        """Send ``tensors[i]`` to rank ``i``; return a new list whose element
        ``j`` is what rank ``j`` sent to this rank."""

    @abstractmethod
    def send(self, tensor: Tensor, dst: int, *, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``, which calls :meth:`recv`."""

    @abstractmethod
    def recv(self, tensor: Tensor, src: int, *, tag: int = 0) -> Tensor:
        """Receive into ``tensor``, in place, what rank ``src`` sent; return
        ``tensor``."""

    # -- object operations ---------------------------------------------------

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return ``src``'s ``obj`` on every rank (other ranks' ``obj`` is
        ignored)."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's ``obj``, indexed by rank."""

    @abstractmethod
    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        """On ``dst`` return the list of every rank's ``obj``; on other ranks
        an empty list."""

    @abstractmethod
    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        """Return ``objs[rank]`` from ``src`` (``objs`` is given on ``src``
        only, one object per rank)."""

    # -- groups --------------------------------------------------------------

    @abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Collective:
        """Make a subgroup of ``ranks`` (ranks of this group). Collective:
        every rank calls it. Members get a collective over the subgroup;
        non-members get a :class:`NonMember`."""

    # -- peers that come and go --------------------------------------------------

    def _lacks(self, capability: str, method: str) -> UnavailableError:
        return UnavailableError(
            f"{method}() is not available on the {self.name!r} collective "
            f"({type(self).__module__}.{type(self).__qualname__}): it does not declare the "
            f"{capability!r} capability (its fault_tolerance: "
            f"{', '.join(sorted(self.fault_tolerance)) or 'none'}). Use a collective that has it, "
            "e.g. collective='torch'"
        )

    def reconfigure(self, membership: Membership) -> None:
        """Form a new group of the members ``membership`` names, in place
        (capability ``reconfigure``; see the contract). Collective: every
        member calls it with the same store and prefix and its own rank.
        Raises :class:`~phalanx_core.CollectiveConnectionError` or
        :class:`~phalanx_core.CollectiveTimeoutError` where the members do
        not all arrive within the timeout. The base refuses."""
        raise self._lacks("reconfigure", "reconfigure")

    def abort(self) -> None:
        """End every pending operation of this rank (each raises) and leave
        the group, without waiting for any peer (capability ``liveness``).
        Safe to call more than once. The base refuses."""
        raise self._lacks("liveness", "abort")

    def shrink(self, ranks: Sequence[int]) -> None:
        """Drop ``ranks`` (ranks of this group) from the group in place;
        the others keep their order and are renumbered from 0 (capability
        ``shrink``). Every remaining rank calls it. The base refuses."""
        raise self._lacks("shrink", "shrink")

    # -- diagnosis -----------------------------------------------------------

    def board(self) -> Board | None:
        """A fresh connection to a key-value store every rank of this
        collective's job reaches (torch's rendezvous store, say), for the
        ranks' hang reports (:mod:`phalanx_core.hangs`); called after
        :meth:`setup`, and the caller closes it. ``None`` (the default):
        this collective has none, and each rank reports only its own state."""
        return None

    def __repr__(self) -> str:
        state = f"rank={self.rank}, world_size={self.world_size}" if self.is_initialized else "not set up"
        return f"{type(self).__name__}({state})"


def _refusing(operation: str) -> Callable[..., Any]:
    def refuse(self: Collective, *args: Any, **kwargs: Any) -> Any:
        raise self._refusal(operation)

    refuse.__name__ = operation
    refuse.__doc__ = "Not available on this collective: raises (see ``unsupported``)."
    refuse._phalanx_refusal = True  # type: ignore[attr-defined]
    return refuse


class NonMember(Collective):
    """What :meth:`Collective.new_group` returns on a rank outside the group:
    ``is_member`` is false, ``rank`` is ``-1``, and every operation raises
    :class:`~phalanx_core.NotInGroupError` naming the group."""

    unsupported = frozenset(OPERATIONS)
    # Spelled out so that type checkers see them implemented.
    barrier = _refusing("barrier")
    broadcast = _refusing("broadcast")
    all_reduce = _refusing("all_reduce")
    reduce = _refusing("reduce")
    all_gather = _refusing("all_gather")
    gather = _refusing("gather")
    scatter = _refusing("scatter")
    reduce_scatter = _refusing("reduce_scatter")
    all_to_all = _refusing("all_to_all")
    send = _refusing("send")
    recv = _refusing("recv")
    broadcast_object = _refusing("broadcast_object")
    all_gather_object = _refusing("all_gather_object")
    gather_object = _refusing("gather_object")
    scatter_object = _refusing("scatter_object")

    def __init__(self, ranks: Sequence[int], *, parent: str = "collective", world_rank: int = -1) -> None:
        super().__init__()
        self._parent = parent
        self._ranks = tuple(ranks)
        self._world_rank = world_rank

    def _refusal(self, operation: str) -> Exception:
        who = f"rank {self._world_rank}" if self._world_rank >= 0 else "this rank"
        return NotInGroupError(
            f"{operation}() called on a {self._parent!r} group of ranks {list(self._ranks)}, but "
            f"{who} is not a member; call it only on the ranks of the group (check "
            "`group.is_member` first)"
        )

    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        """Nothing to join."""

    def teardown(self) -> None:
        """Nothing to leave."""

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def rank(self) -> int:
        return -1

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return self._ranks

    @property
    def is_member(self) -> bool:
        return False

    def new_group(self, ranks: Sequence[int]) -> Collective:
        raise self._refusal("new_group")
