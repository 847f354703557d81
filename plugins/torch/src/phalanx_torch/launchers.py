"""Launchers. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError

__all__ = ["InProcessLauncher"]

T = TypeVar("T")


class InProcessLauncher(Launcher):
    """Runs ``fn`` in this process and returns ``[result]``.

    For one process alone, or for a process that torchrun, srun or mpirun
    already made (then the list holds this rank's result only). Nothing is
    created, so nothing needs stopping: an exception of ``fn`` reaches the
    caller unchanged.
    """

    is_interactive_compatible: ClassVar[bool] = True
    creates_processes: ClassVar[bool] = False

    def __init__(self, *, environment: Any = None, num_processes: int = 1, num_nodes: int = 1) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        external = bool(getattr(environment, "creates_processes_externally", False))
        if num_processes * num_nodes > 1 and not external:
            raise MisconfigurationError(
                f"launcher 'in_process' runs in this one process, but {num_processes} processes per "
                f"node on {num_nodes} node(s) were asked for and no scheduler made them; use a "
                "launcher that creates processes, or start this script with torchrun / srun"
            )

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        return [fn(*args, **kwargs)]
