"""phalanx-mpi's tests that need OpenMPI and mpi4py run in the ``mpi`` nox
session, which installs both and sets ``PHALANX_REAL_RUNS=mpi``; there a
missing ``mpirun`` or mpi4py fails, never skips. Elsewhere (the ``tests``
session) only test_installation.py runs."""

from __future__ import annotations

import os

_asked = {name.strip() for name in os.environ.get("PHALANX_REAL_RUNS", "").split(",")}
collect_ignore = (
    []
    if "mpi" in _asked
    else [
        "test_collective.py",
        "test_composed.py",
        "test_launcher.py",
        "test_listening.py",
        "test_training.py",
    ]
)
