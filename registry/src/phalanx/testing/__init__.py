"""The registry's testing kit for plugin authors. Opt in from your
``conftest.py``::

    pytest_plugins = ["phalanx_core.testing", "phalanx.testing"]

Fixtures:

``phalanx_registry``
    A factory for fresh :class:`phalanx.Registry` objects (keyword arguments
    are passed on), beside core's ``phalanx_distribution``.

The conformance suites, each a class to subclass in your tests, are in
:mod:`phalanx.testing.suites`: ``CollectiveSuite``, ``TrafficSuite``,
``LauncherSuite``, ``EnvironmentSuite``, ``AcceleratorSuite``. They run real
jobs through :func:`phalanx.resolve`, which is why they live here, in the
registry's distribution, and not in phalanx-core (which imports nothing
above it). They need pytest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["phalanx_registry"]


@pytest.fixture
def phalanx_registry() -> Callable[..., Any]:
    """A factory for fresh registries: ``phalanx_registry(plugins=(...), autoload=True)``."""
    import phalanx

    def make(**kwargs: Any) -> Any:
        return phalanx.Registry(**kwargs)

    return make
