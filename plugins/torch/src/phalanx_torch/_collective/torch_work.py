"""The work handle of the ``torch`` collective's asynchronous operations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx_core import Work


class TorchWork(Work):
    """A torch.distributed ``Work`` adapted to the contract: ``wait()``
    returns the operation's result, after any post-processing (the division
    of ``"mean"``), and raises CollectiveTimeoutError on a timeout."""

    def __init__(
        self,
        work: Any,
        result: Any,
        collective: Any,  # the TorchCollective that started it
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
