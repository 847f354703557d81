"""The ``horovod`` collective: the phalanx Collective contract over
``horovod.torch``.

What maps to what:

- ``all_reduce``: ``hvd.allreduce_async_`` in place, with ``Sum``, ``Min``,
  ``Max``, ``Product``, and ``Average`` for a floating-point ``"mean"``
  (an integer mean is a sum, then a floor division); ``"adasum"`` is
  Horovod's Adasum (floating point, the whole world, a power-of-2 number
  of ranks, and Horovod running over MPI: refused otherwise).
- ``all_gather``: ``hvd.allgather_async``; first dimensions may differ
  between ranks, as Horovod allows (their sizes travel with the data).
  ``gather`` is ``all_gather`` returning on ``dst`` only.
- ``broadcast``: ``hvd.broadcast_async_``; ``reduce``: an all-reduce.
- ``all_to_all``: ``hvd.alltoall_async`` with splits (first dimensions may
  differ); ``scatter``: the same, with only ``src`` sending rows.
- ``reduce_scatter``: ``hvd.reducescatter_async`` for ``"sum"`` and
  ``"mean"`` (Gloo's reduce-scatter only sums); ``"min"``, ``"max"`` and
  ``"product"`` all-reduce and keep this rank's slice.
- ``barrier``: a one-element all-reduce (one that can time out; Horovod's
  own ``hvd.barrier`` cannot).
- Object operations: pickled to uint8 tensors, then the operations above.
- ``new_group``: a Horovod process set (``hvd.add_process_set``), which
  every process of the job must add; so only the world collective makes
  subgroups.
- ``send`` / ``recv``: refused (:class:`~phalanx_core.UnavailableError`):
  Horovod has no point-to-point operation, and building one from a
  collective would need every rank to take part.

Every synchronous call is Horovod's asynchronous one, polled until the
collective's timeout (Horovod has no timeout of its own). Horovod cannot
cancel an operation, so after a :class:`~phalanx_core.CollectiveTimeoutError`
Horovod is unusable in this process until ``teardown`` shuts it down.

Each operation is named ``phalanx.<group>.<operation>.<n>``, counted per
group: Horovod matches operations across ranks by name, and the names it
would make itself count every operation of the process, which differ
between the members and the non-members of a subgroup.

Dtypes: Horovod moves uint8, int8, int16, int32, int64, float16, float32
and float64 CPU tensors and reduces int32, int64 and the floats. A bool
tensor moves as uint8 (and reduces as int32: ``"min"`` is a logical and,
``"max"`` a logical or); bfloat16 moves as its bits (int16) and reduces as
float32; int8/uint8/int16 reduce as int32.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from phalanx_core import MisconfigurationError, UnavailableError
from phalanx_core.collective import (
    DEFAULT_TIMEOUT,
    REDUCE_OPS,
    Collective,
    NonMember,
    Work,
    check_one_per_rank,
    check_rank,
    check_reduce_op,
    check_scatter_list,
    poll,
    timed_out,
)

from ._hvd import hvd, off_wire, on_wire

if TYPE_CHECKING:
    from phalanx_core import Accelerator, ClusterEnvironment, Launcher

__all__ = ["HorovodCollective"]

#: Seconds a pending operation is polled without sleeping (yielding only, as
#: Horovod's own ``synchronize`` waits), then seconds between polls.
_SPIN = 0.05
_POLL_SLEEP = 0.001
#: Whether phalanx initialised Horovod in this process. Horovod cannot be
#: initialised again in a process that horovodrun started (its Gloo rendezvous
#: happens once per process), so it stays initialised until the process exits
#: (``hvd.init`` registers ``hvd.shutdown`` at exit).
_initialised_here = False


class _HorovodWork(Work):
    """Pending Horovod handles; ``wait()`` polls them until the collective's
    timeout, then ``finish`` turns their outputs into what the synchronous
    call returns."""

    def __init__(
        self, owner: HorovodCollective, operation: str, handles: list[int], finish: Callable[[list[Any]], Any]
    ) -> None:
        self._owner = owner
        self._operation = operation
        self._handles = handles
        self._finish: Callable[[list[Any]], Any] | None = finish
        self._result: Any = None

    def wait(self) -> Any:
        if self._finish is not None:
            outputs = [self._owner._synchronize(h, self._operation) for h in self._handles]
            finish, self._finish = self._finish, None
            self._result = finish(outputs)
        return self._result

    def is_completed(self) -> bool:
        if self._finish is None:
            return True
        return all(hvd().poll(h) for h in self._handles)


class HorovodCollective(Collective):
    """The contract over ``horovod.torch`` (see the module's docstring for
    what maps to what).

    ``setup()`` calls ``hvd.init()`` (with dynamic process sets, for
    :meth:`new_group`), or uses the Horovod already initialised in this
    process, by an earlier set-up or by the user. ``teardown()`` does not
    shut Horovod down: under horovodrun a process cannot initialise Horovod
    twice, so it stays up until the process exits, when ``hvd.shutdown``
    (registered by ``hvd.init``) ends it on every rank. So that no rank
    ends it under the others' feet, ``teardown()`` waits for every rank (a
    barrier) where phalanx initialised Horovod, and removes the process
    sets it added; on the way out of an exception it returns at once (the
    process's exit then fails the peers' pending operations), and after a
    timeout it shuts Horovod down. Horovod finds its peers only through
    what ``horovodrun`` / ``horovod.run`` (the ``horovod`` launcher) set in
    each rank; in processes another launcher made it would form a world of
    one, so ``setup`` refuses when Horovod's world is not the environment's.

    Options:
        timeout: seconds an operation may take (polled; see the module).
    """

    name: ClassVar[str] = "horovod"
    #: None: Horovod's ranks are fixed at ``hvd.init()`` (elastic Horovod
    #: starts its workers again to change them), so a group of other
    #: members cannot be formed in place.
    fault_tolerance: ClassVar[frozenset[str]] = frozenset()
    reduce_ops: ClassVar[tuple[str, ...]] = (*REDUCE_OPS, "adasum")
    unsupported: ClassVar[frozenset[str]] = frozenset({"send", "recv"})

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout=timeout)
        self._initialized = False
        self._owns = False
        self._process_set: Any = None  # None: the global process set
        self._key = "w"
        self._rank = -1
        self._world_size = 0
        self._global_ranks: tuple[int, ...] = ()
        self._counter: Iterator[int] = itertools.count()
        self._groups: Iterator[int] = itertools.count()
        self._sets: dict[tuple[int, ...], Any] = {}
        self._is_world = True
        # Shared with the subgroups: after a timeout Horovod is unusable.
        self._state: dict[str, bool] = {"timed_out": False}

    # -- life cycle -------------------------------------------------------

    def check_accelerator(self, accelerator: Accelerator) -> None:
        """The CPU always; CUDA only where Horovod was built with GPU
        operations."""
        if accelerator.device_type == "cpu":
            return
        if accelerator.device_type == "cuda":
            if not hvd().nccl_built() and not hvd().cuda_built():
                raise MisconfigurationError(
                    "collective 'horovod' with accelerator 'cuda': this horovod was built without GPU "
                    "operations (hvd.nccl_built() and hvd.cuda_built() are false); use accelerator='cpu', "
                    "or rebuild horovod with HOROVOD_GPU_OPERATIONS=NCCL"
                )
            return
        raise MisconfigurationError(
            f"collective 'horovod' with accelerator {accelerator.name!r}: Horovod moves CPU and CUDA "
            "tensors only; use accelerator='cpu' or 'cuda', or another collective"
        )

    def check_launcher(self, launcher: Launcher, environment: ClusterEnvironment) -> None:
        """Ranks Horovod can join: started by this plugin's ``horovod``
        launcher, or by ``horovodrun`` (the ``horovod`` environment, where
        the launcher runs ``fn`` in place)."""
        from .environment import HorovodEnvironment
        from .launcher import HorovodLauncher

        if isinstance(launcher, HorovodLauncher) or isinstance(environment, HorovodEnvironment):
            return
        raise MisconfigurationError(
            f"collective 'horovod' with launcher {type(launcher).__name__}: Horovod finds its peers only "
            "in processes that horovodrun or horovod.run started; use launcher='horovod' (the default "
            "of strategy 'horovod'), or start the script with `horovodrun -np N python script.py`"
        )

    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        if self._initialized:
            return
        global _initialised_here
        h = hvd()
        if not h.is_initialized():
            h.init(process_sets="dynamic")
            _initialised_here = True
        # Horovod initialised by phalanx in this process (now or by an earlier
        # set-up) is this collective's to manage; one the user initialised is not.
        self._owns = _initialised_here
        size, rank = h.size(), h.rank()
        if size != environment.world_size or rank != environment.global_rank:
            raise MisconfigurationError(
                f"collective 'horovod': Horovod's world here is rank {rank} of {size}, but the "
                f"environment ({type(environment).__name__}) says rank {environment.global_rank} of "
                f"{environment.world_size}. Horovod finds its peers only in processes that horovodrun "
                "or horovod.run started; launch with launcher='horovod' (the default of strategy "
                "'horovod') or start the script with `horovodrun -np N python script.py`"
            )
        self._rank, self._world_size = rank, size
        self._global_ranks = tuple(range(size))
        self._initialized = True

    def teardown(self) -> None:
        if not self._is_world or not self._initialized:
            return
        try:
            self._leave()
        finally:
            self._sets.clear()
            self._initialized = False

    def _leave(self) -> None:
        h = hvd()
        if self._state["timed_out"]:
            h.shutdown()  # unusable now (see CollectiveTimeoutError); the job should end
            return
        if sys.exc_info()[0] is not None:
            return  # leaving on an exception: the process's exit shuts Horovod down, failing the peers
        from horovod.common.exceptions import HorovodInternalError  # type: ignore[import-not-found, import-untyped, unused-ignore]

        # A peer that shut Horovod down (it failed) leaves no one to wait for.
        with contextlib.suppress(HorovodInternalError):
            if self._owns and self._world_size > 1:
                # Horovod shuts down on every rank when one process exits:
                # wait for the ranks still working (in a subgroup, say).
                self.barrier()
            for process_set in self._sets.values():
                h.remove_process_set(process_set)

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

    # -- helpers -------------------------------------------------------------

    def _kw(self, operation: str) -> dict[str, Any]:
        """The name and process set of this group's next operation."""
        self._require_setup(operation)
        kw: dict[str, Any] = {"name": f"phalanx.{self._key}.{operation}.{next(self._counter)}"}
        if self._process_set is not None:
            kw["process_set"] = self._process_set
        return kw

    def _require_setup(self, operation: str) -> None:
        if not self._initialized:
            raise MisconfigurationError(
                f"{operation}() on the 'horovod' collective before setup(); call it inside "
                "strategy.launch(fn, ...), where the strategy has set the collective up"
            )

    def _synchronize(self, handle: int, operation: str) -> Any:
        """Poll ``handle`` until it is done or the timeout passes."""
        h = hvd()
        if not poll(lambda: bool(h.poll(handle)), self.timeout, spin=_SPIN, spin_nap=0.0, nap=_POLL_SLEEP):
            self._state["timed_out"] = True
            raise timed_out(
                "horovod",
                operation,
                self.timeout,
                where=f"rank {self._rank} of the group {list(self._global_ranks)}; Horovod cannot tell "
                "which rank did not call it",
                then="Horovod cannot cancel an operation, so it is unusable in this process now: end the "
                "job (teardown shuts Horovod down)",
            )
        return h.synchronize(handle)

    def _run(
        self, operation: str, handles: list[int], finish: Callable[[list[Any]], Any], async_op: bool
    ) -> Any:
        work = _HorovodWork(self, operation, handles, finish)
        return work if async_op else work.wait()

    def _reduce_op(self, op: str, tensor: Any) -> str:
        import torch

        name = check_reduce_op(op, self.reduce_ops, collective=self.name, is_bool=tensor.dtype is torch.bool)
        if name == "adasum":
            if not hvd().mpi_enabled():
                raise UnavailableError(
                    "op='adasum' on the 'horovod' collective: Horovod runs Adasum over MPI only, and this "
                    f"Horovod {'runs without MPI (gloo)' if hvd().mpi_built() else 'was built without MPI'}; "
                    "build horovod with HOROVOD_WITH_MPI=1 and start the job with horovodrun --mpi, or "
                    "use 'mean'"
                )
            if not tensor.is_floating_point():
                raise MisconfigurationError(
                    f"op='adasum' on a {tensor.dtype} tensor: Horovod's Adasum combines floating-point "
                    "gradients only; use 'sum' or 'mean' for this tensor"
                )
            if not self._is_world or self._world_size & (self._world_size - 1):
                raise MisconfigurationError(
                    f"op='adasum' on a group of {self._world_size} rank(s) "
                    f"{'(a subgroup)' if not self._is_world else ''}: Horovod's Adasum on the CPU runs "
                    "on the whole world and on a power-of-2 number of ranks only; use 'mean', or run "
                    "on 1, 2, 4, 8... ranks"
                )
        return name

    def _hvd_op(self, name: str, tensor: Any) -> Any:
        h = hvd()
        if name == "mean":
            return h.Average if tensor.is_floating_point() else h.Sum
        return {"sum": h.Sum, "min": h.Min, "max": h.Max, "product": h.Product, "adasum": h.Adasum}[name]

    def _unsupported_dtype(self, operation: str, tensor: Any, exc: Exception) -> Exception:
        return MisconfigurationError(
            f"{operation}() on the 'horovod' collective with a {tensor.dtype} tensor on "
            f"{tensor.device}: Horovod cannot move it ({exc}); it moves CPU tensors of uint8, int8, int16, "
            "int32, int64, float16, float32, float64 (bool and bfloat16 converted); convert the tensor"
        )

    # -- tensor operations -------------------------------------------------

    def barrier(self, *, async_op: bool = False) -> Work | None:
        import torch

        token = torch.zeros(1, dtype=torch.int32)
        handle = hvd().allreduce_async_(token, op=hvd().Sum, **self._kw("barrier"))
        work = _HorovodWork(self, "barrier", [handle], lambda _: None)
        if async_op:
            return work
        work.wait()
        return None

    def broadcast(self, tensor: Any, src: int = 0, *, async_op: bool = False) -> Any:
        check_rank(src, self._world_size or 1, operation="broadcast", argument="src")
        wire = on_wire(tensor, reduce=False)
        try:
            handle = hvd().broadcast_async_(wire, root_rank=self._global_ranks[src], **self._kw("broadcast"))
        except ValueError as exc:
            raise self._unsupported_dtype("broadcast", tensor, exc) from exc

        def finish(_: list[Any]) -> Any:
            if wire.data_ptr() != tensor.data_ptr():
                tensor.copy_(off_wire(wire, tensor.dtype))
            return tensor

        return self._run("broadcast", [handle], finish, async_op)

    def all_reduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        name = self._reduce_op(op, tensor)
        return self._all_reduce(tensor, name, "all_reduce", async_op)

    def _all_reduce(self, tensor: Any, name: str, operation: str, async_op: bool) -> Any:
        wire = on_wire(tensor, reduce=True)
        try:
            handle = hvd().allreduce_async_(wire, op=self._hvd_op(name, wire), **self._kw(operation))
        except ValueError as exc:
            raise self._unsupported_dtype(operation, tensor, exc) from exc
        integer_mean = name == "mean" and not wire.is_floating_point()
        size = self._world_size

        def finish(_: list[Any]) -> Any:
            if integer_mean:
                wire.floor_divide_(size)
            if wire.data_ptr() != tensor.data_ptr() or wire.dtype is not tensor.dtype:
                tensor.copy_(off_wire(wire, tensor.dtype))
            return tensor

        return self._run(operation, [handle], finish, async_op)

    def reduce(self, tensor: Any, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        check_rank(dst, self._world_size or 1, operation="reduce", argument="dst")
        name = self._reduce_op(op, tensor)
        return self._all_reduce(tensor, name, "reduce", async_op)

    def all_gather(self, tensor: Any, *, async_op: bool = False) -> Any:
        return self._gather(tensor, None, "all_gather", async_op)

    def gather(self, tensor: Any, dst: int = 0, *, async_op: bool = False) -> Any:
        check_rank(dst, self._world_size or 1, operation="gather", argument="dst")
        return self._gather(tensor, dst, "gather", async_op)

    def _gather(self, tensor: Any, dst: int | None, operation: str, async_op: bool) -> Any:
        import torch

        scalar = tensor.dim() == 0
        wire = on_wire(tensor.reshape(1) if scalar else tensor, reduce=False)
        rows = torch.tensor([wire.shape[0]], dtype=torch.int64)
        try:
            handles = [
                hvd().allgather_async(rows, **self._kw(f"{operation}.rows")),
                hvd().allgather_async(wire, **self._kw(operation)),
            ]
        except ValueError as exc:
            raise self._unsupported_dtype(operation, tensor, exc) from exc
        rank, dtype = self._rank, tensor.dtype

        def finish(outputs: list[Any]) -> list[Any]:
            if dst is not None and rank != dst:
                return []
            sizes, data = outputs
            parts = torch.split(off_wire(data, dtype), sizes.tolist())
            return [p.reshape(()) if scalar else p for p in parts]

        return self._run(operation, handles, finish, async_op)

    def scatter(
        self,
        tensor: Any,
        scatter_list: Sequence[Any] | None = None,
        src: int = 0,
        *,
        async_op: bool = False,
    ) -> Any:
        import torch

        n = self._world_size or 1
        check_rank(src, n, operation="scatter", argument="src")
        if self._rank == src:
            chunks = check_scatter_list(scatter_list, tensor, n, src=src, dtype=True)
            send = torch.stack(chunks)
            splits = [1] * n
        else:
            send = tensor.new_empty((0, *tensor.shape))
            splits = [0] * n
        return self._alltoall(send, splits, "scatter", async_op, lambda out: tensor.copy_(out[0][0]))

    def _alltoall(
        self, send: Any, splits: list[int], operation: str, async_op: bool, finish: Callable[[Any], Any]
    ) -> Any:
        import torch

        dtype = send.dtype
        wire = on_wire(send, reduce=False)
        try:
            handle = hvd().alltoall_async(
                wire, splits=torch.tensor(splits, dtype=torch.int32), **self._kw(operation)
            )
        except ValueError as exc:
            raise self._unsupported_dtype(operation, send, exc) from exc

        def done(outputs: list[Any]) -> Any:
            data, received = outputs[0]
            return finish((off_wire(data, dtype), received.tolist()))

        return self._run(operation, [handle], done, async_op)

    def reduce_scatter(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        n = self._world_size or 1
        name = self._reduce_op(op, tensor)
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise MisconfigurationError(
                f"reduce_scatter() on the 'horovod' collective: the first dimension of a "
                f"{tuple(tensor.shape)} tensor does not divide among {n} rank(s); give a tensor whose "
                f"dim 0 is a multiple of {n}"
            )
        rows, rank = tensor.shape[0] // n, self._rank
        if name in ("sum", "mean"):
            wire = on_wire(tensor, reduce=True)
            if wire.data_ptr() == tensor.data_ptr():
                wire = wire.clone()  # Horovod reads the input while it runs; the contract leaves it as it is
            integer_mean = name == "mean" and not wire.is_floating_point()
            try:
                handle = hvd().reducescatter_async(
                    wire, op=self._hvd_op(name, wire), **self._kw("reduce_scatter")
                )
            except ValueError as exc:
                raise self._unsupported_dtype("reduce_scatter", tensor, exc) from exc

            def finish(outputs: list[Any]) -> Any:
                out = outputs[0]
                if integer_mean:
                    out = out.floor_divide(n)
                return off_wire(out, tensor.dtype)

            return self._run("reduce_scatter", [handle], finish, async_op)
        # Gloo's reduce-scatter only sums: all-reduce a copy, keep this rank's rows.
        copy = tensor.clone()
        work = self._all_reduce(copy, name, "reduce_scatter", async_op=True)
        return self._run(
            "reduce_scatter", [], lambda _: work.wait()[rank * rows : (rank + 1) * rows].clone(), async_op
        )

    def all_to_all(self, tensors: Sequence[Any], *, async_op: bool = False) -> Any:
        import torch

        n = self._world_size or 1
        check_one_per_rank(tensors, n, operation="all_to_all")
        first = tensors[0]
        if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in tensors):
            raise MisconfigurationError(
                "all_to_all() on the 'horovod' collective: the tensors must share their dtype and every "
                f"dimension but the first; got {[(tuple(t.shape), t.dtype) for t in tensors]}"
            )
        scalar = first.dim() == 0
        parts = [t.reshape(1, *t.shape) if scalar else t for t in tensors]
        send = torch.cat(parts) if parts else first.new_empty((0,))

        def finish(out: Any) -> list[Any]:
            data, received = out
            got = torch.split(data, received)
            return [g.reshape(()) if scalar else g for g in got]

        return self._alltoall(send, [p.shape[0] for p in parts], "all_to_all", async_op, finish)

    # send and recv: unsupported (see the module's docstring). Spelled out,
    # as core's NonMember does, so that type checkers see them implemented;
    # they refuse whatever they are given, as the base's refusals do.

    def send(self, *args: Any, **kwargs: Any) -> None:
        """Not available: Horovod has no point-to-point operation (raises
        :class:`~phalanx_core.UnavailableError`)."""
        raise self._refusal("send")

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: Horovod has no point-to-point operation (raises
        :class:`~phalanx_core.UnavailableError`)."""
        raise self._refusal("recv")

    # -- object operations ---------------------------------------------------

    @staticmethod
    def _to_bytes(obj: Any) -> Any:
        import torch

        return torch.frombuffer(
            bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
        )

    @staticmethod
    def _from_bytes(data: Any) -> Any:
        return pickle.loads(data.numpy().tobytes())

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import torch

        check_rank(src, self._world_size or 1, operation="broadcast_object", argument="src")
        data = self._to_bytes(obj) if self._rank == src else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self.broadcast(size, src)
        if self._rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast(data, src)
        return obj if self._rank == src else self._from_bytes(data)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [self._from_bytes(part) for part in self.all_gather(self._to_bytes(obj))]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        check_rank(dst, self._world_size or 1, operation="gather_object", argument="dst")
        return [self._from_bytes(part) for part in self.gather(self._to_bytes(obj), dst)]

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        import torch

        n = self._world_size or 1
        check_rank(src, n, operation="scatter_object", argument="src")
        if self._rank == src:
            if objs is None or len(objs) != n:
                raise MisconfigurationError(
                    f"scatter_object(src={src}) on the 'horovod' collective: rank {src} gives one object "
                    f"per rank ({n}); got {'None' if objs is None else f'{len(objs)}'}"
                )
            chunks = [self._to_bytes(o) for o in objs]
            send, splits = torch.cat(chunks), [c.numel() for c in chunks]
        else:
            send, splits = torch.empty(0, dtype=torch.uint8), [0] * n
        return self._alltoall(send, splits, "scatter_object", False, lambda out: self._from_bytes(out[0]))

    # -- groups --------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> Collective:
        self._require_setup("new_group")
        n = self._world_size
        given = list(ranks) if isinstance(ranks, (list, tuple, range)) else None
        if (
            not given
            or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n for r in given)
            or len(set(given)) != len(given)
        ):
            raise MisconfigurationError(
                f"new_group({ranks!r}) on the 'horovod' collective: give a non-empty list of distinct "
                f"ranks of this group (0..{n - 1})"
            )
        if not self._is_world:
            raise UnavailableError(
                f"new_group({ranks!r}) on a 'horovod' subgroup {list(self._global_ranks)}: Horovod adds a "
                "process set with every process of the job taking part, and only this subgroup's "
                "members call this; call new_group on the world collective with world ranks instead"
            )
        members = tuple(sorted(given))
        key = f"g{next(self._groups)}"
        if members == self._global_ranks:
            process_set = None  # the whole world: Horovod's global process set
        elif members in self._sets:
            process_set = self._sets[members]
        else:
            h = hvd()
            try:
                process_set = h.add_process_set(list(members))
            except (ValueError, RuntimeError) as exc:
                raise UnavailableError(
                    f"new_group({ranks!r}) on the 'horovod' collective: Horovod could not add the process "
                    f"set ({type(exc).__name__}: {exc}). Horovod adds process sets only when initialised "
                    "with process_sets='dynamic' (as this collective does); if you called hvd.init() "
                    "yourself, call hvd.init(process_sets='dynamic')"
                ) from exc
            self._sets[members] = process_set
        if self._rank not in members:
            return NonMember(members, parent=self.name, world_rank=self._rank)
        group = HorovodCollective(timeout=self.timeout)
        group._initialized = True
        group._is_world = False
        group._process_set = process_set
        group._key = key
        group._rank = members.index(self._rank)
        group._world_size = len(members)
        group._global_ranks = members
        group._state = self._state
        return group
