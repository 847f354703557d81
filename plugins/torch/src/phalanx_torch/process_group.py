"""A ``torch.distributed.ProcessGroup`` over any phalanx :class:`~phalanx_core.Collective`.

DDP's gradient buckets, FSDP2's all-gathers and reduce-scatters, DeviceMesh
and DTensor all talk through a ``ProcessGroup``. :class:`CollectiveProcessGroup`
is one (a Python subclass, as torch's own ``test_c10d_pypg.py`` and torchft
write them) whose every operation is a call of the collective's contract
operations, so the collective a user names carries that traffic too::

    pg = CollectiveProcessGroup(strategy.collective).register()
    model = DistributedDataParallel(model, process_group=pg)
    fully_shard(model, mesh=pg.device_mesh("cpu"))

How a call maps onto the contract:

* reductions take torch's ``ReduceOp`` by name (``SUM`` -> ``"sum"``,
  ``AVG`` -> ``"mean"``, ``MIN``, ``MAX``, ``PRODUCT``); ``PREMUL_SUM(f)``
  is a ``"sum"`` whose result is multiplied by ``f``. Bitwise ops refuse.
* torch's flat all-gathers and reduce-scatters (FSDP's, for every layer)
  are the contract's ``all_gather_into`` / ``reduce_scatter_into``: the
  collective writes into torch's buffer (a collective that does not
  override them pays one copy, made by the contract's defaults). The list
  forms (``allgather``, ``alltoall``) copy the contract's new tensors into
  torch's outputs.
* an operation that is one contract operation with nothing to do after it,
  on a collective whose handle gives the backend's own work
  (:meth:`phalanx_core.Work.backend_work`: the torch collective's, and any
  collective built on it), returns that ``torch.distributed.Work`` itself:
  DDP's reducer and FSDP then wait on c10d's future, as over torch's own
  group.
* ``all_to_all_single`` with split sizes: the contract's ``all_to_all``
  receives from each rank a tensor shaped as the one sent to it, so uneven
  splits are padded to the largest split of any rank, which costs one small
  extra ``all_reduce`` ("max") per call.
* every operation starts the contract's operation with ``async_op=True``
  where the contract has it (``send`` / ``recv`` are synchronous there) and
  returns a :class:`torch.distributed.Work`. Its future completes
  with what torch's backends give (the list of output tensors, ``[bucket]``
  for DDP's comm hook) once the collective's handles are done and the
  results copied out: by the caller's own ``wait()``; or, for a caller that
  only watches the future (DDP's reducer, which overlaps its bucket
  all-reduces with the backward pass), by the handles themselves where they
  notify (``Work.on_done``: the torch collective's, through c10d's futures,
  with no thread in between); else (mpi, horovod) in the call that started
  the operation, or, with ``overlap=True``, by one thread per group that
  waits on them in the order they were started. Errors
  reach ``wait()`` with their own type, and the future as a torch error.

torch's Python helpers (``get_rank(group)``, ``broadcast(src=)``,
``DeviceMesh.from_group``, functional collectives) look groups up in
torch's own registry: :meth:`CollectiveProcessGroup.register` puts the group
there (and ``register(as_world=True)`` in the default group's place, where
torch has none). Importing this module imports torch.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from phalanx_core import Collective, MisconfigurationError, Work

from ._torch_private import enter_group
from ._torch_versions import premul_sum_factor

__all__ = ["CollectiveProcessGroup"]

#: torch's ReduceOp (by its name) -> the contract's.
_OPS = {"SUM": "sum", "AVG": "mean", "MIN": "min", "MAX": "max", "PRODUCT": "product", "PREMUL_SUM": "sum"}
_NAMES = itertools.count()
#: The options of an operation that completed in the call (send, recv).
_DONE = SimpleNamespace(asyncOp=False)
#: The group a backend registered by ``register(as_world=True)`` makes
#: (by the backend's lower-case name), while ``init_process_group`` asks.
_MADE: dict[str, CollectiveProcessGroup] = {}


def _made_group(store: Any, rank: int, size: int, timeout: Any) -> CollectiveProcessGroup:
    """The maker of a backend registered by ``register(as_world=True)``:
    the group being registered (torch's ``init_process_group`` takes a
    ``ProcessGroup`` its maker gives as the group itself)."""
    groups = list(_MADE.values())
    if len(groups) != 1:
        raise MisconfigurationError(
            "torch asked the backend of phalanx's CollectiveProcessGroup for a new group (new_group() "
            "or init_process_group() with it, or a group over the default group, which is phalanx's): "
            "it makes none of its own. Give new_group a backend of torch's (backend='gloo' or "
            "'nccl'), or make the group from the collective: "
            "CollectiveProcessGroup(collective.new_group(ranks)).register()"
        )
    return groups[0]


#: A started contract operation: what completes it, and its handle.
_Started = tuple[Callable[[], Any], Any]


class _Failed:
    """What an operation's inner future holds when the operation failed."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(future: torch.futures.Future[Any]) -> Any:
    value = future.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class _Op:
    """One started operation: ``finish`` (wait on the collective's handles,
    copy into torch's outputs) runs once, in whichever thread claims it
    first, and completes ``inner`` with its result or a :class:`_Failed`.
    ``watched``: something will run it without anyone waiting (the group's
    thread, or the handles' ``on_done`` callbacks)."""

    __slots__ = ("_claimed", "_finish", "_lock", "handles", "inner", "watched")

    def __init__(self, finish: Callable[[], Any], handles: Sequence[Any]) -> None:
        self._finish = finish
        self._lock = threading.Lock()
        self._claimed = False
        self.handles = handles
        self.watched = False
        self.inner: torch.futures.Future[Any] = torch.futures.Future()

    def run(self) -> None:
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        try:
            value = self._finish()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            value = _Failed(exc)
        self.inner.set_result(value)

    def notify_when_done(self) -> bool:
        """Have the handles call :meth:`run` when the last of them is done,
        where every one of them can notify (``Work.on_done``); ``False``
        where one cannot (nothing is then registered)."""
        handles = [h for h in self.handles if h is not None]
        if not all(getattr(type(h), "on_done", Work.on_done) is not Work.on_done for h in handles):
            return False
        left = [len(handles)]
        lock = threading.Lock()

        def one_done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.run()

        if not handles:
            self.run()
        # One that said it could and then could not: the thread waits for all.
        return all(h.on_done(one_done) for h in handles)


class _FutureWork(dist.Work):
    """A torch ``Work`` done when its operation is.

    Two futures: the operation's inner one, completed with the result or a
    :class:`_Failed`, and the one torch's C++ code gets (``get_future()``),
    chained on it. A failure must reach that one as an error raised in a
    callback, never through ``Future.set_exception``: a future failed from
    Python crashes DDP's reducer (SIGSEGV, torch 2.13) when it reads the
    error. ``wait()`` runs the operation's ``finish`` in the waiting thread
    if the group's thread has not started it yet (no hand-over for callers
    that wait at once: FSDP on the CPU, DTensor, ``async_op=False``), and
    raises the operation's own error, its type kept (CollectiveTimeoutError);
    a ``Work`` made by ``_create_work_from_future`` would return ``True``
    over a failure.
    """

    def __init__(self, op: _Op, completer: _Completer) -> None:
        super().__init__()
        self._op = op
        self._completer = completer
        self._future = op.inner.then(_unwrap)

    def wait(self, timeout: Any = None) -> bool:
        self._op.run()
        value = self._op.inner.wait()
        if isinstance(value, _Failed):
            raise value.error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        self._completer.watch(self._op)
        return self._future

    def is_completed(self) -> bool:
        return self._op.inner.done()

    def is_success(self) -> bool:
        return self._op.inner.done() and not isinstance(self._op.inner.value(), _Failed)


class _Completer:
    """Completes the operations whose callers only watch the future (DDP's
    reducer): through the collective's handles where they notify
    (``Work.on_done``: no thread in between); else, with ``overlap``, by one
    daemon thread that runs each operation's ``finish`` in the order they
    were started, and without it, at once, in the thread that started it."""

    def __init__(self, name: str, *, overlap: bool) -> None:
        self._name = name
        self._overlap = overlap
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, finish: Callable[[], Any], handles: Sequence[Any], *, eager: bool) -> _FutureWork:
        op = _Op(finish, handles)
        if eager:
            self.watch(op)
        return _FutureWork(op, self)

    def watch(self, op: _Op) -> None:
        """Make sure ``op`` completes without anyone calling ``wait()``."""
        if op.watched:
            return
        op.watched = True
        if op.notify_when_done():
            return
        if not self._overlap:
            op.run()
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(op)

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            op.run()

    def close(self, *, wait: float = 60.0) -> None:
        """Stop the thread once it has finished what it was given, and wait
        for it (at most ``wait`` seconds): a thread still completing a
        future while the interpreter finalizes is ended by Python inside
        torch's code, which aborts the process (SIGABRT after the work was
        done)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait)


def _wait(handles: Sequence[Any]) -> list[Any]:
    return [h.wait() for h in handles]


class CollectiveProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` whose operations are the
    operations of ``collective`` (any object meeting phalanx's Collective
    contract, already set up). Its ranks are the collective's.

    Args:
        collective: the collective that carries every byte.
        name: the group's name in torch's registry (:meth:`register`);
            ``"phalanx:<collective name>:<n>"`` by default.
        overlap: for a collective whose handles cannot notify
            (``Work.on_done``: mpi's, horovod's), whether a thread of the
            group's waits on them, so that DDP's backward pass goes on while
            its buckets are reduced (``True``), or each operation completes
            in the call that started it (``False``, the default). The
            waiting thread polls the handles (MPI progresses only while
            asked), so it takes a core from the computation, and gives back
            more where one is free for it (``bench/train_step.py
            --collective``; its figures in bench/README.md). Give ``True``
            where a core is free for it.
            Handles that notify (the torch collective's) overlap either way.
    """

    def __init__(self, collective: Collective, *, name: str | None = None, overlap: bool = False) -> None:
        if not collective.is_initialized:
            raise MisconfigurationError(
                f"CollectiveProcessGroup({collective!r}): the collective is not set up; call "
                "collective.setup(...) first (strategy.collective is, inside strategy.launch(fn))"
            )
        if not isinstance(overlap, bool):
            raise MisconfigurationError(
                f"CollectiveProcessGroup(overlap={overlap!r}): give True (a thread of the group's waits "
                "on the handles) or False (each operation completes in its call)"
            )
        super().__init__(collective.rank, collective.world_size)  # type: ignore[call-arg]
        self._collective = collective
        #: the same, for the calls: an async call returns a Work, which the
        #: contract's return types (``Tensor | Work``) do not narrow.
        self._c: Any = collective
        self._group_name = name or f"phalanx:{collective.name}:{next(_NAMES)}"
        self._completer = _Completer(f"phalanx-pg-{self._group_name}", overlap=overlap)
        self._registered = False

    @property
    def collective(self) -> Collective:
        """The collective under this group."""
        return self._collective

    # -- identity ----------------------------------------------------------

    def getBackendName(self) -> str:
        return f"phalanx-{self._collective.name}"

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_desc(self) -> str:
        return f"phalanx collective {self._collective.name!r}"

    def register(self, *, as_world: bool = False) -> CollectiveProcessGroup:
        """Enter this group in torch's registry, as ``new_group`` does for
        its groups, so that torch's helpers accept it: ``get_rank(group)``,
        ``broadcast(src=...)`` (global ranks), ``DeviceMesh.from_group``,
        functional collectives and DTensor. Returns the group.

        ``as_world=True`` also makes it torch's default group, where there
        is none (the collective is not torch's: MPI, Horovod, a third
        party's): ``DeviceMesh`` asks the default group for this process's
        rank, and code that passes no group then talks through this one.
        """
        if as_world:
            if dist.is_initialized() and dist.group.WORLD is not self:
                raise MisconfigurationError(
                    f"{self!r}.register(as_world=True): torch already has a default process group "
                    f"({dist.group.WORLD!r}); use it, or register this one without as_world"
                )
            if self._collective.global_ranks != tuple(range(self._collective.world_size)):
                raise MisconfigurationError(
                    f"{self!r}.register(as_world=True): the world group must hold every rank in "
                    f"order; this collective's ranks are {list(self._collective.global_ranks)}"
                )
            if not dist.is_initialized():
                self._take_worlds_place()
        if not self._registered:
            ranks = {world: mine for mine, world in enumerate(self._collective.global_ranks)}
            enter_group(self, self.getBackendName(), dist.HashStore(), self._group_name, ranks)  # type: ignore[attr-defined]
            self._registered = True
        return self

    def _take_worlds_place(self) -> None:
        """Make this group torch's default one, by torch's public route: a
        backend registered under this group's backend name whose maker
        gives this group, and ``init_process_group`` with it (which names
        the group as torch names its default one, and registers it)."""
        if os.environ.get("TORCH_DIST_INIT_BARRIER") == "1":
            raise MisconfigurationError(
                f"{self!r}.register(as_world=True): TORCH_DIST_INIT_BARRIER=1 makes "
                "init_process_group wait for every rank in a store, and this group has none that the "
                "ranks share (its collective carries everything); unset it"
            )
        backend = self.getBackendName()
        _MADE[backend.lower()] = self
        if backend.lower() not in dist.Backend.backend_list:
            dist.Backend.register_backend(backend, _made_group, devices=["cpu", "cuda"])
        hook = sys.excepthook
        try:
            dist.init_process_group(
                backend,
                store=dist.HashStore(),  # type: ignore[attr-defined]
                rank=self._collective.rank,
                world_size=self._collective.world_size,
            )
        finally:
            _MADE.pop(backend.lower(), None)
            # init_process_group marks tracebacks with "[rankN]: "; the
            # collective's launcher marks its ranks' lines already.
            sys.excepthook = hook
        self._registered = True

    def device_mesh(self, device_type: str) -> Any:
        """A one-dimensional ``DeviceMesh`` over this group (registered
        first), for ``fully_shard(mesh=...)`` and DTensor.

        Its dimension is named after the group: DeviceMesh equality ignores
        the process group, so a mesh over the same ranks and device built
        on torch's own group would otherwise compare equal to this one, and
        DTensor's caches (sharding propagation, redistribute plans) would
        hand one mesh's DTensors the other's group."""
        from torch.distributed.device_mesh import DeviceMesh

        self.register()
        return DeviceMesh.from_group(self, device_type, mesh_dim_names=(self._group_name,))

    def unregister(self) -> None:
        """Take this group out of torch's registry and stop its thread:
        ``dist.destroy_process_group(group)``; for a group in the default
        group's place, ``dist.destroy_process_group()``, which ends every
        group torch has (as it does over torch's own default group)."""
        self._completer.close()
        if not self._registered:
            return
        self._registered = False
        if dist.is_initialized() and dist.group.WORLD is self:
            dist.destroy_process_group()
            return
        with contextlib.suppress(ValueError):  # gone already: the world's end ended it
            dist.destroy_process_group(self)

    def shutdown(self) -> None:
        """Stop the group's thread (``destroy_process_group(group)`` calls
        it, then takes the group out of torch's registry itself)."""
        self._completer.close()

    def abort(self) -> None:
        self._completer.close()

    # -- helpers -----------------------------------------------------------

    def _start(self, finish: Callable[[], Any], opts: Any, handles: Sequence[Any] = ()) -> _FutureWork:
        """The Work of an operation started; ``finish`` completes it. The
        group's thread runs it for an asynchronous call (``opts.asyncOp``,
        as torch's Python API sets it, and true in C++ callers' options);
        a synchronous caller waits at once and runs it itself, so it is
        handed to the thread only if someone asks for the future."""
        return self._completer.submit(finish, handles, eager=bool(getattr(opts, "asyncOp", True)))

    @staticmethod
    def _native(handles: Sequence[Any]) -> dist.Work | None:
        """The c10d work of an operation made of one contract operation
        with nothing to do after it, where the collective's handle gives it
        (:meth:`~phalanx_core.Work.backend_work`): torch then waits on c10d
        directly, as over its own group."""
        if len(handles) != 1:
            return None
        backend_work = getattr(handles[0], "backend_work", None)
        work = backend_work() if backend_work is not None else None
        return work if isinstance(work, dist.Work) else None

    def _start_all(self, started: Sequence[_Started], opts: Any) -> _FutureWork:
        """:meth:`_start` of several operations, done when all are."""
        return self._start(lambda: [finish() for finish, _ in started], opts, [h for _, h in started])

    def _op(self, opts: Any) -> tuple[str, float | None]:
        """The contract's op name, and the factor to multiply the result by
        (PREMUL_SUM)."""
        reduce_op = getattr(opts, "reduceOp", opts) if opts is not None else dist.ReduceOp.SUM
        kind = getattr(reduce_op, "op", reduce_op)
        kind_name = getattr(kind, "name", str(kind))
        name = _OPS.get(kind_name)
        if name is None:
            raise MisconfigurationError(
                f"{self.getBackendName()}: torch asked for ReduceOp.{kind_name}, which the Collective "
                f"contract has no name for; it has {', '.join(sorted(set(_OPS.values())))} "
                "(SUM, AVG, MIN, MAX, PRODUCT, PREMUL_SUM)"
            )
        if kind_name != "PREMUL_SUM":
            return name, None
        factor = premul_sum_factor(reduce_op)
        if factor is None:
            raise MisconfigurationError(
                f"{self.getBackendName()}: torch asked for ReduceOp.PREMUL_SUM, whose factor this "
                f"torch ({torch.__version__}) does not let Python read, so it cannot be carried "
                "over a Collective (torch 2.13 and later can). Reduce with SUM or AVG, or upgrade torch"
            )
        return name, factor

    @staticmethod
    def _tensors(tensors: Any) -> list[torch.Tensor]:
        return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)

    # -- reductions --------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors_: list[torch.Tensor] = self._tensors(tensors)
        op, factor = self._op(opts)
        handles = [self._c.all_reduce(t, op, async_op=True) for t in tensors_]
        native = self._native(handles) if factor is None else None
        if native is not None:
            return native

        def finish() -> list[torch.Tensor]:
            _wait(handles)
            if factor is not None:
                for t in tensors_:
                    t.mul_(factor)
            return tensors_

        return self._start(finish, opts, handles)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors_: list[torch.Tensor] = self._tensors(tensors)
        op, factor = self._op(opts)
        root = getattr(opts, "rootRank", 0)
        handles = [self._c.reduce(t, root, op, async_op=True) for t in tensors_]

        def finish() -> list[torch.Tensor]:
            _wait(handles)
            if factor is not None and self._collective.rank == root:
                for t in tensors_:
                    t.mul_(factor)
            return tensors_

        return self._start(finish, opts, handles)

    def _reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> _Started:
        op, factor = self._op(opts)
        handle = self._c.reduce_scatter_into(output, input, op, async_op=True)

        def finish() -> torch.Tensor:
            handle.wait()
            if factor is not None:
                output.mul_(factor)
            return output

        return finish, (handle, factor)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        finish, (handle, factor) = self._reduce_scatter_into(output, input, opts)
        native = self._native([handle]) if factor is None else None
        if native is not None:
            return native
        return self._start(lambda: [finish()], opts, [handle])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        started = [self._reduce_scatter_into(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._start_all([(finish, handle) for finish, (handle, _) in started], opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def reduce_scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        # One stacked copy of the inputs: the contract reduces one tensor.
        started = [
            self._reduce_scatter_into(o, torch.stack(list(ins)), opts)
            for o, ins in zip(self._tensors(outputs), input_lists, strict=True)
        ]
        return self._start_all([(finish, handle) for finish, (handle, _) in started], opts)

    # -- gathers -------------------------------------------------------------

    def _all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> _Started:
        handle = self._c.all_gather_into(output, input, async_op=True)
        return (lambda: (handle.wait(), output)[1]), handle

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        finish, handle = self._all_gather_into(output, input)
        native = self._native([handle])
        if native is not None:
            return native
        return self._start(lambda: [finish()], opts, [handle])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        started = [self._all_gather_into(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._start_all(started, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def allgather(self, output_lists: Any, inputs: Any, opts: Any = None) -> dist.Work:
        inputs = self._tensors(inputs)
        if output_lists and isinstance(output_lists[0], torch.Tensor):
            output_lists = [output_lists]
        handles = [self._c.all_gather(t, async_op=True) for t in inputs]

        def finish() -> list[torch.Tensor]:
            for outs, parts in zip(output_lists, _wait(handles), strict=True):
                for out, part in zip(outs, parts, strict=True):
                    out.copy_(part)
            return [t for outs in output_lists for t in outs]

        return self._start(finish, opts, handles)

    def allgather_coalesced(self, output_lists: Any, inputs: Any, opts: Any = None) -> dist.Work:
        # torch's layout: output_lists[rank][i] is that rank's inputs[i].
        handles = [self._c.all_gather(t, async_op=True) for t in inputs]

        def finish() -> list[torch.Tensor]:
            for i, parts in enumerate(_wait(handles)):
                for rank, part in enumerate(parts):
                    output_lists[rank][i].copy_(part)
            return [t for outs in output_lists for t in outs]

        return self._start(finish, opts, handles)

    def gather(self, output_lists: Any, inputs: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = getattr(opts, "rootRank", 0)
        handle = self._c.gather(self._tensors(inputs)[0], root, async_op=True)

        def finish() -> list[torch.Tensor]:
            parts = handle.wait()
            outs = list(output_lists[0]) if output_lists else []
            for out, part in zip(outs, parts, strict=True):
                out.copy_(part)
            return outs

        return self._start(finish, opts, [handle])

    def scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = getattr(opts, "rootRank", 0)
        output = self._tensors(outputs)[0]
        chunks = list(input_lists[0]) if self._collective.rank == root and input_lists else None
        handle = self._c.scatter(output, chunks, root, async_op=True)
        return self._start(lambda: [handle.wait()], opts, [handle])

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = self._tensors(tensors)
        root = getattr(opts, "rootRank", 0)
        handles = [self._c.broadcast(t, root, async_op=True) for t in tensors]
        native = self._native(handles)
        if native is not None:
            return native
        return self._start(lambda: (_wait(handles), tensors)[1], opts, handles)

    # -- all to all ----------------------------------------------------------

    def _all_to_all(self, sends: list[torch.Tensor], receive_rows: list[int] | None) -> _Started:
        """Start the contract's all_to_all of ``sends``; ``finish()`` returns
        what each rank sent. ``receive_rows``: the rows (dim 0) to receive
        from each rank where they may differ from the rows sent to it; the
        chunks then travel padded to the largest of any rank."""
        if receive_rows is None:
            handle = self._c.all_to_all(sends, async_op=True)
            return handle.wait, handle
        longest = torch.tensor([max([*receive_rows, *(s.shape[0] for s in sends), 0])], dtype=torch.int64)
        rows = int(self._c.all_reduce(longest.to(sends[0].device), "max").item())
        padded = []
        for s in sends:
            p = s.new_zeros((rows, *s.shape[1:]))
            p[: s.shape[0]].copy_(s)
            padded.append(p)
        handle = self._c.all_to_all(padded, async_op=True)
        return lambda: [r[:n] for r, n in zip(handle.wait(), receive_rows, strict=True)], handle

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> dist.Work:
        size = self._collective.world_size
        # Split sizes given (by every rank, as torch's callers do): padded.
        uneven = bool(output_split_sizes) or bool(input_split_sizes)
        ins = list(input_split_sizes) or [input.shape[0] // size] * size
        outs = list(output_split_sizes) or [output.shape[0] // size] * size
        received, handle = self._all_to_all(list(torch.split(input, ins)), outs if uneven else None)

        def finish() -> list[torch.Tensor]:
            for chunk, part in zip(torch.split(output, outs), received(), strict=True):
                chunk.copy_(part)
            return [output]

        return self._start(finish, opts, [handle])

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        # Flattened, each padded to the longest of any rank: whether the
        # shapes differ is known to each rank only for itself, and every
        # rank must take the same path.
        received, handle = self._all_to_all([i.reshape(-1) for i in inputs], [o.numel() for o in outputs])

        def finish() -> list[torch.Tensor]:
            for out, part in zip(outputs, received(), strict=True):
                out.copy_(part.view(out.shape))
            return list(outputs)

        return self._start(finish, opts, [handle])

    # -- the rest ----------------------------------------------------------

    def barrier(self, opts: Any = None) -> dist.Work:
        handle = self._c.barrier(async_op=True)
        return self._start(lambda: (handle.wait() if handle is not None else None, [])[1], opts, [handle])

    def send(self, tensors: Any, dst_rank: int, tag: int = 0) -> dist.Work:
        # The contract's send is synchronous: it returns once sent.
        tensors = self._tensors(tensors)
        for t in tensors:
            self._c.send(t, dst_rank, tag=tag)
        return self._start(lambda: tensors, _DONE)

    def recv(self, tensors: Any, src_rank: int, tag: int = 0) -> dist.Work:
        tensors = self._tensors(tensors)
        for t in tensors:
            self._c.recv(t, src_rank, tag=tag)
        return self._start(lambda: tensors, _DONE)

    def __repr__(self) -> str:
        return f"CollectiveProcessGroup({self._collective!r}, name={self._group_name!r})"
