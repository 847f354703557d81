"""The ``hierarchical`` collective: one collective within each node, another
across the nodes.

``resolve("ddp", collective="hierarchical", intra="torch", inter="mpi")``:
``all_reduce`` is a reduce-scatter within the node (``intra``), an
all-reduce of each slice across the nodes among the ranks of the same
local rank (``inter``), and an all-gather within the node: each byte
crosses the slow link between the nodes once per node, not once per rank.
``reduce_scatter`` (and ``reduce_scatter_into``, FSDP's gradients) is a
reduce-scatter within the node of the rows reordered by local index, then
one across the nodes; ``broadcast`` goes across the nodes among the ranks
of the source's local rank, then within each node; ``all_gather`` (and
``all_gather_into``) gathers within the node, then the nodes' blocks
across them. Every other operation goes to the intra collective's group of
every rank as it is.

With ``async_op=True`` these return at once: the later steps are started
by the callbacks of the earlier ones (see ``_pipeline``), and phalanx's
process group hands DDP and FSDP the operation's own c10d future.

The layout comes from the environment (each rank's node and local rank),
gathered once at setup. On one node, or where the nodes hold different
numbers of ranks, every operation is the intra collective's.

When peers come and go: what the intra collective can (its
``fault_tolerance``). A group formed by ``reconfigure()`` is the intra
collective's over the members it names, and every operation is the intra
collective's there: the two levels are laid out at setup only, from the
environment, which a configuration's members do not carry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx_core import (
    DEFAULT_TIMEOUT,
    Collective,
    Membership,
    MisconfigurationError,
    Work,
    check_into,
    check_rank,
    check_reduce_op,
)

from ._parts import make_collective

if TYPE_CHECKING:
    import torch

    from phalanx_core import Accelerator, ClusterEnvironment, Launcher
    from phalanx_core.hangs import Board

    from ._pipeline import Pipeline

#: One level of a composed operation: given the previous level's result,
#: start this level's operation (``async_op=True``) and return its handle.
_Step = Callable[[Any], Any]

__all__ = ["HierarchicalCollective"]


class HierarchicalCollective(Collective):
    """``intra`` within each node, ``inter`` across them (see the module's
    docstring).

    Options:
        intra: the collective within a node, by name or a ready instance
            (``"torch"``: gloo or nccl by the accelerator).
        inter: the collective across the nodes (``"torch"``, ``"mpi"``, a
            third party's).
        intra_options, inter_options: keyword arguments for each; their
            timeout is this one's.
    """

    name = "hierarchical"

    def __init__(
        self,
        *,
        intra: str | Collective = "torch",
        inter: str | Collective = "torch",
        intra_options: Mapping[str, Any] | None = None,
        inter_options: Mapping[str, Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(timeout=timeout)
        for role, name in (("intra", intra), ("inter", inter)):
            if name == "hierarchical":
                raise MisconfigurationError(
                    f"collective 'hierarchical': {role}='hierarchical' nests the hierarchy in itself; "
                    "name the collective for that level (e.g. 'torch', 'mpi')"
                )
        for role, value in (("intra_options", intra_options), ("inter_options", inter_options)):
            if value is not None and not isinstance(value, Mapping):
                raise MisconfigurationError(f"collective 'hierarchical': {role}={value!r}; expected a dict")
        self.intra = make_collective(
            "intra", intra, {"timeout": timeout, **(intra_options or {})}, owner="hierarchical"
        )
        self.inter = make_collective(
            "inter", inter, {"timeout": timeout, **(inter_options or {})}, owner="hierarchical"
        )
        self.reduce_ops = self.intra.reduce_ops  # type: ignore[misc]
        self.unsupported = self.intra.unsupported | (  # type: ignore[misc]
            self.inter.unsupported & {"all_reduce", "broadcast", "all_gather"}
        )
        self.fault_tolerance = self.intra.fault_tolerance  # type: ignore[misc]
        self._local: Collective | None = None  # this node's ranks, over intra (first level)
        self._local_last: Collective | None = None  # the same ranks, another group (last level)
        self._cross: Collective | None = None  # the ranks of this local rank, over inter
        self._layout: list[tuple[int, int]] = []  # (node, local index) of every rank
        self._cross_ranks: list[int] = []  # the members of this rank's cross group
        self._pipeline: Pipeline | None = None
        #: reduce_scatter's rows in the order of the node's reduce-scatter
        self._scatter_rows: torch.Tensor | None = None
        #: all_gather_into's rows as gathered -> the ranks' (None: the same)
        self._gather_rows: torch.Tensor | None = None

    # -- life cycle ----------------------------------------------------------

    def check_accelerator(self, accelerator: Accelerator) -> None:
        self.intra.check_accelerator(accelerator)
        self.inter.check_accelerator(accelerator)

    def check_launcher(self, launcher: Launcher, environment: ClusterEnvironment) -> None:
        self.intra.check_launcher(launcher, environment)
        self.inter.check_launcher(launcher, environment)

    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        """Both collectives over every rank; the layout, gathered; this
        node's group over intra and this local rank's group over inter
        (every rank makes every group, as subgroups are made)."""
        self.intra.plan_facts = self.plan_facts
        self.intra.arrival_report = self.inter.arrival_report = self.arrival_report
        self.intra.setup(environment, accelerator)
        self.plan_checked = self.intra.plan_checked
        self.inter.setup(environment, accelerator)
        where = (int(environment.node_rank), self.intra.rank)
        self._layout = [(int(n), int(r)) for n, r in self.intra.all_gather_object(where)]
        nodes = sorted({node for node, _ in self._layout})
        members = {node: [r for r, (n, _) in enumerate(self._layout) if n == node] for node in nodes}
        sizes = {len(ranks) for ranks in members.values()}
        if len(nodes) < 2 or len(sizes) != 1:
            return  # one node, or nodes of different sizes: the intra collective alone
        per_node = sizes.pop()
        self._layout = [(nodes.index(n), members[n].index(r)) for r, (n, _) in enumerate(self._layout)]
        mine = self._layout[self.intra.rank]
        # Two groups of this node's ranks: one for the first level of every
        # operation, one for the last (see _pipeline: each group is started
        # on from one level only, so every rank starts its operations in the
        # same order whichever thread starts them).
        for level in ("first", "last"):
            for node in nodes:
                group = self.intra.new_group(members[node])
                if nodes.index(node) == mine[0]:
                    if level == "first":
                        self._local = group
                    else:
                        self._local_last = group
        crosses = []
        for index in range(per_node):
            ranks = [r for r, (_, i) in enumerate(self._layout) if i == index]
            crosses.append(ranks)
            group = self.inter.new_group(ranks)
            if index == mine[1]:
                self._cross, self._cross_ranks = group, ranks
        self._plan_rows(crosses)
        self._pipeline = _make_pipeline(self._levels())

    def _plan_rows(self, crosses: list[list[int]]) -> None:
        """The row orders of the two-level reduce-scatter and all-gather
        (row ``r``: rank ``r``'s chunk)."""
        import torch

        # The node's reduce-scatter gives local index j the j-th block: the
        # chunks of the ranks of local index j, in their cross group's order.
        self._scatter_rows = torch.tensor([r for ranks in crosses for r in ranks], dtype=torch.long)
        # Gathered across: the nodes in this cross group's order, each
        # node's ranks by local index.
        at = {where: r for r, where in enumerate(self._layout)}
        per_node = len(crosses)
        gathered = [at[(self._layout[member][0], i)] for member in self._cross_ranks for i in range(per_node)]
        self._gather_rows = (
            None if gathered == list(range(self.world_size)) else torch.tensor(gathered, dtype=torch.long)
        )

    def _flatten(self) -> None:
        """Back to no layout: every operation the intra collective's."""
        self._local = self._cross = self._local_last = None
        self._pipeline = None
        self._scatter_rows = self._gather_rows = None
        self._layout, self._cross_ranks = [], []

    def reconfigure(self, membership: Membership) -> None:
        """The intra collective over the members, every operation its own
        (see the module's docstring)."""
        self._flatten()
        self.intra.reconfigure(membership)

    def abort(self) -> None:
        self.intra.abort()

    def teardown(self) -> None:
        self._flatten()
        self.inter.teardown()
        self.intra.teardown()

    @property
    def hierarchical(self) -> bool:
        """Whether operations take the two levels (several nodes of one size)."""
        return self._pipeline is not None

    @property
    def is_initialized(self) -> bool:
        return self.intra.is_initialized

    @property
    def rank(self) -> int:
        return self.intra.rank

    @property
    def world_size(self) -> int:
        return self.intra.world_size

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return self.intra.global_ranks

    @property
    def is_member(self) -> bool:
        return self.intra.is_member

    def board(self) -> Board | None:
        return self.intra.board()

    def new_group(self, ranks: Sequence[int]) -> Collective:
        return self.intra.new_group(ranks)

    # -- composed ------------------------------------------------------------

    def _start(
        self,
        steps: tuple[_Step | None, _Step | None, _Step | None],
        finish: Callable[[Any], Any],
        async_op: bool,
        torch_value: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Run ``steps`` (one per level: within the node, across, within
        the node again; ``None`` where that level has nothing to do) as one
        operation, then ``finish`` of the last result: a handle at once for
        ``async_op``, else the result."""
        from ._pipeline import Chain

        assert self._pipeline is not None
        chain = Chain(self._pipeline, steps, finish, torch_value)
        self._pipeline.submit(chain)
        return chain if async_op else chain.wait()

    def _levels(self) -> tuple[Collective, Collective, Collective]:
        """This node's group for the first level, the cross group, this
        node's group for the last level."""
        if self._local is None or self._cross is None or self._local_last is None:
            raise RuntimeError("hierarchical: the two levels were not made (setup, several nodes)")
        return self._local, self._cross, self._local_last

    def _mean(self, tensor: Any) -> Any:
        """The sum in ``tensor`` divided by the group's size, in place (floor
        division for integers, as the contract says)."""
        if tensor.is_floating_point() or tensor.is_complex():
            return tensor.div_(self.world_size)
        return tensor.div_(self.world_size, rounding_mode="floor")

    def all_reduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        import torch

        if not self.hierarchical or tensor.dtype == torch.bool or tensor.numel() == 0:
            return self.intra.all_reduce(tensor, op, async_op=async_op)
        name = check_reduce_op(op, self.reduce_ops, collective=self.name)
        local, cross, local_last = self._levels()
        reduce = "sum" if name == "mean" else name
        per_node = local.world_size
        # In place where the tensor divides evenly; else through a padded copy.
        direct = tensor.is_contiguous() and tensor.numel() % per_node == 0
        if direct:
            buffer = tensor.view(-1)
        else:
            buffer = torch.zeros(
                -(-tensor.numel() // per_node) * per_node, dtype=tensor.dtype, device=tensor.device
            )
            buffer[: tensor.numel()] = tensor.reshape(-1)
        part = torch.empty(buffer.numel() // per_node, dtype=tensor.dtype, device=tensor.device)

        def finish(_: Any) -> Any:
            if not direct:
                tensor.copy_(buffer[: tensor.numel()].view_as(tensor))
            return self._mean(tensor) if name == "mean" else tensor

        return self._start(
            (
                lambda _: local.reduce_scatter_into(part, buffer, reduce, async_op=True),
                lambda _: cross.all_reduce(part, reduce, async_op=True),
                lambda _: local_last.all_gather_into(buffer, part, async_op=True),
            ),
            finish,
            async_op,
            _listed,
        )

    def reduce_scatter(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        import torch

        if not self._two_level_reduce_scatter(tensor):
            return self.intra.reduce_scatter(tensor, op, async_op=async_op)
        if tensor.dim() == 0 or tensor.shape[0] % self.world_size:
            raise MisconfigurationError(
                f"reduce_scatter(): dimension 0 of the tensor ({tuple(tensor.shape)}) must be divisible "
                f"by the group's size ({self.world_size})"
            )
        output = torch.empty(
            (tensor.shape[0] // self.world_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        return self._reduce_scatter(output, tensor, op, async_op, torch_value=None)

    def reduce_scatter_into(
        self, output: Any, tensor: Any, op: str = "sum", *, async_op: bool = False
    ) -> Any:
        if not self._two_level_reduce_scatter(tensor):
            return self.intra.reduce_scatter_into(output, tensor, op, async_op=async_op)
        check_into(output, tensor, self.world_size, operation="reduce_scatter_into")
        return self._reduce_scatter(output, tensor, op, async_op, torch_value=_listed)

    def _two_level_reduce_scatter(self, tensor: Any) -> bool:
        import torch

        return (
            self.hierarchical
            and "reduce_scatter_into" not in self.inter.unsupported
            and isinstance(tensor, torch.Tensor)
            and tensor.dtype != torch.bool
            and tensor.numel() > 0
        )

    def _reduce_scatter(
        self, output: Any, tensor: Any, op: str, async_op: bool, torch_value: Callable[[Any], Any] | None
    ) -> Any:
        """Two levels: within the node, a reduce-scatter of the input with
        its rows reordered so that this rank's slice holds, summed over the
        node, the chunks of every rank of its local index (in its cross
        group's order); across the nodes, a reduce-scatter of that slice in
        the cross group, which leaves this rank its own chunk. Each byte
        crosses between the nodes once per node, as in ``all_reduce``."""
        name = check_reduce_op(op, self.reduce_ops, collective=self.name)
        local, cross, _ = self._levels()
        reduce = "sum" if name == "mean" else name
        assert self._scatter_rows is not None
        rows = tensor.reshape(self.world_size, -1)
        ordered = rows.index_select(0, self._scatter_rows.to(tensor.device))
        part = ordered.new_empty(cross.world_size * rows.shape[1])
        target = output.view(-1)

        def finish(_: Any) -> Any:
            if name == "mean":
                self._mean(output)
            return output

        return self._start(
            (
                lambda _: local.reduce_scatter_into(part, ordered.view(-1), reduce, async_op=True),
                lambda _: cross.reduce_scatter_into(target, part, reduce, async_op=True),
                None,
            ),
            finish,
            async_op,
            torch_value,
        )

    def broadcast(self, tensor: Any, src: int = 0, *, async_op: bool = False) -> Any:
        if not self.hierarchical:
            return self.intra.broadcast(tensor, src, async_op=async_op)
        _, cross, local_last = self._levels()
        check_rank(src, self.world_size, operation="broadcast", argument="src")
        index = self._layout[src][1]
        across = None
        if self._layout[self.rank][1] == index:  # src is in this rank's cross group
            root = self._cross_ranks.index(src)
            across = lambda _: cross.broadcast(tensor, root, async_op=True)  # noqa: E731
        return self._start(
            (None, across, lambda _: local_last.broadcast(tensor, index, async_op=True)),
            lambda _: tensor,
            async_op,
            _listed,
        )

    def all_gather(self, tensor: Any, *, async_op: bool = False) -> Any:
        import torch

        if not self.hierarchical:
            return self.intra.all_gather(tensor, async_op=async_op)
        local, cross, _ = self._levels()
        position = {self._layout[member][0]: p for p, member in enumerate(self._cross_ranks)}

        def finish(blocks: Any) -> list[Any]:  # one per node, in the cross group's order
            return [blocks[position[node]][index] for node, index in self._layout]

        return self._start(
            (
                lambda _: local.all_gather(tensor, async_op=True),
                lambda parts: cross.all_gather(torch.stack(parts), async_op=True),
                None,
            ),
            finish,
            async_op,
        )

    def all_gather_into(self, output: Any, tensor: Any, *, async_op: bool = False) -> Any:
        import torch

        if not self.hierarchical or "all_gather_into" in self.inter.unsupported:
            return self.intra.all_gather_into(output, tensor, async_op=async_op)
        check_into(output, tensor, self.world_size, operation="all_gather_into")
        local, cross, _ = self._levels()
        flat = output.view(-1)
        # Gathered across in the cross group's order of nodes: straight into
        # the output where that is the ranks' order, else reordered after.
        gathered = flat if self._gather_rows is None else torch.empty_like(flat)
        block = tensor.new_empty(local.world_size * tensor.numel())
        source = tensor.contiguous()

        def finish(_: Any) -> Any:
            if self._gather_rows is not None:
                rows = gathered.view(self.world_size, -1)
                flat.view(self.world_size, -1).index_copy_(0, self._gather_rows.to(rows.device), rows)
            return output

        return self._start(
            (
                lambda _: local.all_gather_into(block, source, async_op=True),
                lambda _: cross.all_gather_into(gathered, block, async_op=True),
                None,
            ),
            finish,
            async_op,
            _listed,
        )

    # -- the rest, as the intra collective does it over every rank ------------------

    def barrier(self, *, async_op: bool = False) -> Work | None:
        return self.intra.barrier(async_op=async_op)

    def reduce(self, tensor: Any, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        return self.intra.reduce(tensor, dst, op, async_op=async_op)

    def gather(self, tensor: Any, dst: int = 0, *, async_op: bool = False) -> Any:
        return self.intra.gather(tensor, dst, async_op=async_op)

    def scatter(
        self, tensor: Any, scatter_list: Sequence[Any] | None = None, src: int = 0, *, async_op: bool = False
    ) -> Any:
        return self.intra.scatter(tensor, scatter_list, src, async_op=async_op)

    def all_to_all(self, tensors: Sequence[Any], *, async_op: bool = False) -> Any:
        return self.intra.all_to_all(tensors, async_op=async_op)

    def send(self, tensor: Any, dst: int, *, tag: int = 0) -> None:
        self.intra.send(tensor, dst, tag=tag)

    def recv(self, tensor: Any, src: int, *, tag: int = 0) -> Any:
        return self.intra.recv(tensor, src, tag=tag)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.intra.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.intra.all_gather_object(obj)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        return self.intra.gather_object(obj, dst)

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        return self.intra.scatter_object(objs, src)


def _listed(result: Any) -> list[Any]:
    """An operation's result as torch's backends give it."""
    return [result]


def _make_pipeline(levels: Sequence[Collective]) -> Pipeline:
    from ._pipeline import Pipeline

    return Pipeline(levels)
