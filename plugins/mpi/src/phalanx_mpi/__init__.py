"""phalanx-mpi: the ``mpi`` collective over mpi4py and the ``mpirun`` launcher."""

__version__ = "0.1.0"
