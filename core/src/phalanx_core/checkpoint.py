"""How a strategy writes and reads checkpoint files."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import MisconfigurationError

__all__ = ["CheckpointIO", "TorchCheckpointIO", "check_module_keys"]


class CheckpointIO(ABC):
    """Writes and reads one checkpoint file. A strategy holds one."""

    @abstractmethod
    def save(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Write ``state`` (plain data and tensors) to ``path``, creating
        its parent directories."""

    @abstractmethod
    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
        """Read what :meth:`save` wrote. With ``weights_only`` (the
        default) nothing but tensors and plain data is unpickled."""


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` / ``torch.load``, writing through a temporary file so a
    crash never leaves half a checkpoint at ``path``."""

    def save(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        import torch

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, target)

    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
        import torch

        if Path(path).is_dir():
            raise FileNotFoundError(
                f"no checkpoint file at {os.fspath(path)!r}: it is a directory (a sharded checkpoint "
                "of strategy 'fsdp', or per-rank files of 'manual'?); load it with the strategy that "
                "wrote it, or save with state_dict_type='full' (fsdp) for one file every strategy reads"
            )
        if not Path(path).is_file():
            raise FileNotFoundError(f"no checkpoint file at {os.fspath(path)!r}")
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=weights_only)
        return state


def check_module_keys(
    path: str | os.PathLike[str], key: str, expected: Iterable[str], saved: Iterable[str]
) -> None:
    """Refuse a strict load whose saved module keys differ from the
    module's: name the entry, what is missing and what is extra (before
    anything is loaded, where torch's own error comes from deep inside
    ``load_state_dict``, or on one rank only)."""
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise MisconfigurationError(
            f"load_checkpoint({os.fspath(path)!r}): the module under {key!r} does not match the checkpoint: "
            f"missing from the checkpoint: {missing or 'none'}; in the checkpoint, not in the module: "
            f"{unexpected or 'none'}. Pass strict=False to load the keys both have"
        )
