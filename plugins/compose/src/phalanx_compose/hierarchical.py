"""The ``hierarchical`` collective: one collective within each node, another
across the nodes.

``resolve("ddp", collective="hierarchical", intra="torch", inter="mpi")``:
``all_reduce`` is a reduce-scatter within the node (``intra``), an
all-reduce of each slice across the nodes among the ranks of the same
local rank (``inter``), and an all-gather within the node: each byte
crosses the slow link between the nodes once per node, not once per rank.
``broadcast`` goes across the nodes among the ranks of the source's local
rank, then within each node; ``all_gather`` (and ``all_gather_into``)
gathers within the node, then the nodes' blocks across them. Every other
operation goes to the intra collective's group of every rank as it is.

The layout comes from the environment (each rank's node and local rank),
gathered once at setup. On one node, or where the nodes hold different
numbers of ranks, every operation is the intra collective's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx_core import DEFAULT_TIMEOUT, Collective, CompletedWork, MisconfigurationError, Work, check_rank

from ._parts import make_collective

if TYPE_CHECKING:
    from phalanx_core import Accelerator, ClusterEnvironment, Launcher
    from phalanx_core.hangs import Board

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
        self._local: Collective | None = None  # this node's ranks, over intra
        self._cross: Collective | None = None  # the ranks of this local rank, over inter
        self._layout: list[tuple[int, int]] = []  # (node, local index) of every rank
        self._cross_ranks: list[int] = []  # the members of this rank's cross group

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
        for node in nodes:
            group = self.intra.new_group(members[node])
            if nodes.index(node) == mine[0]:
                self._local = group
        for index in range(per_node):
            ranks = [r for r, (_, i) in enumerate(self._layout) if i == index]
            group = self.inter.new_group(ranks)
            if index == mine[1]:
                self._cross, self._cross_ranks = group, ranks

    def teardown(self) -> None:
        self._local = self._cross = None
        self._layout, self._cross_ranks = [], []
        self.inter.teardown()
        self.intra.teardown()

    def _groups(self) -> tuple[Collective, Collective]:
        if self._local is None or self._cross is None:
            raise RuntimeError("hierarchical: the two levels were not made (setup, several nodes)")
        return self._local, self._cross

    @property
    def hierarchical(self) -> bool:
        """Whether operations take the two levels (several nodes of one size)."""
        return self._local is not None and self._cross is not None

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

    def all_reduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        import torch

        if not self.hierarchical or tensor.dtype == torch.bool or tensor.numel() == 0:
            return self.intra.all_reduce(tensor, op, async_op=async_op)
        local, cross = self._groups()
        reduce = "sum" if op == "mean" else op
        per_node = local.world_size
        flat = tensor.reshape(-1)
        padded = torch.zeros(
            -(-flat.numel() // per_node) * per_node, dtype=tensor.dtype, device=tensor.device
        )
        padded[: flat.numel()] = flat
        part = local.reduce_scatter(padded, reduce)
        cross.all_reduce(part, reduce)
        local.all_gather_into(padded, part)
        result = padded[: flat.numel()].view_as(tensor)
        if op == "mean":
            floor = not (tensor.is_floating_point() or tensor.is_complex())
            result = torch.div(result, self.world_size, rounding_mode="floor" if floor else None)
        tensor.copy_(result)
        return CompletedWork(tensor) if async_op else tensor

    def broadcast(self, tensor: Any, src: int = 0, *, async_op: bool = False) -> Any:
        if not self.hierarchical:
            return self.intra.broadcast(tensor, src, async_op=async_op)
        local, cross = self._groups()
        check_rank(src, self.world_size, operation="broadcast", argument="src")
        index = self._layout[src][1]
        if self._layout[self.rank][1] == index:  # src is in this rank's cross group
            cross.broadcast(tensor, self._cross_ranks.index(src))
        local.broadcast(tensor, index)
        return CompletedWork(tensor) if async_op else tensor

    def all_gather(self, tensor: Any, *, async_op: bool = False) -> Any:
        import torch

        if not self.hierarchical:
            return self.intra.all_gather(tensor, async_op=async_op)
        local, cross = self._groups()
        block = torch.stack(local.all_gather(tensor))  # type: ignore[arg-type]
        blocks = cross.all_gather(block)  # one per node, in the cross group's order
        position = {self._layout[member][0]: p for p, member in enumerate(self._cross_ranks)}
        parts = [blocks[position[node]][index] for node, index in self._layout]  # type: ignore[index]
        return CompletedWork(parts) if async_op else parts

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

    def reduce_scatter(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        return self.intra.reduce_scatter(tensor, op, async_op=async_op)

    def reduce_scatter_into(
        self, output: Any, tensor: Any, op: str = "sum", *, async_op: bool = False
    ) -> Any:
        return self.intra.reduce_scatter_into(output, tensor, op, async_op=async_op)

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
