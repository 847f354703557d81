"""phalanx-mpi's entry module: specs only; imports neither mpi4py nor torch."""

from __future__ import annotations

from phalanx_core import CollectiveSpec, LauncherSpec, hookimpl

_INSTALL = "pip install mpi4py 'torch>=2.9'  (and an MPI library: apt-get install openmpi-bin)"


@hookimpl
def phalanx_collectives() -> list[CollectiveSpec]:
    return [
        CollectiveSpec(
            name="mpi",
            target="phalanx_mpi.collective:MPICollective",
            summary="MPI over mpi4py: CPU tensors through their buffers, every contract operation",
            needs=("mpi4py", "torch>=2.9"),
            install=_INSTALL,
        )
    ]


@hookimpl
def phalanx_launchers() -> list[LauncherSpec]:
    return [
        LauncherSpec(
            name="mpirun",
            target="phalanx_mpi.launcher:MPIRunLauncher",
            summary="starts the ranks through OpenMPI's mpirun and runs fn in each",
            needs=("mpi4py", "torch>=2.9"),
            install=_INSTALL,
        )
    ]
