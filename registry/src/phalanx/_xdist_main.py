"""A pytest plugin for running phalanx's tests in pytest-xdist workers
(``pytest -p phalanx._xdist_main -n 2``).

A worker's main module is execnet's ``python -c`` program, which has no
file: there phalanx sees no script to re-run, as in a REPL, and refuses the
launchers that re-run it (``spawn``, ``subprocess``). Under plain pytest the
main module is pytest's own ``__main__``; this gives a worker's main module
that file too, so that a test sees what it sees without xdist. Nothing is
changed outside a worker.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def pytest_configure(config: Any) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__file__", None):
        return
    import pytest

    main.__file__ = str(Path(pytest.__file__).with_name("__main__.py"))
