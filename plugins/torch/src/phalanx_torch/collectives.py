"""Collectives over torch tensors."""

from __future__ import annotations

import datetime
import inspect
import itertools
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from phalanx_core import (
    ClusterEnvironment,
    Collective,
    CollectiveConnectionError,
    CollectiveTimeoutError,
    CompletedWork,
    MisconfigurationError,
    NonMember,
    PlanMismatchError,
    UnavailableError,
    Work,
    check_into,
    check_one_per_rank,
    check_rank,
    check_reduce_op,
    check_scatter_list,
    plan_mismatch,
    timed_out,
)
from phalanx_core.accelerator import Accelerator
from phalanx_core.network import is_loopback

from . import _listen

#: c10d backends that move one kind of device's tensors only.
_DEVICE_ONLY = {"nccl": "cuda", "xccl": "xpu"}

#: Set by ``phalanx run``'s runner in the ranks whose every output line it
#: prefixes with the rank.
LINES_PREFIXED_VAR = "PHALANX_LINES_PREFIXED"

__all__ = ["SingleDeviceCollective", "TorchCollective"]


class SingleDeviceCollective(Collective):
    """A world of one process. Every operation meets the contract locally:
    reductions leave the tensor as it is, gathers return one-element lists of
    new tensors. ``send`` and ``recv`` have no peer and refuse with an error
    that says so. Nothing can block, so nothing times out.
    """

    name: ClassVar[str] = "single_device"

    def __init__(self, *, timeout: float = 1800.0) -> None:
        super().__init__(timeout=timeout)
        self._initialized = False

    def check_launcher(self, launcher: Any, environment: ClusterEnvironment) -> None:
        """A world of one: refused, when resolving, for a job of several
        processes (it would fail in each rank after they started)."""
        size = int(getattr(launcher, "num_processes", 1)) * int(getattr(launcher, "num_nodes", 1))
        if size > 1:
            raise MisconfigurationError(
                f"the 'single_device' collective is a world of one, but the job has {size} processes "
                f"({launcher.num_processes} per node on {launcher.num_nodes} node(s)); use a collective "
                "for several processes (collective='torch', the default of the parallel strategies)"
            )

    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        if environment.world_size != 1:
            raise MisconfigurationError(
                f"the 'single_device' collective is a world of one, but the environment has "
                f"world_size={environment.world_size}; use a collective for several processes "
                "(collective='torch')"
            )
        self._initialized = True

    def teardown(self) -> None:
        self._initialized = False

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def _done(self, result: Any, async_op: bool) -> Any:
        return CompletedWork(result) if async_op else result

    def _op(self, tensor: torch.Tensor, op: str) -> None:
        check_reduce_op(op, self.reduce_ops, collective=self.name, is_bool=tensor.dtype is torch.bool)

    def barrier(self, *, async_op: bool = False) -> Work | None:
        return CompletedWork() if async_op else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Any:
        check_rank(src, 1, operation="broadcast", argument="src")
        return self._done(tensor, async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Any:
        self._op(tensor, op)
        return self._done(tensor, async_op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        check_rank(dst, 1, operation="reduce", argument="dst")
        self._op(tensor, op)
        return self._done(tensor, async_op)

    def all_gather(self, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
        return self._done([tensor.clone()], async_op)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
        check_into(output, tensor, 1, operation="all_gather_into")
        output.view(-1).copy_(tensor.view(-1))
        return self._done(output, async_op)

    def gather(self, tensor: torch.Tensor, dst: int = 0, *, async_op: bool = False) -> Any:
        check_rank(dst, 1, operation="gather", argument="dst")
        return self._done([tensor.clone()], async_op)

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: Sequence[torch.Tensor] | None = None,
        src: int = 0,
        *,
        async_op: bool = False,
    ) -> Any:
        check_rank(src, 1, operation="scatter", argument="src")
        tensor.copy_(check_scatter_list(scatter_list, tensor, 1, src=src)[0])
        return self._done(tensor, async_op)

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Any:
        self._op(tensor, op)
        return self._done(tensor.clone(), async_op)

    def reduce_scatter_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False
    ) -> Any:
        check_into(output, tensor, 1, operation="reduce_scatter_into")
        self._op(tensor, op)
        output.view(-1).copy_(tensor.view(-1))
        return self._done(output, async_op)

    def all_to_all(self, tensors: Sequence[torch.Tensor], *, async_op: bool = False) -> Any:
        check_one_per_rank(tensors, 1, operation="all_to_all")
        return self._done([tensors[0].clone()], async_op)

    def _no_peer(self, operation: str, argument: str, value: int) -> MisconfigurationError:
        return MisconfigurationError(
            f"{operation}({argument}={value!r}): the 'single_device' collective is a world of one, "
            "so there is no other rank to talk to; point-to-point needs a collective over several "
            "processes (collective='torch')"
        )

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> None:
        raise self._no_peer("send", "dst", dst)

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> torch.Tensor:
        raise self._no_peer("recv", "src", src)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        check_rank(src, 1, operation="broadcast_object", argument="src")
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        check_rank(dst, 1, operation="gather_object", argument="dst")
        return [obj]

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        check_rank(src, 1, operation="scatter_object", argument="src")
        if objs is None or len(objs) != 1:
            raise MisconfigurationError(
                f"scatter_object(): the source rank gives one object per rank (1 here), got "
                f"{None if objs is None else len(objs)}"
            )
        return objs[0]

    def new_group(self, ranks: Sequence[int]) -> Collective:
        if list(ranks) != [0]:
            raise MisconfigurationError(
                f"new_group({list(ranks)!r}): the only rank of a 'single_device' world is 0, so the "
                "only group is [0]"
            )
        group = SingleDeviceCollective(timeout=self.timeout)
        group._initialized = True
        return group


#: Set-ups of a default group in this process; every rank counts the same.
_SETUPS = itertools.count()
_TIMED_OUT = re.compile(r"timed?[ _-]?out|failed to pass monitoredBarrier", re.IGNORECASE)
_UNREACHABLE = re.compile(
    r"(?P<what>Connection refused|No route to host|Network is unreachable|Host is unreachable)"
    r", remote=(?P<address>\[?[0-9a-fA-F:.]+\]?:\d+)",
    re.IGNORECASE,
)
_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class _TorchWork(Work):
    """A torch.distributed ``Work`` adapted to the contract: ``wait()``
    returns the operation's result, after any post-processing (the division
    of ``"mean"``), and raises CollectiveTimeoutError on a timeout."""

    def __init__(
        self,
        work: Any,
        result: Any,
        collective: TorchCollective,
        operation: str,
        finish: Callable[[], object] | None = None,
    ) -> None:
        self._work = work
        self._result = result
        self._collective = collective
        self._operation = operation
        self._finish = finish
        self._future: Any = None

    def wait(self) -> Any:
        try:
            future = self._future
            if future is not None and future.done():
                # Done, and maybe called from the future's own callback,
                # where torch's work.wait() would never return.
                future.value()
            else:
                self._work.wait()
        except RuntimeError as exc:
            raise self._collective._translate(exc, self._operation) from exc
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self._result

    def is_completed(self) -> bool:
        return bool(self._work.is_completed()) and self._finish is None

    def backend_work(self) -> Any:
        """c10d's own work where nothing is left to do after it (no
        ``"mean"`` division, no copy back)."""
        return self._work if self._finish is None else None

    def on_done(self, callback: Callable[[], object]) -> bool:
        """``callback()`` from the thread that completes c10d's future
        (gloo's worker, or here if it is done); ``False`` for a c10d work
        without a future (some of gloo's coalesced ones)."""
        try:
            future = self._work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            return False
        self._future = future
        future.then(lambda _: callback())
        return True


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
    """

    name: ClassVar[str] = "torch"

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

    # -- life cycle -------------------------------------------------------

    @staticmethod
    def _check_backend(name: str) -> str:
        backend = name.lower()
        known = [b for b in dist.Backend.backend_list if b != "undefined"]
        if backend not in known:
            raise MisconfigurationError(
                f"collective 'torch' with backend={name!r}: torch.distributed knows no such backend; "
                f"it has {', '.join(known)}. Register a third-party backend with "
                "torch.distributed.Backend.register_backend before resolving, or choose one of those"
            )
        available = {
            "gloo": dist.is_gloo_available,
            "nccl": dist.is_nccl_available,
            "mpi": dist.is_mpi_available,
        }
        if backend in available and not available[backend]():
            raise UnavailableError(
                f"collective 'torch' with backend={backend!r}: this torch build has no {backend} "
                f"backend ({torch.__version__}); "
                + (
                    "torch from PyPI has no MPI backend: use collective='mpi' (phalanx-mpi) for MPI, "
                    "or backend='gloo'"
                    if backend == "mpi"
                    else "install a torch build with it, or choose another backend"
                )
            )
        return backend

    def check_accelerator(self, accelerator: Accelerator) -> None:
        """The backend (``backend=``, else the accelerator's default) must
        exist in this torch build and use the accelerator's devices (nccl
        moves CUDA tensors only)."""
        backend = (self._backend_flag or accelerator.collective_backend or "gloo").lower()
        device = _DEVICE_ONLY.get(backend)
        if device is not None and accelerator.name != device:
            raise MisconfigurationError(
                f"collective 'torch' with backend={backend!r} and accelerator {accelerator.name!r}: "
                f"{backend} moves {device} tensors only; use backend='gloo' (the default for "
                f"{accelerator.name!r}), or accelerator={device!r}"
            )
        self._check_backend(backend)
        # What torch says each backend moves ({'gloo': ['cpu', 'cuda'], ...});
        # a backend a plugin registered without saying is taken at its word.
        capability = getattr(dist.Backend, "backend_capability", {})
        moves = capability.get(backend)
        if moves and accelerator.name not in moves:
            others = [b for b, m in capability.items() if accelerator.name in m and b != "fake"]
            cure = (
                f"use backend={others[0]!r}, which does"
                if others
                else "no backend of this torch does, so a parallel strategy cannot run on "
                f"{accelerator.name!r}: train on accelerator='cpu' (or 'cuda'), or use strategy "
                "'single_device' for one device"
            )
            raise MisconfigurationError(
                f"collective 'torch' with backend={backend!r} and accelerator {accelerator.name!r}: "
                f"torch.distributed's {backend} moves {' and '.join(moves)} tensors only; {cure}"
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
        else:
            backend = self._check_backend(
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
                if self.plan_facts is not None and size > 1:
                    seen_as = self._check_plan(store, environment, backend, network)
                    if network is not None and network.interface is None and seen_as:
                        # The main address leads to loopback here (this is
                        # its host, and its name maps to 127.0.1.1): take
                        # the interface that has the address the others use.
                        found = _listen.main_host_network(seen_as, backend)
                        if found is not None:
                            os.environ.update(found.variables)
                dist.init_process_group(
                    backend,
                    store=dist.PrefixStore(self._prefix, store),  # type: ignore[attr-defined]
                    rank=rank,
                    world_size=size,
                    timeout=timeout,
                    **_bound_device(backend),
                )
            except RuntimeError as exc:
                raise self._translate(exc, "setup") from exc
            self._owns = True
            if os.environ.get(LINES_PREFIXED_VAR):
                # init_process_group prefixes tracebacks with "[rankN]: "; the
                # runner (phalanx run) already prefixes every line.
                sys.excepthook = hook
        self._store_address = _tcp_address(dist.distributed_c10d._get_default_store())
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
            choice = _listen.choose_network(main_address, main_port, backend.lower(), self._interface)
        except ValueError as exc:
            return f"refused: {exc}"
        return choice.describe(backend.lower())

    def _network(self, environment: ClusterEnvironment, backend: str) -> _listen.Network:
        try:
            choice = _listen.choose_network(
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
        self, store: Any, environment: ClusterEnvironment, backend: str, network: _listen.Network | None
    ) -> str | None:
        """Compare the plans of every node through the rendezvous store,
        before the group is made: each node's local rank 0 posts its plan,
        global rank 0 compares them and posts the verdict, every rank reads
        it (a node whose plan differs would otherwise wait for its peers in
        other places, or forever). Returns the address the nodes whose
        route to the main address leaves their host reach it at, if any."""
        facts = {**(self.plan_facts or {}), "torch": torch.__version__, "c10d backend": backend}
        plans = dist.PrefixStore(f"{self._prefix}/plans", store)  # type: ignore[attr-defined]
        if environment.local_rank == 0:
            seen_as = network.main_seen_as if network is not None else None
            plans.set(f"node{environment.node_rank}", json.dumps({"facts": facts, "seen_as": seen_as}))
        if environment.global_rank == 0:
            nodes = int(facts.get("nodes", "1"))
            posts = {n: json.loads(plans.get(f"node{n}")) for n in range(nodes)}
            error = plan_mismatch({n: post["facts"] for n, post in posts.items()})
            seen = sorted({post["seen_as"] for post in posts.values() if post["seen_as"]})
            verdict: dict[str, Any] = {"seen_as": seen[0] if len(seen) == 1 else None}
            if error is not None:
                verdict.update(message=str(error), differences=error.differences)
            plans.set("verdict", json.dumps(verdict))
        verdict = json.loads(plans.get("verdict"))
        if "message" in verdict:
            differences = {
                name: {int(node): value for node, value in values.items()}
                for name, values in verdict["differences"].items()
            }
            raise PlanMismatchError(
                f"setup() on the 'torch' collective ({self._where(environment)}): {verdict['message']}",
                differences=differences,
            )
        self.plan_checked = True
        return verdict["seen_as"]  # type: ignore[no-any-return]

    def _where(self, environment: ClusterEnvironment | None = None) -> str:
        """This rank in words: ``gloo, rank 1 of 2`` (before its group is
        made, the environment's rank and its host's name)."""
        if self._initialized or environment is None:
            return f"{self._backend}, rank {self._rank} of {self._world_size}"
        rank = f"rank {environment.global_rank} of {environment.world_size}"
        return f"{self._backend_flag or 'gloo'}, {rank} on {socket.gethostname()}"

    def teardown(self) -> None:
        if self._owns and dist.is_initialized():
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

    def board(self) -> _StoreBoard | None:
        """A new client of the group's TCPStore (its own connection: the
        group's may be busy in a barrier), under this group's prefix."""
        if self._store_address is None:
            return None
        host, port = self._store_address
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, is_master=False, timeout=datetime.timedelta(seconds=30)
            )
        except (RuntimeError, ValueError):
            return None
        return _StoreBoard(dist.PrefixStore(f"{self._prefix}/hangs", store))  # type: ignore[attr-defined]

    @property
    def process_group(self) -> Any:
        """The torch ProcessGroup (``None`` for the default group), for code
        that calls torch.distributed itself."""
        return self._group

    # -- helpers -------------------------------------------------------------

    def _translate(self, exc: BaseException, operation: str) -> BaseException:
        message = str(exc)
        refused = _UNREACHABLE.search(message)
        where = self._where(self._environment)
        if refused:
            what, address = refused.group("what"), refused.group("address")
            host = address.rsplit(":", 1)[0].strip("[]")
            why = (
                f" {host} is a loopback address: the rank there listens where no other host reaches it "
                "(GLOO_SOCKET_IFNAME names a loopback interface there, or its host name maps to loopback "
                "and no interface was chosen). Give the collective interface= (or set GLOO_SOCKET_IFNAME) "
                "on every node: the interface that joins the nodes"
                if is_loopback(host)
                else " Check that the rank there is running, and that no firewall stands between the hosts"
            )
            return CollectiveConnectionError(
                f"{operation}() on the 'torch' collective ({where}) could not connect to another rank "
                f"at {address}: {what}.{why}",
                operation=operation,
            )
        if not _TIMED_OUT.search(message):
            return exc
        missing = _MISSING_RANKS.search(message)
        ranks = tuple(int(r) for r in missing.group(1).replace(" ", "").split(",") if r) if missing else None
        return timed_out(
            "torch",
            operation,
            self.timeout,
            where=where,
            then="raise timeout= if the work is just slow",
            missing_ranks=ranks or None,
        )

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
            return _TorchWork(work, result, self, operation, finish)
        if finish is not None:
            finish()
        return result

    # -- tensor operations -------------------------------------------------

    def barrier(self, *, async_op: bool = False) -> Work | None:
        try:
            if async_op:
                return _TorchWork(dist.barrier(group=self._group, async_op=True), None, self, "barrier")
            if self._backend == "gloo" and self._world_size > 1:
                start = time.monotonic()
                try:
                    dist.monitored_barrier(
                        group=self._group,
                        timeout=datetime.timedelta(seconds=self.timeout),
                        wait_all_ranks=True,
                    )
                except RuntimeError as exc:
                    raise self._left(exc, time.monotonic() - start) from exc
            else:
                dist.barrier(group=self._group)
        except RuntimeError as exc:
            raise self._translate(exc, "barrier") from exc
        return None

    def _left(self, exc: RuntimeError, waited: float) -> BaseException:
        """gloo's monitored barrier says "failed to pass ... in <timeout>"
        also when the missing ranks closed their connections long before
        (they exited): say that, instead of a timeout that did not happen."""
        translated = self._translate(exc, "barrier")
        if not isinstance(translated, CollectiveTimeoutError) or waited >= 0.9 * self.timeout:
            return translated
        ranks = translated.missing_ranks
        who = f"ranks {list(ranks)}" if ranks else "a rank"
        return CollectiveTimeoutError(
            f"barrier() on the 'torch' collective ({self._backend}, rank {self._rank} of {self._world_size}) "
            f"failed after {waited:.1f} s: {who} left without calling it (exited, or failed). Every rank "
            "calls barrier(), and every call that waits for the others: save_checkpoint and "
            "load_checkpoint too (an `if rank == 0: save` leaves the other ranks out)",
            operation="barrier",
            timeout=self.timeout,
            missing_ranks=ranks,
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Any:
        peer = self._peer(src, "broadcast", "src")
        try:
            work = dist.broadcast(tensor, peer, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "broadcast") from exc
        return self._done(work, tensor, async_op, "broadcast")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Any:
        reduce_op, target, finish = self._reduce(tensor, op)
        try:
            work = dist.all_reduce(target, reduce_op, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "all_reduce") from exc
        return self._done(work, tensor, async_op, "all_reduce", finish)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        peer = self._peer(dst, "reduce", "dst")
        reduce_op, target, finish = self._reduce(tensor, op)
        try:
            work = dist.reduce(target, peer, reduce_op, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "reduce") from exc
        return self._done(work, tensor, async_op, "reduce", finish if self._rank == dst else None)

    def all_gather(self, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
        out = [torch.empty_like(tensor) for _ in range(self._world_size)]
        try:
            work = dist.all_gather(out, tensor, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "all_gather") from exc
        return self._done(work, out, async_op, "all_gather")

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False) -> Any:
        check_into(output, tensor, self._world_size, operation="all_gather_into")
        try:
            # c10d splits the output along dimension 0 into the input's shape
            stacked = output.view(_stacked(tensor.shape, self._world_size))
            work = _all_gather_into(stacked, tensor, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, "all_gather_into") from exc
        return self._done(work, output, async_op, "all_gather_into")

    def gather(self, tensor: torch.Tensor, dst: int = 0, *, async_op: bool = False) -> Any:
        peer = self._peer(dst, "gather", "dst")
        out = [torch.empty_like(tensor) for _ in range(self._world_size)] if self._rank == dst else None
        try:
            work = dist.gather(tensor, out, dst=peer, group=self._group, async_op=async_op)
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
            work = dist.scatter(tensor, chunks, src=peer, group=self._group, async_op=async_op)
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
            work = _reduce_scatter(target, source, reduce_op, group=self._group, async_op=async_op)
        except RuntimeError as exc:
            raise self._translate(exc, operation) from exc
        return self._done(work, out, async_op, operation, finish)

    def all_to_all(self, tensors: Sequence[torch.Tensor], *, async_op: bool = False) -> Any:
        check_one_per_rank(tensors, self._world_size, operation="all_to_all")
        if self._all_to_all_in_one:
            return self._all_to_all_in_one_buffer(tensors, async_op)
        out = [torch.empty_like(t) for t in tensors]
        try:
            work = dist.all_to_all(out, list(tensors), group=self._group, async_op=async_op)
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
            work = dist.all_to_all_single(received, flat, sizes, sizes, group=self._group, async_op=async_op)
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
            dist.send(tensor, peer, group=self._group, tag=tag)
        except RuntimeError as exc:
            raise self._translate(exc, "send") from exc

    def recv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> torch.Tensor:
        peer = self._peer(src, "recv", "src")
        if src == self._rank:
            raise MisconfigurationError(f"recv(src={src}): a rank cannot receive from itself")
        try:
            dist.recv(tensor, peer, group=self._group, tag=tag)
        except RuntimeError as exc:
            raise self._translate(exc, "recv") from exc
        return tensor

    # -- object operations ---------------------------------------------------

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        peer = self._peer(src, "broadcast_object", "src")
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=peer, group=self._group)
        except RuntimeError as exc:
            raise self._translate(exc, "broadcast_object") from exc
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._world_size
        try:
            dist.all_gather_object(out, obj, group=self._group)
        except RuntimeError as exc:
            raise self._translate(exc, "all_gather_object") from exc
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        peer = self._peer(dst, "gather_object", "dst")
        out: list[Any] | None = [None] * self._world_size if self._rank == dst else None
        try:
            dist.gather_object(obj, out, dst=peer, group=self._group)
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
            dist.scatter_object_list(
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
        try:
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


# torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single.
def _stacked(shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The shape of ``world_size`` tensors of ``shape`` stacked along
    dimension 0, as c10d's flat all-gather and reduce-scatter want it."""
    return (world_size * shape[0], *shape[1:]) if len(shape) else (world_size,)


# torch 2.13 names them *_single (the old names warn); earlier torch, the old.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


class _StoreBoard:
    """:class:`phalanx_core.hangs.Board` over a c10d store."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def post(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def read(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode()

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def close(self) -> None:
        self._store = None


def _tcp_address(store: Any) -> tuple[str, int] | None:
    """The host and port of the TCPStore under ``store`` (through prefix
    stores), or None for another kind."""
    while store is not None:
        if isinstance(store, dist.TCPStore):  # type: ignore[attr-defined]
            return str(store.host), int(store.port)
        store = getattr(store, "underlying_store", None)
    return None


def _bound_device(backend: str) -> dict[str, Any]:
    """nccl's group bound to this rank's GPU (the strategy set it before the
    group is made), as torch asks: without it every ``barrier`` warns that
    it guesses the device. Where torch has ``device_id`` (2.3 on)."""
    if backend != "nccl" or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return {}
    if "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": torch.device("cuda", torch.cuda.current_device())}
