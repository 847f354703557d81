"""The mpi collective through the conformance kit: the whole contract in
worlds of 1 to 3 ranks started by the mpirun launcher, and a timeout."""

from __future__ import annotations

import pytest

import phalanx
from phalanx_core import MisconfigurationError
from phalanx_core.testing.suites import CollectiveSuite


class TestMPICollective(CollectiveSuite):
    collective = "mpi"
    launcher = "mpirun"


def test_gpu_accelerators_are_refused_when_resolving():
    from phalanx_mpi.collective import MPICollective
    from phalanx_torch.accelerators import CUDAAccelerator

    # The real class, not constructed (that needs a GPU): the check reads its name only.
    cuda = CUDAAccelerator.__new__(CUDAAccelerator)
    with pytest.raises(
        MisconfigurationError, match=r"collective 'mpi' moves CPU tensors.*collective='torch'"
    ):
        MPICollective().check_accelerator(cuda)


def test_processes_not_started_by_mpirun_are_refused():
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, collective="mpi", launcher="fork")
    with pytest.raises(phalanx.WorkerFailedError, match=r"MPI sees rank 0 of 1 process.*launcher='mpirun'"):
        strategy.launch(_nothing)


def _nothing(strategy):
    return None
