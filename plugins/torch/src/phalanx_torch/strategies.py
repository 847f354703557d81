"""Strategies over torch."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from phalanx_core import OPERATIONS, MisconfigurationError, SaveHandle, Strategy
from phalanx_core.checkpoint import fsync_directory
from phalanx_core.checkpoint_directory import COMPLETE_MARK
from phalanx_core.launching import write_whole

from .checkpoint_io import TorchDistributedCheckpointIO
from .collectives import TorchCollective

__all__ = ["DDPStrategy", "ManualStrategy", "SingleDeviceStrategy", "TorchGroupStrategy"]


class SingleDeviceStrategy(Strategy):
    """One process on one device: the base composition, with a check that it
    was given exactly one device."""

    #: Reads files and sharded directories, whatever wrote them.
    default_checkpoint_io = TorchDistributedCheckpointIO

    def __init__(self, **parts: Any) -> None:
        super().__init__(**parts)
        if len(self.parallel_devices) > 1:
            raise MisconfigurationError(
                f"strategy 'single_device' runs on one device, got {len(self.parallel_devices)}; "
                "use devices=1 or a parallel strategy"
            )


class TorchGroupStrategy(Strategy):
    """A strategy whose traffic goes through a ``torch.distributed``
    process group: DDP's gradient buckets, FSDP's all-gathers and
    reduce-scatters, and under ``manual`` the user's own DDP, DTensor and
    ``torch.distributed`` calls.

    That group is the strategy's collective, whatever it is:

    - the ``torch`` collective: the c10d group it made (or adopted), used
      directly, with nothing in between;
    - any other collective (``mpi``, ``horovod``, a third party's): a
      :class:`~phalanx_torch.process_group.CollectiveProcessGroup` over it,
      made in :meth:`setup_environment`, registered with torch, and made
      torch's default group where there is none, so that code which names
      no group talks through the collective too.

    No other group is made: every byte goes where the user said it should.
    :attr:`process_group` and :meth:`device_mesh` hand that group to code of
    one's own.
    """

    #: Reads files and sharded directories, whatever wrote them.
    default_checkpoint_io = TorchDistributedCheckpointIO

    _process_group: Any = None
    _adapter: Any = None  # the CollectiveProcessGroup this strategy made

    def setup_environment(self) -> None:
        super().setup_environment()
        if _is_torchs_own(self.collective):
            own: Any = self.collective
            self._process_group = own.process_group or dist.group.WORLD
        else:
            from .process_group import CollectiveProcessGroup

            adapter = CollectiveProcessGroup(self.collective)
            self._adapter = adapter.register(as_world=not dist.is_initialized())
            self._process_group = self._adapter

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed.ProcessGroup`` of every rank that carries
        this strategy's traffic: the torch collective's own group, or a
        :class:`~phalanx_torch.process_group.CollectiveProcessGroup` over any
        other collective. Give it to your own ``DistributedDataParallel``
        (``process_group=``) or ``torch.distributed`` calls (``group=``)."""
        self._require_group(type(self).__name__, "strategy.process_group")
        return self._process_group

    def device_mesh(self, device_type: str | None = None) -> Any:
        """A one-dimensional ``DeviceMesh`` of every rank over
        :attr:`process_group`, for ``fully_shard(mesh=...)``, DTensor and
        tensor parallelism of your own. ``device_type`` defaults to the
        type of :attr:`root_device` (``"cpu"``, ``"cuda"``)."""
        self._require_group(type(self).__name__, "strategy.device_mesh()")
        kind = device_type or torch.device(self.root_device).type
        if self._adapter is not None:
            return self._adapter.device_mesh(kind)
        if self._process_group is dist.group.WORLD:
            return init_device_mesh(kind, (self.world_size,))
        return DeviceMesh.from_group(self._process_group, kind)

    def _require_group(self, name: str, call: str) -> None:
        if self._process_group is None:
            raise MisconfigurationError(
                f"strategy {name!r}: {call} needs the process group, which strategy.launch() makes: "
                "call strategy.launch() first (in a flat script), or call this from fn in "
                "strategy.launch(fn, ...)"
            )

    def unwrap_module(self, module: Any) -> Any:
        """The module inside a DistributedDataParallel wrapper (the one DDP
        made, or under ``manual`` the user's own), so checkpoint keys are the
        model's (no ``module.`` prefix) and load under every strategy."""
        return module.module if isinstance(module, DistributedDataParallel) else module

    #: The gloo group that background checkpoint saves talk through (made
    #: by the first one that needs it).
    _checkpoint_pg: Any = None

    def teardown(self) -> None:
        unwaited = self._saves.close()  # before any group goes
        group, self._checkpoint_pg = self._checkpoint_pg, None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):  # gone with the default group
                dist.destroy_process_group(group)
        if self._adapter is not None:
            self._adapter.unregister()
            self._adapter = None
        self._process_group = None
        super().teardown()
        if unwaited is not None:
            raise unwaited


def _is_torchs_own(collective: Any) -> bool:
    """Whether ``collective`` is the torch collective with its operations
    as they are (a subclass may change how it sets up, not what its
    operations do): then its c10d group carries the traffic directly. A
    subclass that wraps an operation (to count it, to compress) gets the
    traffic through that operation."""
    if not isinstance(collective, TorchCollective):
        return False
    kind = type(collective)
    return all(
        getattr(kind, op) is getattr(TorchCollective, op) and op not in vars(collective) for op in OPERATIONS
    )


class DDPStrategy(TorchGroupStrategy):
    """Data parallel: one process per device, the module wrapped in
    :class:`~torch.nn.parallel.DistributedDataParallel` on :meth:`setup`.

    The same class serves ``ddp`` (subprocess launcher), ``ddp_spawn``,
    ``ddp_fork`` and ``ddp_notebook``: only the launcher differs. Every
    byte goes through the strategy's collective: its own calls, and DDP's
    (the module's state at set-up, every gradient bucket), DDP's
    ``process_group`` being the collective's c10d group (the torch
    collective) or the collective as a process group
    (``phalanx_torch.process_group.CollectiveProcessGroup``: mpi,
    horovod, a third party's).

    Options (given to :func:`phalanx.resolve` as keywords) are
    DistributedDataParallel's: ``find_unused_parameters``, ``static_graph``,
    ``gradient_as_bucket_view``, ``broadcast_buffers``, ``bucket_cap_mb``.
    """

    #: DDP checks parameter shapes (all_gather), copies rank 0's module
    #: (broadcast) and reduces gradient buckets (all_reduce).
    traffic: ClassVar[frozenset[str]] = frozenset({"all_gather", "broadcast", "all_reduce"})

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float | None = None,
        **parts: Any,
    ) -> None:
        super().__init__(**parts)
        self._ddp_kwargs: dict[str, Any] = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
        }
        if not broadcast_buffers:  # torch 2.13 warns when it is passed at all, even as the default
            self._ddp_kwargs["broadcast_buffers"] = False
        if bucket_cap_mb is not None:
            self._ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb

    def setup_module(self, module: Any) -> Any:
        self._require_group("ddp", "setup(module)")
        device = self.root_device
        device_ids = [device.index] if isinstance(device, torch.device) and device.type == "cuda" else None
        return DistributedDataParallel(
            module, device_ids=device_ids, process_group=self._process_group, **self._ddp_kwargs
        )

    def no_backward_sync(self, module: Any, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """``module.no_sync()`` for a DDP module: backward accumulates local
        gradients without reducing them (the next synchronised backward
        reduces everything)."""
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise MisconfigurationError(
                f"no_backward_sync() needs the module returned by strategy.setup(), a "
                f"DistributedDataParallel; got {type(module).__name__}"
            )
        return module.no_sync()


class ManualStrategy(TorchGroupStrategy):
    """Your own parallelism: phalanx gives the ranks (from the environment),
    the processes (the launcher) and the collective, also as a torch process
    group (:attr:`process_group`) and a device mesh (:meth:`device_mesh`);
    your code places modules on devices and wraps them — DDP on one part,
    hand sharding, FSDP or DTensor on another — over that group, so that
    its traffic goes through the collective you named. (Where phalanx made
    torch's default group, that is the same group: ``torch.distributed``
    calls that name no group use it.)

    - :meth:`setup` leaves modules and optimizers as they are: no precision
      conversion, no move, no wrapper (optimizer factories are still called
      with the module's parameters). The precision's forward context,
      backward and optimizer step still apply when you use them.
    - :attr:`root_device` is the device of this local rank: put your modules
      there yourself.
    - With ``checkpoint_per_rank=True`` (the default), every rank saves its
      own state: ``save_checkpoint("ckpt", state)`` writes the directory
      ``ckpt/`` with one file per rank, ``rank-00000.pt``, ... and
      :meth:`load_checkpoint` reads this rank's file back. With ``False``,
      rank 0 writes one file, as the other strategies do.
      A module you wrapped in DDP yourself is saved as the module inside
      it (no ``module.`` prefix), so a rank's file loads under every
      strategy.
    - :meth:`no_backward_sync` on a module you wrapped in DDP is its
      ``no_sync()``; on anything else there is nothing phalanx synchronises,
      and it does nothing.
    """

    def __init__(self, *, checkpoint_per_rank: bool = True, **parts: Any) -> None:
        super().__init__(**parts)
        if not isinstance(checkpoint_per_rank, bool):
            raise MisconfigurationError(
                f"strategy 'manual': checkpoint_per_rank={checkpoint_per_rank!r}; give True (one file "
                "per rank, the default) or False (one file from rank 0)"
            )
        self.checkpoint_per_rank = checkpoint_per_rank

    def setup(self, module: Any, *optimizers: Any) -> Any:
        made = self._make_optimizers(module, optimizers)
        return (module, *made) if made else module

    def no_backward_sync(self, module: Any, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def rank_checkpoint_path(self, path: str | os.PathLike[str], rank: int | None = None) -> Path:
        """The file of ``rank`` (this rank by default) in the checkpoint
        directory ``path``."""
        return Path(path) / f"rank-{self.global_rank if rank is None else rank:05d}.pt"

    def save_checkpoint(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, blocking: bool = True
    ) -> SaveHandle:
        """As the base's; with ``checkpoint_per_rank`` every rank writes its
        own file into the directory ``path``, and rank 0 marks the directory
        complete (``.complete``) once every rank's file is there. That
        layout saves blocking only."""
        if not self.checkpoint_per_rank:
            return super().save_checkpoint(path, state, blocking=blocking)
        self._check_blocking(blocking)
        if not blocking:
            raise MisconfigurationError(
                f"save_checkpoint({os.fspath(path)!r}, blocking=False): strategy 'manual' with "
                "checkpoint_per_rank=True saves blocking only (every rank's file, then the mark that "
                "all are there); pass blocking=True, or checkpoint_per_rank=False to save one file "
                "from rank 0 in the background"
            )
        if Path(path).is_file():
            raise MisconfigurationError(
                f"save_checkpoint({os.fspath(path)!r}): strategy 'manual' saves one file per rank into a "
                "directory, and this is a file; choose another path, or pass checkpoint_per_rank=False"
            )
        self._saves.finish()
        mark = Path(path) / COMPLETE_MARK
        if self.is_global_zero:
            mark.unlink(missing_ok=True)  # not complete until every new file is there
            # The files of an earlier save by more ranks go: a load on that
            # many ranks would otherwise read old files beside new ones.
            for old in _rank_files(Path(path)):
                if _rank_of(old) >= self.world_size:
                    old.unlink(missing_ok=True)
        if self.world_size > 1:
            self.barrier()
        self.checkpoint_io.save(self._to_state(state), self.rank_checkpoint_path(path))
        if self.world_size > 1:
            self.barrier()
        if self.is_global_zero:
            write_whole(mark, f"{self.world_size}\n".encode())
            fsync_directory(path)
        if self.world_size > 1:
            self.barrier()  # on every rank, the save is whole when it returns
        return SaveHandle.finished(path)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        if not self.checkpoint_per_rank or Path(path).is_file():
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        self._check_ranks_saved(Path(path))
        mine = self.rank_checkpoint_path(path)
        if not mine.is_file():
            found = sorted(p.name for p in Path(path).glob("rank-*.pt")) if Path(path).is_dir() else []
            raise FileNotFoundError(
                f"load_checkpoint({os.fspath(path)!r}): no file for rank {self.global_rank} ({mine.name}); "
                + (
                    f"the directory has {', '.join(found)}: it was saved by {len(found)} rank(s), and "
                    f"this job has {self.world_size}"
                    if found
                    else "nothing was saved there by strategy 'manual'"
                )
            )
        return super().load_checkpoint(mine, state, strict=strict, weights_only=weights_only)

    def _check_ranks_saved(self, path: Path) -> None:
        """Refuse a directory of per-rank files that was not saved whole
        (no mark) or was saved by another number of ranks: each rank's file
        holds that rank's part of your parallelism, which phalanx cannot
        split or join, so loading on fewer ranks would drop parts and on
        more would have none for some."""
        if not path.is_dir():
            return  # the missing file's own error follows
        shown = os.fspath(path)
        try:
            saved_by = int((path / COMPLETE_MARK).read_text().strip())
        except FileNotFoundError:
            found = len(list(_rank_files(path)))
            raise MisconfigurationError(
                f"load_checkpoint({shown!r}): the directory has {found} rank file(s) but no "
                f"{COMPLETE_MARK} mark, which strategy 'manual' writes once every rank's file is "
                "whole: the save did not finish (load an earlier checkpoint), or was made before "
                f"phalanx marked its saves (if you know every file is whole, write the number of "
                f"ranks that saved it into {os.path.join(shown, COMPLETE_MARK)})"
            ) from None
        except ValueError:
            raise MisconfigurationError(
                f"load_checkpoint({shown!r}): its {COMPLETE_MARK} mark does not hold a number of "
                "ranks; it was not written by strategy 'manual'"
            ) from None
        if saved_by != self.world_size:
            raise MisconfigurationError(
                f"load_checkpoint({shown!r}): saved by {saved_by} rank(s), and this job has "
                f"{self.world_size}. With strategy 'manual' each rank's file (rank-00000.pt ...) "
                "holds its rank's part of your own parallelism, which phalanx cannot split or join: "
                f"load it on {saved_by} rank(s), or save with checkpoint_per_rank=False (one file "
                "from rank 0) the state that every rank holds alike"
            )


def _rank_files(path: Path) -> Iterator[Path]:
    """The per-rank files of a 'manual' checkpoint directory."""
    return (p for p in path.glob("rank-*.pt") if _rank_of(p) >= 0)


def _rank_of(path: Path) -> int:
    """The rank of ``rank-00003.pt`` (3), or -1 for another name."""
    digits = path.name[len("rank-") : -len(".pt")]
    return int(digits) if digits.isdigit() else -1
