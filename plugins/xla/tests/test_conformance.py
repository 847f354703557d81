"""phalanx-xla's parts through phalanx.testing.suites, on torch_xla's
CPU runtime (two replicas: threads of one process).

What differs from the suites' defaults, and why:

- worlds of 1 and 2 replicas: torch_xla runs one replica on every device
  of the host (``CPU_NUM_DEVICES=2`` here) or on one, nothing in between,
  and the device count is fixed for the session.
- a rank killed by SIGKILL: the replicas are threads of one process, so the
  signal stops every replica at the same instant; the error names the
  process's first rank and the signal, in the shape every launcher's
  error has (the suite expects the rank that called kill, which no one can
  tell apart from the others).
"""

from __future__ import annotations

import pytest

from phalanx.testing.suites import (
    AcceleratorSuite,
    CollectiveSuite,
    LauncherSuite,
    _bounded,
    _no_leftovers,
    kill_on_rank,
)
from phalanx_core import WorkerFailedError

pytestmark = pytest.mark.subprocess


class TestXLACollective(CollectiveSuite):
    collective = "xla"
    strategy = "xla"
    launcher = "xla"
    accelerator = "xla"
    world_sizes = (1, 2)
    timeout = 3.0


class TestXLALauncher(LauncherSuite):
    launcher = "xla"
    strategy = "xla"
    accelerator = "xla"
    num_processes = 2
    # The CPU runtime's replicas are threads of one process: they talk
    # without a socket, and the launcher hosts no store.
    listens = False

    def test_a_rank_killed_by_sigkill_fails_the_job(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Replaces the suite's test: SIGKILL on one replica kills the
        process that holds both."""
        last = self.num_processes - 1
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch), pytest.raises(WorkerFailedError) as info:
            self.resolve().launch(kill_on_rank, last)
        assert info.value.signal == "SIGKILL", info.value
        assert info.value.rank in range(self.num_processes), info.value
        self._reported_alike(info.value, info.value.rank)
        assert "killed by SIGKILL (exit code -9)." in str(info.value), info.value


class TestXLAAccelerator(AcceleratorSuite):
    accelerator = "xla"
