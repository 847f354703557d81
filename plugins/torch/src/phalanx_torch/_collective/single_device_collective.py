"""The ``single_device`` collective: a world of one process, in which every
operation meets the contract locally."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from phalanx_core import (
    ClusterEnvironment,
    Collective,
    CompletedWork,
    MisconfigurationError,
    Work,
    check_into,
    check_one_per_rank,
    check_rank,
    check_reduce_op,
    check_scatter_list,
)
from phalanx_core.accelerator import Accelerator

__all__ = ["SingleDeviceCollective"]


class SingleDeviceCollective(Collective):
    """A world of one process. Every operation meets the contract locally:
    reductions leave the tensor as it is, gathers return one-element lists of
    new tensors. ``send`` and ``recv`` have no peer and refuse with an error
    that says so. Nothing can block, so nothing times out.
    """

    name: ClassVar[str] = "single_device"
    #: None: a world of one process has no peers to come and go.
    fault_tolerance: ClassVar[frozenset[str]] = frozenset()

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
