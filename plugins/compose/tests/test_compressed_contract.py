"""The whole collective contract on ``compressed``, over the torch collective
(gloo) and, in the mpi session, over MPI: 1 to 3 ranks."""

from __future__ import annotations

from typing import Any, ClassVar

from phalanx_core.testing.suites import CollectiveSuite


class TestCompressedOverTorch(CollectiveSuite):
    collective = "compressed"
    options: ClassVar[dict[str, Any]] = {"inner": "torch"}


class TestCompressedWithErrorFeedback(CollectiveSuite):
    collective = "compressed"
    options: ClassVar[dict[str, Any]] = {"inner": "torch", "dtype": "fp16", "error_feedback": True}
