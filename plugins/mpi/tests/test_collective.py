"""The mpi collective through the conformance kit: the whole contract in
worlds of 1 to 3 ranks started by the mpirun launcher, and a timeout."""

from __future__ import annotations

import pytest

import phalanx
from phalanx.testing.suites import CollectiveSuite, TrafficSuite
from phalanx_core import MisconfigurationError


class TestMPICollective(CollectiveSuite):
    collective = "mpi"
    launcher = "mpirun"


class TestMPITraffic(TrafficSuite):
    """DDP's buckets, FSDP's all-gathers and reduce-scatters and a user's
    DDP under ``manual`` go over MPI, ranks started by mpirun."""

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


FAST_PATH_EDGES = """
import torch
from phalanx_core import MisconfigurationError
from phalanx_mpi.collective import MPICollective

class Alone:  # a process started without mpirun: a world of one
    world_size, global_rank = 1, 0

c = MPICollective(timeout=30)
c.setup(Alone())
t = torch.arange(4, dtype=torch.float32)
assert c.all_reduce(t) is t and c.all_reduce(t, op="max") is t and t.tolist() == [0, 1, 2, 3]
p = torch.nn.Parameter(torch.ones(3), requires_grad=False)  # a subclass: the general path
assert c.all_reduce(p, op="mean") is p and p.tolist() == [1, 1, 1]
base = torch.arange(6, dtype=torch.int64)
view = base[::2]  # not contiguous
assert c.all_reduce(view, op="min") is view and view.tolist() == [0, 2, 4]
assert c.all_reduce(torch.empty(0)).numel() == 0
assert c.all_reduce(torch.tensor([True, False]), op="max").tolist() == [True, False]
for _ in range(300):  # ever new buffers: MPI's views of them are not kept forever
    c.all_reduce(torch.ones(2))
assert len(c._messages) <= 256, len(c._messages)
c.teardown()
try:
    c.all_reduce(t)
except MisconfigurationError as exc:
    print("AFTER TEARDOWN", exc)
"""


def test_all_reduce_fast_path_edges():
    """all_reduce's fast path (a plain contiguous tensor of an MPI dtype)
    and what falls through to the general one, in a world of one."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FAST_PATH_EDGES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "AFTER TEARDOWN collective 'mpi': all_reduce before setup()" in done.stdout
