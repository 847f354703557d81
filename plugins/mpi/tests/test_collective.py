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


@pytest.mark.parametrize(("strategy", "launcher"), [("ddp", "fork"), ("ddp", None), ("manual", "spawn")])
def test_processes_not_started_by_mpirun_are_refused_when_resolving(strategy, launcher):
    flags = {"launcher": launcher} if launcher else {}
    with pytest.raises(MisconfigurationError, match=r"collective 'mpi' with launcher .*launcher='mpirun'"):
        phalanx.resolve(strategy, accelerator="cpu", devices=2, collective="mpi", **flags)


def test_processes_another_scheduler_started_are_refused_in_the_ranks(tmp_path):
    # in_process makes no processes, so resolving accepts it; torchrun's ranks
    # are not MPI's: each rank's setup refuses, naming what MPI sees.
    import subprocess
    import sys

    from phalanx_core.testing.processes import scheduler_free_environment

    script = tmp_path / "job.py"
    script.write_text(
        "import phalanx\n"
        "strategy = phalanx.resolve('ddp', accelerator='cpu', devices=2, collective='mpi')\n"
        "strategy.launch(print)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=scheduler_free_environment(),
    )
    assert done.returncode != 0
    assert "MPI sees rank 0 of 1 process" in done.stderr and "launcher='mpirun'" in done.stderr
