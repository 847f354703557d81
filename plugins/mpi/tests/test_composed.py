"""phalanx-compose's ``compressed`` over MPI (a third party's collective
wrapping another third party's, found by name): the whole contract on 1 to
3 ranks started by the mpirun launcher."""

from __future__ import annotations

from typing import Any, ClassVar

from phalanx.testing.suites import CollectiveSuite


class TestCompressedOverMPI(CollectiveSuite):
    collective = "compressed"
    launcher = "mpirun"
    options: ClassVar[dict[str, Any]] = {"inner": "mpi"}
