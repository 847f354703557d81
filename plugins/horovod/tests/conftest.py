"""phalanx-horovod's tests that need horovod run in the ``horovod`` nox
session, which builds horovod and sets ``PHALANX_REAL_RUNS=horovod``; there a
missing horovod fails, never skips. Elsewhere (the ``tests`` session, where
horovod is not installed) only the tests that need no horovod run:
installation and the environment."""

from __future__ import annotations

import os

_asked = {name.strip() for name in os.environ.get("PHALANX_REAL_RUNS", "").split(",")}
_NEED_HOROVOD = [
    "test_conformance.py",
    "test_collective.py",
    "test_strategy.py",
    "test_horovodrun.py",
    "test_listening.py",
    "test_training.py",
]
collect_ignore = [] if "horovod" in _asked else _NEED_HOROVOD
