"""The ``mpi`` collective: the phalanx Collective contract over mpi4py.

Tensors cross through their buffers, without a copy: a contiguous CPU
tensor is handed to MPI as the NumPy array that shares its memory
(``tensor.numpy()``). Dtypes NumPy does not have travel as raw bits where
nothing is computed on them (``bfloat16`` as ``int16``) and through a
``float32`` copy where something is (a reduction). A bool tensor is reduced
through a ``uint8`` view: ``"min"`` is a logical and, ``"max"`` a logical or.

Every synchronous operation is MPI's non-blocking one (``Iallreduce``, ...)
waited for with ``Test`` until the collective's timeout: MPI has no timeout
of its own, and this is how an operation that a rank never joins raises
:class:`~phalanx_core.CollectiveTimeoutError` instead of hanging. MPI cannot
cancel a collective operation, so after a timeout this communicator is
unusable: end the job (the error says so).

Object operations use mpi4py's pickle-based lower-case calls; subgroups are
communicator splits (``Comm.Split``), ranked in the parent's order.
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from phalanx_core import (
    CollectiveTimeoutError,
    MisconfigurationError,
    UnavailableError,
)
from phalanx_core.collective import (
    REDUCE_OPS,
    Collective,
    NonMember,
    Work,
    check_into,
    check_one_per_rank,
    check_rank,
    check_reduce_op,
    check_scatter_list,
    poll,
    timed_out,
)

if TYPE_CHECKING:
    from phalanx_core import Accelerator, ClusterEnvironment, Launcher

__all__ = ["MPICollective"]


#: Open MPI's non-blocking all-reduce (libnbc) picks a binomial tree by
#: default, slower than the blocking call; Rabenseifner's algorithm matches
#: the blocking call (docs' MPI page has the figures).
#: Set before MPI starts (importing mpi4py.MPI), unless the user set it.
_LIBNBC_DEFAULTS = {"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "3"}


#: The variables that name Open MPI's TCP transport's networks.
_TCP_NETWORK_VARS = ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl_tcp_if_exclude")


def _tcp_network() -> dict[str, str]:
    """Open MPI's TCP transport kept on the network that joins the hosts.

    Left alone, it takes every interface but loopback, and a network every
    host has on its own (Docker's bridge, 172.17.0.1 on each) leads it to
    its own host instead of the peer: the job hangs at its first
    collective. Where the job spans hosts (``MASTER_ADDR`` leads away from
    this host) and you named no network (``OMPI_MCA_btl_tcp_if_include`` /
    ``_exclude``), this names the network of the interface the route to
    ``MASTER_ADDR`` leaves from (``192.168.77.0/24``), the same on every
    host of that network. Nothing where the route is over loopback (one
    host, or node 0 knowing itself by a name that leads to loopback)."""
    from phalanx_core.network import interface_network, interface_of, is_loopback, route_source

    main = os.environ.get("MASTER_ADDR")
    if not main or any(os.environ.get(name) for name in _TCP_NETWORK_VARS):
        return {}
    try:
        source = route_source(main)
    except OSError:
        return {}
    interface = None if is_loopback(source) else interface_of(source)
    network = interface_network(interface) if interface else None
    return {_TCP_NETWORK_VARS[0]: network} if network else {}


@functools.cache
def _mpi() -> Any:
    """mpi4py's MPI, imported once (this runs on every operation)."""
    if "mpi4py.MPI" not in sys.modules:
        for name, value in _LIBNBC_DEFAULTS.items():
            os.environ.setdefault(name, value)
        os.environ.update(_tcp_network())
    try:
        from mpi4py import MPI
    except ImportError as exc:  # the registry checks `needs` first; this is for direct use
        raise UnavailableError(
            "collective 'mpi' needs mpi4py and an MPI library: pip install mpi4py (and "
            "apt-get install openmpi-bin)"
        ) from exc
    # mpi4py finalizes MPI in the interpreter's finalization, which a rank
    # that ends through exit_process (phalanx's rank programs) skips; mpirun
    # counts a rank that exits without MPI_Finalize as failed. An atexit
    # handler runs there (a failed rank runs none, and must not finalize:
    # finalizing waits for peers it left in a collective).
    atexit.register(_finalize, MPI)
    return MPI


def _finalize(mpi: Any) -> None:
    if mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


@functools.cache
def _torch() -> Any:
    import torch

    return torch


@functools.cache
def _datatypes() -> dict[Any, Any]:
    torch, MPI = _torch(), _mpi()
    return {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int64: MPI.INT64_T,
        torch.int32: MPI.INT32_T,
        torch.int16: MPI.INT16_T,
        torch.int8: MPI.INT8_T,
        torch.uint8: MPI.UINT8_T,
    }


def _reduce_buffer(work: Any) -> Any:
    """A buffer over ``work``'s memory for a reduction: its address and MPI
    datatype (1.3 us less per call than ``work.numpy()``), or the NumPy view
    for other dtypes. It does not keep ``work`` alive: the caller's
    ``finish`` holds it until the request completes."""
    datatype = _datatypes().get(work.dtype)
    if datatype is None or not work.numel():
        return work.numpy()
    return [_mpi().buffer.fromaddress(work.data_ptr(), work.nbytes), datatype]


@functools.cache
def _ops() -> dict[str, Any]:
    MPI = _mpi()
    return {"sum": MPI.SUM, "mean": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}


class _Request(Work):
    """An MPI request, waited for with the collective's timeout; ``finish``
    turns the finished buffers into what the synchronous call returns."""

    def __init__(
        self,
        owner: MPICollective,
        operation: str,
        request: Any,
        finish: Callable[[], Any],
        keep: tuple[Any, ...] = (),
    ) -> None:
        self._owner = owner
        self._operation = operation
        self._request = request
        self._finish: Callable[[], Any] | None = finish
        self._result: Any = None
        # Every buffer MPI reads or writes, alive until the request is done:
        # mpi4py keeps no reference to them, and a temporary send buffer
        # (a stacked copy) freed early is read back as whatever reused it.
        self._keep = keep

    def wait(self) -> Any:
        if self._finish is not None:
            self._owner._wait(self._request, self._operation)
            finish, self._finish = self._finish, None
            self._result = finish()
            self._keep = ()
        return self._result

    def is_completed(self) -> bool:
        return self._finish is None or bool(self._request.Test())


class MPICollective(Collective):
    """The Collective contract over an MPI communicator (mpi4py), for CPU
    tensors.

    Args:
        timeout: seconds an operation may take before it raises
            :class:`~phalanx_core.CollectiveTimeoutError` (1800).

    :meth:`setup` duplicates ``MPI.COMM_WORLD``: the processes must have been
    started by ``mpirun`` (the ``mpirun`` launcher, or ``mpirun`` around the
    script), and their number must be the environment's world size. A
    process started alone is a world of one.
    """

    name: ClassVar[str] = "mpi"
    #: None: an MPI communicator's members are fixed when it is made from
    #: the job's (MPI_COMM_WORLD), so a group of other members cannot be
    #: formed at each step, and a dead peer aborts the job (ULFM's
    #: revoke and shrink are not in the MPI builds phalanx is tested on).
    fault_tolerance: ClassVar[frozenset[str]] = frozenset()
    reduce_ops: ClassVar[tuple[str, ...]] = REDUCE_OPS

    def __init__(self, *, timeout: float = 1800.0) -> None:
        super().__init__(timeout=timeout)
        self._comm: Any = None
        self._owned = False
        self._global_ranks: tuple[int, ...] = ()
        self._stuck: list[Any] = []  # requests that timed out: MPI cannot cancel them
        # all_reduce's fast path (see _make_fast_plans); off until setup.
        self._tensor_type: Any = None
        self._fast_plans: dict[str, dict[Any, tuple[Any, Any]]] = {}
        self._in_place: Any = None
        self._messages: dict[tuple[int, int, Any], list[Any]] = {}

    @classmethod
    def _over(cls, comm: Any, global_ranks: tuple[int, ...], timeout: float) -> MPICollective:
        group = cls(timeout=timeout)
        group._comm, group._owned, group._global_ranks = comm, True, global_ranks
        group._make_fast_plans()
        return group

    # -- life cycle -----------------------------------------------------------

    def check_accelerator(self, accelerator: Accelerator) -> None:
        """CPU tensors only: MPI is not assumed to be CUDA-aware."""
        if accelerator.device_type != "cpu":
            raise MisconfigurationError(
                f"collective 'mpi' moves CPU tensors, and accelerator {accelerator.name!r} puts them on "
                f"{accelerator.device_type} devices; use accelerator='cpu', or collective='torch' (nccl "
                "on GPUs)"
            )

    def check_launcher(self, launcher: Launcher, environment: ClusterEnvironment) -> None:
        """Ranks MPI can join: started by the ``mpirun`` launcher, or
        processes that exist already (under ``mpirun``; a process alone is a
        world of one). A launcher that makes other processes (``spawn``,
        ``fork``, ``subprocess``) is refused when resolving."""
        from .launcher import MPIRunLauncher

        if isinstance(launcher, MPIRunLauncher) or not launcher.creates_processes:
            return
        raise MisconfigurationError(
            f"collective 'mpi' with launcher {type(launcher).__name__}: MPI talks among processes mpirun "
            "started; use launcher='mpirun', or start the script with `mpirun -np N python script.py`"
        )

    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        if self._comm is not None:
            return
        MPI = _mpi()
        world = MPI.COMM_WORLD
        if world.Get_size() != environment.world_size or world.Get_rank() != environment.global_rank:
            raise MisconfigurationError(
                f"collective 'mpi': MPI sees rank {world.Get_rank()} of {world.Get_size()} process(es), "
                f"but the environment says rank {environment.global_rank} of {environment.world_size}. "
                "MPI talks among processes mpirun started: use launcher='mpirun', or start the script "
                "with mpirun -np N"
            )
        self._comm = world.Dup()
        self._owned = True
        self._global_ranks = tuple(range(world.Get_size()))
        self._make_fast_plans()

    def _message(self, key: tuple[int, int, Any], datatype: Any) -> list[Any]:
        if len(self._messages) >= 256:  # a program that reduces ever new buffers
            self._messages.clear()
        address, size, _ = key
        message = self._messages[key] = [_mpi().buffer.fromaddress(address, size), datatype]
        return message

    def _make_fast_plans(self) -> None:
        """What all_reduce's fast path needs, looked up once: per op, the
        dtypes MPI computes on directly with (datatype, op). ``mean`` and
        bool take the general path (they need work after MPI's)."""
        torch, MPI = _torch(), _mpi()
        self._tensor_type = torch.Tensor
        self._in_place = MPI.IN_PLACE
        self._fast_plans = {
            name: {dtype: (datatype, _ops()[name]) for dtype, datatype in _datatypes().items()}
            for name in ("sum", "min", "max", "product")
        }

    def teardown(self) -> None:
        if self._comm is not None and self._owned and not self._stuck:
            self._comm.Free()
        self._comm = None
        self._tensor_type = None  # the fast path off: operations say "before setup()"

    @property
    def is_initialized(self) -> bool:
        return self._comm is not None

    @property
    def rank(self) -> int:
        return int(self._live("rank").Get_rank())

    @property
    def world_size(self) -> int:
        return int(self._live("world_size").Get_size())

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return self._global_ranks

    def _live(self, operation: str) -> Any:
        if self._comm is None:
            raise MisconfigurationError(
                f"collective 'mpi': {operation} before setup(); strategy.launch(fn) sets it up in each rank"
            )
        if self._stuck:
            raise CollectiveTimeoutError(
                f"{operation}() on the 'mpi' collective: an earlier operation timed out, and MPI cannot "
                "cancel it, so this communicator is unusable; end the job",
                operation=operation,
                timeout=self.timeout,
            )
        return self._comm

    def _wait(self, request: Any, operation: str) -> None:
        # Test() drives MPI's progress, as a blocking call's wait loop does.
        if not poll(request.Test, self.timeout):
            self._stuck.append(request)
            raise timed_out(
                "mpi",
                operation,
                self.timeout,
                where=f"rank {self._comm.Get_rank()} of {self._comm.Get_size()}",
                then="MPI cannot cancel it: this communicator is unusable now; end the job",
            )

    def _run(
        self, operation: str, request: Any, finish: Callable[[], Any], async_op: bool, *keep: Any
    ) -> Any:
        """``finish()`` once ``request`` is done (now, or by the handle's
        ``wait()`` with ``async_op``); ``keep``: the buffers MPI uses that
        nothing else holds until then."""
        if async_op:
            return _Request(self, operation, request, finish, keep)
        self._wait(request, operation)
        return finish()

    # -- buffers ------------------------------------------------------------------

    @staticmethod
    def _check_tensor(tensor: Any, operation: str) -> None:
        torch = _torch()

        if not isinstance(tensor, torch.Tensor):
            raise MisconfigurationError(
                f"{operation}(): expected a torch.Tensor, got {type(tensor).__name__}"
            )
        if not tensor.is_cpu:
            raise MisconfigurationError(
                f"{operation}(): collective 'mpi' moves CPU tensors, got one on {tensor.device}; "
                "move it with .cpu(), or use collective='torch' for GPU tensors"
            )

    @staticmethod
    def _raw(tensor: Any) -> Any:
        """The NumPy array sharing ``tensor``'s memory, for moving bits."""
        torch = _torch()

        if tensor.dtype is torch.bool:
            return tensor.view(torch.uint8).numpy()
        if tensor.dtype is torch.bfloat16:  # NumPy has no bfloat16: its bits, as int16
            return tensor.view(torch.int16).numpy()
        return tensor.numpy()

    @staticmethod
    def _arith(tensor: Any) -> tuple[Any, Any]:
        """A tensor MPI can compute on, sharing memory where it can, and the
        tensor to copy the result back into (``None``: shared)."""
        torch = _torch()

        if tensor.dtype is torch.bool:
            return tensor.view(torch.uint8), None
        if tensor.dtype is torch.bfloat16:
            return tensor.float(), tensor
        return tensor, None

    def _mpi_op(self, tensor: Any, op: str) -> tuple[str, Any]:
        torch = _torch()

        name = check_reduce_op(op, self.reduce_ops, collective=self.name, is_bool=tensor.dtype is torch.bool)
        return name, _ops()[name]

    def _mean(self, tensor: Any, name: str, size: int) -> None:
        if name != "mean":
            return
        if tensor.dtype.is_floating_point:
            tensor.div_(size)
        else:
            tensor.floor_divide_(size)

    # -- operations ----------------------------------------------------------------

    def barrier(self, *, async_op: bool = False) -> Work | None:
        comm = self._live("barrier")
        result = self._run("barrier", comm.Ibarrier(), lambda: None, async_op)
        return result if async_op else None

    def broadcast(self, tensor: Any, src: int = 0, *, async_op: bool = False) -> Any:
        comm = self._live("broadcast")
        check_rank(src, comm.Get_size(), operation="broadcast", argument="src")
        self._check_tensor(tensor, "broadcast")
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()

        def finish() -> Any:
            if buffer is not tensor:
                tensor.copy_(buffer)
            return tensor

        return self._run("broadcast", comm.Ibcast(self._raw(buffer), root=src), finish, async_op)

    def all_reduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        # The common case first, with as little Python as it takes (a 1-float
        # all_reduce is about 3 us of MPI): a plain contiguous CPU tensor of
        # a dtype MPI computes on, an op with nothing to do afterwards.
        comm = self._comm
        if type(tensor) is self._tensor_type and not async_op and not self._stuck:
            plan = self._fast_plans.get(op)
            if plan is not None and tensor.is_cpu and tensor.is_contiguous():
                dtype = tensor.dtype
                mpi = plan.get(dtype)
                if mpi is not None:
                    # MPI's view of the memory, by (address, bytes, datatype):
                    # made once per buffer a program reduces (gradients,
                    # metrics), 0.4 us a call otherwise. An entry never goes
                    # stale: it names memory, and owns none.
                    key = (tensor.data_ptr(), tensor.nbytes, dtype)
                    message = self._messages.get(key)
                    if message is None and key[1]:
                        message = self._message(key, mpi[0])
                    if message is not None:
                        self._wait(comm.Iallreduce(self._in_place, message, mpi[1]), "all_reduce")
                        return tensor
        comm = self._live("all_reduce")
        self._check_tensor(tensor, "all_reduce")
        name, mpi_op = self._mpi_op(tensor, op)
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        work, back = self._arith(buffer)
        request = comm.Iallreduce(_mpi().IN_PLACE, _reduce_buffer(work), mpi_op)

        def finish() -> Any:
            self._mean(work, name, comm.Get_size())
            _copy_back(tensor, buffer, work, back)
            return tensor

        return self._run("all_reduce", request, finish, async_op)

    def reduce(self, tensor: Any, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        comm = self._live("reduce")
        check_rank(dst, comm.Get_size(), operation="reduce", argument="dst")
        self._check_tensor(tensor, "reduce")
        name, mpi_op = self._mpi_op(tensor, op)
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        work, back = self._arith(buffer)
        root = comm.Get_rank() == dst
        if root:
            request = comm.Ireduce(_mpi().IN_PLACE, _reduce_buffer(work), mpi_op, root=dst)
        else:
            request = comm.Ireduce(_reduce_buffer(work), None, mpi_op, root=dst)

        def finish() -> Any:
            if root:
                self._mean(work, name, comm.Get_size())
                _copy_back(tensor, buffer, work, back)
            return tensor

        return self._run("reduce", request, finish, async_op)

    def all_gather(self, tensor: Any, *, async_op: bool = False) -> Any:
        torch = _torch()

        comm = self._live("all_gather")
        self._check_tensor(tensor, "all_gather")
        size = comm.Get_size()
        out = torch.empty((size, *tensor.shape), dtype=tensor.dtype)
        send = tensor.contiguous()
        request = comm.Iallgather(self._raw(send), self._raw(out))
        return self._run("all_gather", request, lambda: list(out.unbind(0)), async_op, send)

    def all_gather_into(self, output: Any, tensor: Any, *, async_op: bool = False) -> Any:
        comm = self._live("all_gather_into")
        self._check_tensor(tensor, "all_gather_into")
        self._check_tensor(output, "all_gather_into")
        check_into(output, tensor, comm.Get_size(), operation="all_gather_into")
        request = comm.Iallgather(self._raw(tensor), self._raw(output))
        return self._run("all_gather_into", request, lambda: output, async_op, tensor, output)

    def gather(self, tensor: Any, dst: int = 0, *, async_op: bool = False) -> Any:
        torch = _torch()

        comm = self._live("gather")
        size = comm.Get_size()
        check_rank(dst, size, operation="gather", argument="dst")
        self._check_tensor(tensor, "gather")
        root = comm.Get_rank() == dst
        out = torch.empty((size, *tensor.shape), dtype=tensor.dtype) if root else None
        send = tensor.contiguous()
        request = comm.Igather(self._raw(send), self._raw(out) if root else None, root=dst)
        finish = lambda: list(out.unbind(0)) if out is not None else []  # noqa: E731
        return self._run("gather", request, finish, async_op, send)

    def scatter(
        self, tensor: Any, scatter_list: Sequence[Any] | None = None, src: int = 0, *, async_op: bool = False
    ) -> Any:
        torch = _torch()

        comm = self._live("scatter")
        size = comm.Get_size()
        check_rank(src, size, operation="scatter", argument="src")
        self._check_tensor(tensor, "scatter")
        root = comm.Get_rank() == src
        send = None
        if root:
            chunks = check_scatter_list(scatter_list, tensor, size, src=src)
            send = self._raw(torch.stack([t.to(tensor.dtype) for t in chunks]).contiguous())
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()

        def finish() -> Any:
            if buffer is not tensor:
                tensor.copy_(buffer)
            return tensor

        return self._run("scatter", comm.Iscatter(send, self._raw(buffer), root=src), finish, async_op, send)

    def reduce_scatter(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        torch = _torch()

        comm = self._live("reduce_scatter")
        self._check_tensor(tensor, "reduce_scatter")
        size = comm.Get_size()
        if tensor.dim() == 0 or tensor.shape[0] % size:
            raise MisconfigurationError(
                f"reduce_scatter(): dim 0 of the tensor ({tuple(tensor.shape)}) must divide by the "
                f"group's size ({size}): each rank gets an equal block"
            )
        name, mpi_op = self._mpi_op(tensor, op)
        work, _ = self._arith(tensor.contiguous().clone())  # MPI reads it; the input stays as it is
        out = work.new_empty((tensor.shape[0] // size, *tensor.shape[1:]))
        request = comm.Ireduce_scatter_block(work.numpy(), out.numpy(), mpi_op)

        def finish() -> Any:
            self._mean(out, name, size)
            return out.view(torch.bool) if tensor.dtype is torch.bool else out.to(tensor.dtype)

        return self._run("reduce_scatter", request, finish, async_op, work)

    def reduce_scatter_into(
        self, output: Any, tensor: Any, op: str = "sum", *, async_op: bool = False
    ) -> Any:
        comm = self._live("reduce_scatter_into")
        self._check_tensor(tensor, "reduce_scatter_into")
        self._check_tensor(output, "reduce_scatter_into")
        size = comm.Get_size()
        check_into(output, tensor, size, operation="reduce_scatter_into")
        name, mpi_op = self._mpi_op(tensor, op)
        work, _ = self._arith(tensor)  # MPI only reads it
        target, back = self._arith(output)
        request = comm.Ireduce_scatter_block(work.numpy(), target.view(-1).numpy(), mpi_op)

        def finish() -> Any:
            self._mean(target, name, size)
            if back is not None:
                back.copy_(target)
            return output

        return self._run("reduce_scatter_into", request, finish, async_op, work, target)

    def all_to_all(self, tensors: Sequence[Any], *, async_op: bool = False) -> Any:
        torch = _torch()

        comm = self._live("all_to_all")
        size = comm.Get_size()
        check_one_per_rank(tensors, size, operation="all_to_all")
        for t in tensors:
            self._check_tensor(t, "all_to_all")
        if len({(tuple(t.shape), t.dtype) for t in tensors}) != 1:
            raise MisconfigurationError("all_to_all(): the tensors must have one shape and dtype")
        send = torch.stack(list(tensors)).contiguous()
        out = torch.empty_like(send)
        request = comm.Ialltoall(self._raw(send), self._raw(out))
        return self._run("all_to_all", request, lambda: list(out.unbind(0)), async_op, send)

    def send(self, tensor: Any, dst: int, *, tag: int = 0) -> None:
        comm = self._live("send")
        check_rank(dst, comm.Get_size(), operation="send", argument="dst")
        if dst == comm.Get_rank():
            raise MisconfigurationError(f"send(dst={dst}): a rank cannot send to itself")
        self._check_tensor(tensor, "send")
        self._wait(comm.Isend(self._raw(tensor.contiguous()), dest=dst, tag=tag), "send")

    def recv(self, tensor: Any, src: int, *, tag: int = 0) -> Any:
        comm = self._live("recv")
        check_rank(src, comm.Get_size(), operation="recv", argument="src")
        if src == comm.Get_rank():
            raise MisconfigurationError(f"recv(src={src}): a rank cannot receive from itself")
        self._check_tensor(tensor, "recv")
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._wait(comm.Irecv(self._raw(buffer), source=src, tag=tag), "recv")
        if buffer is not tensor:
            tensor.copy_(buffer)
        return tensor

    # -- objects: pickled here, moved as bytes, through the same timeout ------------------
    # (mpi4py's pickled lower-case calls have no non-blocking collective forms,
    # so they could not time out: a size first, then the bytes.)

    def _sync(self, operation: str, request: Any) -> None:
        self._wait(request, operation)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import numpy as np

        comm = self._live("broadcast_object")
        check_rank(src, comm.Get_size(), operation="broadcast_object", argument="src")
        data = _dumps(obj) if comm.Get_rank() == src else b""
        size = np.array([len(data)], dtype=np.int64)
        self._sync("broadcast_object", comm.Ibcast(size, root=src))
        buffer = np.frombuffer(data, dtype=np.uint8).copy() if data else np.empty(int(size[0]), np.uint8)
        self._sync("broadcast_object", comm.Ibcast(buffer, root=src))
        return obj if comm.Get_rank() == src else pickle.loads(buffer.tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        import numpy as np

        comm = self._live("all_gather_object")
        data = np.frombuffer(_dumps(obj), dtype=np.uint8)
        sizes = np.empty(comm.Get_size(), dtype=np.int64)
        self._sync("all_gather_object", comm.Iallgather(np.array([data.size], np.int64), sizes))
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        self._sync("all_gather_object", comm.Iallgatherv(data, [out, sizes]))
        return _split(out, sizes)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        import numpy as np

        comm = self._live("gather_object")
        check_rank(dst, comm.Get_size(), operation="gather_object", argument="dst")
        root = comm.Get_rank() == dst
        data = np.frombuffer(_dumps(obj), dtype=np.uint8)
        sizes = np.empty(comm.Get_size(), dtype=np.int64) if root else None
        self._sync("gather_object", comm.Igather(np.array([data.size], np.int64), sizes, root=dst))
        out = np.empty(int(sizes.sum()), dtype=np.uint8) if sizes is not None else None
        self._sync("gather_object", comm.Igatherv(data, [out, sizes] if root else None, root=dst))
        return _split(out, sizes) if out is not None and sizes is not None else []

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        import numpy as np

        comm = self._live("scatter_object")
        size = comm.Get_size()
        check_rank(src, size, operation="scatter_object", argument="src")
        root = comm.Get_rank() == src
        if root and (objs is None or len(objs) != size):
            raise MisconfigurationError(
                f"scatter_object(): the source rank gives one object per rank ({size} here), got "
                f"{None if objs is None else len(objs)}"
            )
        parts = [_dumps(o) for o in objs] if root and objs is not None else []
        sizes = np.array([len(b) for b in parts], dtype=np.int64) if root else None
        mine = np.empty(1, dtype=np.int64)
        self._sync("scatter_object", comm.Iscatter(sizes, mine, root=src))
        send = [np.frombuffer(b"".join(parts), dtype=np.uint8), sizes] if root else None
        buffer = np.empty(int(mine[0]), dtype=np.uint8)
        self._sync("scatter_object", comm.Iscatterv(send, buffer, root=src))
        return pickle.loads(buffer.tobytes())

    # -- subgroups ------------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> Collective:
        comm = self._live("new_group")
        size, me = comm.Get_size(), comm.Get_rank()
        members = sorted(set(ranks))
        if not members or len(members) != len(list(ranks)):
            raise MisconfigurationError(
                f"new_group({list(ranks)!r}): give each rank of the new group once, at least one"
            )
        for r in members:
            check_rank(r, size, operation="new_group", argument="ranks")
        MPI = _mpi()
        member = me in members
        sub = comm.Split(0 if member else MPI.UNDEFINED, key=me)  # collective over the parent
        global_ranks = tuple(self._global_ranks[r] for r in members)
        if not member:
            return NonMember(global_ranks, parent=self.name, world_rank=self._global_ranks[me])
        return MPICollective._over(sub, global_ranks, self.timeout)


def _copy_back(tensor: Any, buffer: Any, work: Any, back: Any) -> None:
    """After a reduction into ``work``: into ``buffer`` where ``work`` was a
    float32 copy (``back``), and into ``tensor`` where ``buffer`` was a
    contiguous copy of it."""
    if back is not None:
        buffer.copy_(work)
    if buffer is not tensor:
        tensor.copy_(buffer)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _split(data: Any, sizes: Any) -> list[Any]:
    out, at = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[at : at + n].tobytes()))
        at += n
    return out
