"""The ``torch`` collective: the contract over ``torch.distributed``, for any
c10d backend by name."""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from phalanx_core import (
    ClusterEnvironment,
    Collective,
    CollectiveConnectionError,
    Membership,
    MisconfigurationError,
    NonMember,
    UnavailableError,
    Work,
    check_into,
    check_one_per_rank,
    check_rank,
    check_reduce_op,
    check_scatter_list,
)
from phalanx_core.accelerator import Accelerator
from phalanx_core.launching import LINES_PREFIXED_VAR

from .._launch import listen
from .._torch_versions import gloo_connection_lines_hidden
from .c10d_backends import bound_device, check_backend, check_backend_moves
from .c10d_errors import left_barrier, translate
from .c10d_store import StoreBoard, compare_plans, open_board, tcp_address
from .configured import ABORTED, FORMED, BackendCalls, form
from .torch_work import TorchWork

#: Set-ups of a default group in this process; every rank counts the same.
_SETUPS = itertools.count()


class TorchCollective(Collective):
    """The contract over ``torch.distributed``, for any c10d backend by name.

    Options:
        backend: the c10d backend — ``"gloo"``, ``"nccl"``, ``"mpi"`` where
            torch has it, or any name a third party registered with
            ``torch.distributed.Backend.register_backend``. ``None`` (the
            default) uses the accelerator's (gloo for cpu, nccl for cuda).
        timeout: seconds an operation may take (the process group's timeout,
            for groups this collective makes).
        interface: the network interface the ranks connect to each other
            over (``"eth0"``): gloo's ``GLOO_SOCKET_IFNAME``, and nccl's
            ``NCCL_SOCKET_IFNAME`` for nccl. ``None`` (the default): those
            variables where set, else the interface that the route to the
            main address leaves from (on one host, the backend's own choice).

    ``setup()`` makes the default process group from the environment
    (``env://``: ``MASTER_ADDR`` / ``MASTER_PORT`` from the environment's
    main address and port) — or adopts the one the user already made, which
    it then never destroys. Each operation is one torch.distributed call:
    no barrier before a reduction, no copy the contract does not need.
    ``"mean"`` is ``AVG`` for floating-point tensors and a sum followed by a
    floor division for integers. ``barrier`` on gloo is
    ``monitored_barrier``, so a timeout names the ranks that did not arrive.

    When peers come and go (``fault_tolerance``): an operation whose peer
    died raises CollectiveConnectionError, one whose peer stalls
    CollectiveTimeoutError after ``timeout`` (gloo's and nccl's own
    timeouts); ``abort()`` aborts the backend's pending work.
    ``reconfigure(membership)`` forms a group of the members it names, on a
    collective that did not make the job's default group: a c10d backend of
    its own (gloo or nccl), made from the members' store under the
    configuration's prefix, through torch's public backend classes (see
    :mod:`.configured`), and the previous configuration's aborted.
    """

    name: ClassVar[str] = "torch"
    fault_tolerance: ClassVar[frozenset[str]] = frozenset({"liveness", "reconfigure"})

    def __init__(
        self, *, timeout: float = 1800.0, backend: str | None = None, interface: str | None = None
    ) -> None:
        super().__init__(timeout=timeout)
        if backend is not None and not isinstance(backend, str):
            raise MisconfigurationError(f"TorchCollective(backend={backend!r}): give a backend name (str)")
        if interface is not None and (not isinstance(interface, str) or not interface):
            raise MisconfigurationError(
                f"TorchCollective(interface={interface!r}): give a network interface's name ('eth0')"
            )
        self._backend_flag = backend
        if backend is not None and backend.lower() not in FORMED:
            # A group of other members is formed by hand of gloo or nccl only.
            self.fault_tolerance = frozenset({"liveness"})  # type: ignore[misc]
        self._interface = interface
        self._environment: ClusterEnvironment | None = None
        self._group: Any = None  # None: the default group
        self._owns = False
        self._initialized = False
        self._rank = -1
        self._world_size = 0
        self._global_ranks: tuple[int, ...] = ()
        self._backend = ""
        #: all_to_all through one buffer: set where the backend has no list
        #: form (gloo before torch 2.13).
        self._all_to_all_in_one = False
        self._prefix = "phalanx/user-group"
        self._store_address: tuple[str, int] | None = None
        #: What the operations call: torch.distributed's functions, or a
        #: configuration's backend (:meth:`reconfigure`).
        self._calls: Any = _C10D
        self._membership: Membership | None = None

    # -- life cycle -------------------------------------------------------

    def check_accelerator(self, accelerator: Accelerator) -> None:
        """The backend (``backend=``, else the accelerator's default) must
        exist in this torch build and use the accelerator's devices (nccl
        moves CUDA tensors only)."""
        check_backend_moves(
            (self._backend_flag or accelerator.collective_backend or "gloo").lower(), accelerator
        )

    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        if self._initialized:
            return
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != environment.world_size:
                raise MisconfigurationError(
                    f"collective 'torch' found a process group of {dist.get_world_size()} ranks already "
                    f"made, but the environment says world_size={environment.world_size}; make the "
                    "group with the job's world size, or let phalanx make it"
                )
            self._owns = False
            self._store_address = _adopted_store_address()
        else:
            backend = check_backend(
                self._backend_flag or (accelerator.collective_backend if accelerator else None) or "gloo"
            )
            self._environment = environment
            network = self._network(environment, backend) if environment.world_size > 1 else None
            if network is not None:
                os.environ.update(network.variables)
            os.environ["MASTER_ADDR"] = environment.main_address
            os.environ["MASTER_PORT"] = str(environment.main_port)
            timeout = datetime.timedelta(seconds=self.timeout)
            hook = sys.excepthook
            try:
                store, rank, size = next(
                    dist.rendezvous(  # type: ignore[attr-defined]
                        "env://", environment.global_rank, environment.world_size, timeout=timeout
                    )
                )
                # A group made again in this process (a second launch, or a
                # set-up after a teardown under torchrun) meets the same
                # store: a fresh prefix keeps it from reading the last one's keys.
                self._prefix = f"phalanx/{next(_SETUPS)}"
                if size > 1:
                    _await_arrivals(store, self._prefix, rank, size, timeout, self.arrival_report)
                if self.plan_facts is not None and size > 1:
                    seen_as = self._check_plan(store, environment, backend, network)
                    if network is not None and network.interface is None and seen_as:
                        # The main address leads to loopback here (this is
                        # its host, and its name maps to 127.0.1.1): take
                        # the interface that has the address the others use.
                        found = listen.main_host_network(seen_as, backend)
                        if found is not None:
                            os.environ.update(found.variables)
                with gloo_connection_lines_hidden():
                    dist.init_process_group(
                        backend,
                        store=dist.PrefixStore(self._prefix, store),  # type: ignore[attr-defined]
                        rank=rank,
                        world_size=size,
                        timeout=timeout,
                        **bound_device(backend),
                    )
                if size > 1:
                    _await_connections(store, self._prefix, size, timeout)
            except RuntimeError as exc:
                raise self._translate(exc, "setup") from exc
            self._owns = True
            self._store_address = tcp_address(store)
            if os.environ.get(LINES_PREFIXED_VAR):
                # init_process_group prefixes tracebacks with "[rankN]: "; the
                # runner (phalanx run) already prefixes every line.
                sys.excepthook = hook
        self._backend = str(dist.get_backend())
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._global_ranks = tuple(range(self._world_size))
        self._initialized = True

    def network(self, main_address: str, main_port: int, world_size: int, accelerator: Any = None) -> str:
        """The interface the connections between the ranks of a job of
        ``world_size`` ranks would use on this host, and why (``phalanx
        explain`` shows it); see ``interface``."""
        backend = self._backend_flag or (accelerator.collective_backend if accelerator else None) or "gloo"
        if world_size == 1:
            return "one rank: no connections to other ranks"
        try:
            choice = listen.choose_network(main_address, main_port, backend.lower(), self._interface)
        except ValueError as exc:
            return f"refused: {exc}"
        return choice.describe(backend.lower())

    def _network(self, environment: ClusterEnvironment, backend: str) -> listen.Network:
        try:
            choice = listen.choose_network(
                environment.main_address, environment.main_port, backend, self._interface
            )
        except ValueError as exc:
            raise MisconfigurationError(f"collective 'torch': {exc}") from None
        if choice.problem is not None:
            raise CollectiveConnectionError(
                f"setup() on the 'torch' collective ({self._where(environment)}): {choice.problem}",
                operation="setup",
            )
        return choice

    def _check_plan(
        self, store: Any, environment: ClusterEnvironment, backend: str, network: listen.Network | None
    ) -> str | None:
        """Compare the plans of every node through the rendezvous store,
        before the group is made (:func:`compare_plans`); returns the
        address the nodes whose route to the main address leaves their host
        reach it at, if any."""
        facts = {**(self.plan_facts or {}), "torch": torch.__version__, "c10d backend": backend}
        seen_as = network.main_seen_as if network is not None else None
        seen = compare_plans(store, self._prefix, facts, environment, seen_as, where=self._where(environment))
        self.plan_checked = True
        return seen

    def _where(self, environment: ClusterEnvironment | None = None) -> str:
        """This rank in words: ``gloo, rank 1 of 2`` (before its group is
        made, the environment's rank and its host's name)."""
        if self._membership is not None:
            return f"{self._backend}, {self._membership.describe()}"
        if self._initialized or environment is None:
            return f"{self._backend}, rank {self._rank} of {self._world_size}"
        rank = f"rank {environment.global_rank} of {environment.world_size}"
        return f"{self._backend_flag or 'gloo'}, {rank} on {socket.gethostname()}"

    def teardown(self) -> None:
        if self._membership is not None:
            self.abort()
            self._membership = None
        if self._owns and dist.is_initialized():
            dist.destroy_process_group()
        self._owns = False
        self._initialized = False

    # -- peers that come and go ---------------------------------------------------

    def reconfigure(self, membership: Membership) -> None:
        if self._owns or (self._initialized and self._membership is None):
            raise MisconfigurationError(
                "reconfigure() on a 'torch' collective that set up the job's default group: its members "
                "are the job's. Reconfigure a collective of its own for the changing members (one that "
                "was never set up: TorchCollective(...))"
            )
        if not isinstance(membership, Membership):
            raise MisconfigurationError(
                f"reconfigure({membership!r}): give a phalanx_core.Membership (the members' store, this "
                "configuration's prefix there, this rank and their number)"
            )
        self.abort()
        if membership.timeout is not None:
            self.timeout = float(membership.timeout)
        backend = check_backend(self._backend_flag or "gloo")
        self._backend = backend
        self._rank, self._world_size = membership.rank, membership.world_size
        self._membership = membership
        try:
            with gloo_connection_lines_hidden():
                made = form(backend, membership, self.timeout)
                # Every member has made its connections before any goes on: a
                # member that reconfigured again at once (aborting these)
                # would break a slower one's half-made connection, which gloo
                # then makes again, alone, until the timeout.
                made.barrier(dist.BarrierOptions()).wait()
        except RuntimeError as exc:
            raise self._translate(exc, "reconfigure") from exc
        self._calls = BackendCalls(made, membership.rank, membership.world_size)
        self._group = None
        self._global_ranks = tuple(range(membership.world_size))
        self._initialized = True

    def abort(self) -> None:
        calls, self._calls = self._calls, ABORTED
        if isinstance(calls, BackendCalls):
            calls.backend.abort()
        elif calls is _C10D and self._owns and dist.is_initialized():
            dist.group.WORLD.abort()  # type: ignore[union-attr]
            dist.destroy_process_group()
            self._owns = False
            self._initialized = False

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return self._global_ranks

    @property
    def backend(self) -> str:
        """The c10d backend of this collective's group (``"gloo"``)."""
        return self._backend

    def board(self) -> StoreBoard | None:
        """A new client of the group's TCPStore (its own connection: the
        group's may be busy in a barrier), under this group's prefix."""
        if self._store_address is None:
            return None
        return open_board(self._store_address, f"{self._prefix}/hangs")

    @property
    def process_group(self) -> Any:
        """The torch ProcessGroup (``None`` for the default group), for code
        that calls torch.distributed itself."""
        return self._group

    # -- helpers -------------------------------------------------------------

    def _translate(self, exc: BaseException, operation: str) -> BaseException:
        return translate(exc, operation, where=self._where(self._environment), timeout=self.timeout)

    def _peer(self, rank: int, operation: str, argument: str) -> int:
        """The global rank of group rank ``rank``."""
        return self._global_ranks[check_rank(rank, self._world_size, operation=operation, argument=argument)]

    def _reduce(self, tensor: torch.Tensor, op: str) -> tuple[Any, torch.Tensor, Callable[[], object] | None]:
        """The ReduceOp, the tensor torch reduces, and what to do after."""
        is_bool = tensor.dtype is torch.bool
        name = check_reduce_op(op, self.reduce_ops, collective=self.name, is_bool=is_bool)
        if is_bool:
            return _REDUCE_OPS[name], tensor.view(torch.uint8), None
        if name != "mean":
            return _REDUCE_OPS[name], tensor, None
        if tensor.is_floating_point() or tensor.is_complex():
            return dist.ReduceOp.AVG, tensor, None
        size = self._world_size
        return dist.ReduceOp.SUM, tensor, lambda: tensor.div_(size, rounding_mode="floor")

    def _done(
        self,
        work: Any,
        result: Any,
        async_op: bool,
        operation: str,
        finish: Callable[[], object] | None = None,
    ) -> Any:
        if async_op:
            return TorchWork(work, result, self, operation, finish)
        if finish is not None:
            finish()
        return result

    # -- tensor operations -------------------------------------------------

    def barrier(self, *, async_op: bool = False) -> Work | None:
        try:
            if async_op:
                return TorchWork(self._calls.barrier(group=self._group, async_op=True), None, self, "barrier")
            if self._backend == "gloo" and self._world_size > 1:
                start = time.monotonic()
                try:
                    self._calls.monitored_barrier(
                        group=self._group,
                        timeout=datetime.timedelta(seconds=self.timeout),
                        wait_all_ranks=True,
                    )
                except RuntimeError as exc:
                    raise self._left(exc, time.monotonic() - start) from exc
            else:
                self._calls.barrier(group=self._group)
        except RuntimeError as exc:
            raise self._translate(exc, "barrier") from exc
        return None

    def _left(self, exc: RuntimeError, waited: float) -> BaseException:
        """The barrier's error: see :func:`left_barrier`."""
        return left_barrier(
            self._translate(exc, "barrier"), waited, where=self._where(), timeout=self.timeout
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Any:
        peer = self._peer(src, "broadcast", "src")
        try:
            work = self._calls.broadcast(tensor, peer, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "broadcast") from exc
        return self._done(work, tensor, async_op, "broadcast")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Any:
        reduce_op, target, finish = self._reduce(tensor, op)
        try:
            work = self._calls.all_reduce(target, reduce_op, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "all_reduce") from exc
        return self._done(work, tensor, async_op, "all_reduce", finish)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        peer = self._peer(dst, "reduce", "dst")
        reduce_op, target, finish = self._reduce(tensor, op)
        try:
            work = self._calls.reduce(target, peer, reduce_op, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "reduce") from exc
        return self._done(work, tensor, async_op, "reduce", finish if self._rank == dst else None)

    def all_gather(self, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
        # NCCL takes contiguous tensors only (gloo copies itself): a
        # transposed or sliced input is sent as a contiguous copy.
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self._world_size)]
        try:
            work = self._calls.all_gather(out, tensor, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "all_gather") from exc
        return self._done(work, out, async_op, "all_gather")

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
        check_into(output, tensor, self._world_size, operation="all_gather_into")
        try:
            # c10d splits the output along dimension 0 into the input's shape
            stacked = output.view(_stacked(tensor.shape, self._world_size))
            work = self._calls.all_gather_into(stacked, tensor, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "all_gather_into") from exc
        return self._done(work, output, async_op, "all_gather_into")

    def gather(self, tensor: torch.Tensor, dst: int = 0, *, async_op: bool = False) -> Any:
        peer = self._peer(dst, "gather", "dst")
        tensor = tensor.contiguous()  # as all_gather
        out = [torch.empty_like(tensor) for _ in range(self._world_size)] if self._rank == dst else None
        try:
            work = self._calls.gather(tensor, out, dst=peer, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "gather") from exc
        return self._done(work, out if out is not None else [], async_op, "gather")

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: Sequence[torch.Tensor] | None = None,
        src: int = 0,
        *,
        async_op: bool = False,
    ) -> Any:
        peer = self._peer(src, "scatter", "src")
        chunks = (
            check_scatter_list(scatter_list, tensor, self._world_size, src=src) if self._rank == src else None
        )
        try:
            work = self._calls.scatter(tensor, chunks, src=peer, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "scatter") from exc
        return self._done(work, tensor, async_op, "scatter")

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Any:
        if tensor.dim() == 0 or tensor.shape[0] % self._world_size:
            raise MisconfigurationError(
                f"reduce_scatter(): dimension 0 of the tensor ({tuple(tensor.shape)}) must be divisible "
                f"by the group's size ({self._world_size})"
            )
        out = torch.empty(
            (tensor.shape[0] // self._world_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        return self._reduce_scatter_into(out, tensor, op, async_op, "reduce_scatter")

    def reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False
    ) -> Any:
        check_into(output, tensor, self._world_size, operation="reduce_scatter_into")
        return self._reduce_scatter_into(output, tensor, op, async_op, "reduce_scatter_into")

    def _reduce_scatter_into(
        self, out: torch.Tensor, tensor: torch.Tensor, op: str, async_op: bool, operation: str
    ) -> Any:
        reduce_op, source, _ = self._reduce(tensor, op)
        # c10d wants the input to be the outputs' shape stacked along dimension 0
        source = source.view(_stacked(out.shape, self._world_size))
        target = out.view(torch.uint8) if tensor.dtype is torch.bool else out
        finish = None
        if check_reduce_op(op, self.reduce_ops) == "mean" and not (
            tensor.is_floating_point() or tensor.is_complex()
        ):
            size = self._world_size
            finish = lambda: out.div_(size, rounding_mode="floor")  # noqa: E731
        try:
            work = self._calls.reduce_scatter(target, source, reduce_op, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, operation) from exc
        return self._done(work, out, async_op, operation, finish)

    def all_to_all(self, tensors: Sequence[torch.Tensor], *, async_op: bool = False) -> Any:
        check_one_per_rank(tensors, self._world_size, operation="all_to_all")
        if self._all_to_all_in_one:
            return self._all_to_all_in_one_buffer(tensors, async_op)
        out = [torch.empty_like(t) for t in tensors]
        try:
            work = self._calls.all_to_all(out, list(tensors), group=self._group, async_op=async_op)
        except RuntimeError as exc:
            if "does not support alltoall" not in str(exc):
                raise self._translate(exc, "all_to_all") from exc
            # gloo before torch 2.13 has only the one-buffer form.
            self._all_to_all_in_one = True
            return self._all_to_all_in_one_buffer(tensors, async_op)
        return self._done(work, out, async_op, "all_to_all")

    def _all_to_all_in_one_buffer(self, tensors: Sequence[torch.Tensor], async_op: bool) -> Any:
        """all_to_all through ``all_to_all_single``: the tensors flattened
        into one buffer, split by their sizes, and the received buffer split
        back into tensors shaped as the ones sent."""
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise MisconfigurationError(
                f"all_to_all(): backend {self.backend!r} sends one buffer, so the tensors need one dtype; "
                f"got {sorted(str(d) for d in dtypes)}"
            )
        sizes = [t.numel() for t in tensors]
        as_bytes = tensors[0].dtype is torch.bool  # gloo has no bool
        flat = torch.cat([(t.view(torch.uint8) if as_bytes else t).reshape(-1) for t in tensors])
        received = torch.empty_like(flat)
        try:
            work = self._calls.all_to_all_single(
                received, flat, sizes, sizes, group=self._group, async_op=async_op
            )
        except RuntimeError as exc:
            raise self._translate(exc, "all_to_all") from exc
        out: list[torch.Tensor] = []

        def finish() -> None:
            for part, t in zip(torch.split(received, sizes), tensors, strict=True):
                out.append((part.view(torch.bool) if as_bytes else part).view(t.shape))

        return self._done(work, out, async_op, "all_to_all", finish)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> None:
        peer = self._peer(dst, "send", "dst")
        if dst == self._rank:
            raise MisconfigurationError(f"send(dst={dst}): a rank cannot send to itself")
        try:
            self._calls.send(tensor, peer, group=self._group, tag=tag)
        except RuntimeError as exc:
            raise self._translate(exc, "send") from exc

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> torch.Tensor:
        peer = self._peer(src, "recv", "src")
        if src == self._rank:
            raise MisconfigurationError(f"recv(src={src}): a rank cannot receive from itself")
        try:
            self._calls.recv(tensor, peer, group=self._group, tag=tag)
        except RuntimeError as exc:
            raise self._translate(exc, "recv") from exc
        return tensor

    # -- object operations ---------------------------------------------------

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        peer = self._peer(src, "broadcast_object", "src")
        box = [obj]
        try:
            self._calls.broadcast_object_list(box, src=peer, group=self._group)
        except RuntimeError as exc:
            raise self._translate(exc, "broadcast_object") from exc
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._world_size
        try:
            self._calls.all_gather_object(out, obj, group=self._group)
        except RuntimeError as exc:
            raise self._translate(exc, "all_gather_object") from exc
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        peer = self._peer(dst, "gather_object", "dst")
        out: list[Any] | None = [None] * self._world_size if self._rank == dst else None
        try:
            self._calls.gather_object(obj, out, dst=peer, group=self._group)
        except RuntimeError as exc:
            raise self._translate(exc, "gather_object") from exc
        return out if out is not None else []

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        peer = self._peer(src, "scatter_object", "src")
        if self._rank == src and (objs is None or len(objs) != self._world_size):
            raise MisconfigurationError(
                f"scatter_object(): the source rank gives one object per rank ({self._world_size}), "
                f"got {None if objs is None else len(objs)}"
            )
        out: list[Any] = [None]
        try:
            self._calls.scatter_object_list(
                out, list(objs) if self._rank == src and objs else None, src=peer, group=self._group
            )
        except RuntimeError as exc:
            raise self._translate(exc, "scatter_object") from exc
        return out[0]

    # -- groups --------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> Collective:
        members = list(ranks)
        if not members or len(set(members)) != len(members):
            raise MisconfigurationError(
                f"new_group({members!r}): give a non-empty list of distinct ranks of this group"
            )
        world = sorted(self._peer(r, "new_group", "ranks") for r in members)
        if self._membership is not None:
            raise UnavailableError(
                f"new_group({members!r}) on a reconfigured 'torch' collective ({self._where()}): a group "
                "formed by reconfigure() makes no subgroups; reconfigure() one with those members instead"
            )
        try:
            with gloo_connection_lines_hidden():
                group = dist.new_group(world, timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self._translate(exc, "new_group") from exc
        me = self._global_ranks[self._rank] if self._rank >= 0 else -1
        if me not in world:
            return NonMember(world, parent=self.name, world_rank=me)
        sub = TorchCollective(timeout=self.timeout, backend=self._backend)
        sub._group = group
        sub._initialized = True
        sub._backend = self._backend
        sub._rank = world.index(me)
        sub._world_size = len(world)
        sub._global_ranks = tuple(world)
        return sub


def _stacked(shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The shape of ``world_size`` tensors of ``shape`` stacked along
    dimension 0, as c10d's flat all-gather and reduce-scatter want it."""
    return (world_size * shape[0], *shape[1:]) if len(shape) else (world_size,)


# torch 2.13 names them *_single (the old names warn); earlier torch, the old.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: What the operations call over the job's groups: torch.distributed's
#: functions (a configuration's are :class:`BackendCalls`).
_C10D = SimpleNamespace(
    barrier=dist.barrier,
    monitored_barrier=dist.monitored_barrier,
    broadcast=dist.broadcast,
    all_reduce=dist.all_reduce,
    reduce=dist.reduce,
    all_gather=dist.all_gather,
    all_gather_into=_all_gather_into,
    gather=dist.gather,
    scatter=dist.scatter,
    reduce_scatter=_reduce_scatter,
    all_to_all=dist.all_to_all,
    all_to_all_single=dist.all_to_all_single,
    send=dist.send,
    recv=dist.recv,
    broadcast_object_list=dist.broadcast_object_list,
    all_gather_object=dist.all_gather_object,
    gather_object=dist.gather_object,
    scatter_object_list=dist.scatter_object_list,
)

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


#: Seconds set-up waits for every rank to arrive, at the least: the ranks
#: of a job start seconds apart on a loaded machine, and the collective's
#: ``timeout`` bounds its operations, not the start of the processes.
ARRIVAL_WAIT = 120.0


def _adopted_store_address() -> tuple[str, int] | None:
    """Where the store of a group made before phalanx's setup is, by the
    env:// convention (torchrun's, and ``init_process_group``'s default):
    ``MASTER_ADDR`` and ``MASTER_PORT``; None without them (a group made
    over a store of the user's own: no hang board)."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port or not port.isdigit():
        return None
    return address, int(port)


def _await_arrivals(
    store: Any,
    prefix: str,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    report_after: float = float("inf"),
) -> None:
    """Wait until every rank has reached set-up (up to ``ARRIVAL_WAIT`` s,
    or the collective's timeout where that is longer), so that the group's
    own connections, bounded by the collective's timeout, start together.

    Each rank counts itself in; the last one marks the set-up whole, which
    the others wait for in one blocking wait. The first to arrive instead
    looks every 0.2 s (at first sooner), so that it can say, every
    ``report_after`` seconds (the strategy's ``hang_report``), which ranks
    have not arrived: a rank stuck before its set-up (in its imports, its
    data, a sleep) is named, not waited for in silence. A blocking wait that
    times out would not do: c10d prints two warning lines each time."""
    wait = max(ARRIVAL_WAIT, timeout.total_seconds())
    arrived = [f"{prefix}/arrived/{r}" for r in range(size)]
    whole = f"{prefix}/arrived/all"
    store.set(arrived[rank], "1")
    place = int(store.add(f"{prefix}/arrivals", 1))
    if place == size:
        store.set(whole, "1")
        return
    if place != 1 or report_after >= wait:
        store.wait([whole], datetime.timedelta(seconds=wait))
        return
    start = time.monotonic()
    report_at = start + report_after
    pause = 0.005
    while not store.check([whole]):
        now = time.monotonic()
        if now - start >= wait:
            store.wait([whole], datetime.timedelta(seconds=0.001))  # c10d's own timeout error
        if now >= report_at:
            missing = [r for r in range(size) if not store.check([arrived[r]])]
            _say(
                f"phalanx: rank {rank} of {size} has waited {now - start:.0f} s at set-up for "
                f"{len(missing)} rank(s) that have not reached it: {_ranks_text(missing)}. They are "
                "still before their strategy's set-up (in their imports, reading data, sleeping, "
                "or stuck). The set-up fails at "
                f"{wait:g} s (the larger of {ARRIVAL_WAIT:g} s and the collective's timeout)."
            )
            report_at += report_after
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _await_connections(store: Any, prefix: str, size: int, timeout: datetime.timedelta) -> None:
    """Return once every rank's group is connected. gloo's rank that
    connects to a peer is done when it has written to the socket, before the
    peer has read it: that rank could go on, end its group (or its process)
    and close the socket while the peer still sets up, which then fails with
    "Connection closed by peer" (a script that calls no collective ends that
    soon)."""
    if int(store.add(f"{prefix}/connected", 1)) == size:
        store.set(f"{prefix}/connected/all", "1")
    else:
        store.wait([f"{prefix}/connected/all"], timeout)


def _ranks_text(ranks: Sequence[int]) -> str:
    """``ranks 1, 2, 5`` (the first 16, then how many more)."""
    shown = ", ".join(str(r) for r in ranks[:16])
    more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def _say(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed stream: nobody to tell
        pass
