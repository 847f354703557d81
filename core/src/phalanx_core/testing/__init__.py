"""A testing kit for plugin authors. Opt in from your ``conftest.py``::

    pytest_plugins = ["phalanx_core.testing"]

Fixtures:

``phalanx_distribution``
    A factory that installs a throw-away distribution — a real
    ``*.dist-info`` folder with an ``entry_points.txt``, and the plugin's
    modules beside it — into a temporary directory put on ``sys.path``.
    ``importlib.metadata`` finds it exactly as it finds a wheel. Everything
    is removed after the test::

        def test_listed(phalanx_distribution, phalanx_registry):
            phalanx_distribution("my-plugin", entry_points={"mine": "my_plugin"},
                                 modules={"my_plugin": PLUGIN_SOURCE})
            registry = phalanx_registry()
            assert registry.get("collective", "mine")

(``phalanx_registry`` comes from the registry's own kit,
:mod:`phalanx.testing`.) Also here, for tests of any part: the collective
contract's checks (:mod:`phalanx_core.testing.contract`), the processes a
job left behind (:mod:`phalanx_core.testing.processes`), hosts made of
network namespaces (:mod:`phalanx_core.testing.hosts`). The conformance
suites, which run real jobs through ``phalanx.resolve``, are in
:mod:`phalanx.testing.suites`: phalanx-core, the bottom of the house,
imports nothing above it.

Nothing here is registered unless a test suite asks for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Mapping
from pathlib import Path

import pytest

from ._distributions import GROUP, forget_modules, write_distribution

__all__ = ["GROUP", "phalanx_distribution", "write_distribution"]


@pytest.fixture
def phalanx_distribution(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Generator[Callable[..., Path], None, None]:
    """Install throw-away plugin distributions for one test (see the module docs)."""
    installed: set[str] = set()

    def install(
        name: str,
        *,
        version: str = "0.1.0",
        entry_points: Mapping[str, str] | None = None,
        modules: Mapping[str, str] | None = None,
        group: str = GROUP,
    ) -> Path:
        root = tmp_path_factory.mktemp(f"dist-{name}")
        write_distribution(
            root, name, version=version, entry_points=entry_points, modules=modules, group=group
        )
        monkeypatch.syspath_prepend(str(root))
        installed.update(m.split(".")[0] for m in (modules or {}))
        return root

    yield install
    forget_modules(installed)
    sys.path_importer_cache.clear()
