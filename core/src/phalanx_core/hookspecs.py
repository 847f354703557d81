"""The hooks a phalanx plugin implements.

A plugin is a module (or any object) named by an entry point in the
``phalanx.plugins`` group. It implements any of the hooks below with the
:data:`hookimpl` marker; each hook returns the specs of the parts the plugin
gives, one kind per hook. A hook is called once per registry, when the
registry is built; it must be cheap and must not import the backend: specs
carry their code as ``"module:attr"`` strings, imported only when a name is
used.

A minimal plugin::

    # my_collective/plugin.py, declared in pyproject.toml as
    # [project.entry-points."phalanx.plugins"]
    # mine = "my_collective.plugin"
    from phalanx_core import CollectiveSpec, hookimpl

    @hookimpl
    def phalanx_collectives():
        return [CollectiveSpec(name="mine", target="my_collective.impl:MyCollective",
                               summary="my transport", needs=("my_transport",))]
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

from .specs import (
    AcceleratorSpec,
    CollectiveSpec,
    EnvironmentSpec,
    LauncherSpec,
    PrecisionSpec,
    StrategySpec,
)

__all__ = [
    "PROJECT",
    "hookimpl",
    "hookspec",
    "phalanx_accelerators",
    "phalanx_collectives",
    "phalanx_environments",
    "phalanx_launchers",
    "phalanx_precisions",
    "phalanx_strategies",
]

PROJECT = "phalanx"
#: Marks a hook specification (used here only).
hookspec = pluggy.HookspecMarker(PROJECT)
#: Marks a plugin's implementation of a hook: ``@hookimpl def phalanx_collectives(): ...``
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def phalanx_accelerators() -> Iterable[AcceleratorSpec] | None:
    """Declare the accelerators this plugin gives.

    Called once when a :class:`phalanx.Registry` is built, for every plugin
    that implements it.

    Return an iterable of :class:`~phalanx_core.AcceleratorSpec` (an empty
    one, or ``None``, means the plugin gives none). Each spec's target is an
    :class:`~phalanx_core.Accelerator` subclass.

    Example::

        @hookimpl
        def phalanx_accelerators():
            return [AcceleratorSpec(name="cpu", target="my_pkg.cpu:CPUAccelerator",
                                    summary="the CPU", needs=("torch",))]
    """


@hookspec
def phalanx_environments() -> Iterable[EnvironmentSpec] | None:
    """Declare the cluster environments this plugin gives.

    Called once when a :class:`phalanx.Registry` is built. Return an iterable
    of :class:`~phalanx_core.EnvironmentSpec` (``None`` means none). Each
    target is a :class:`~phalanx_core.ClusterEnvironment` subclass; its
    ``detect()`` is called in order of the spec's ``priority`` (highest
    first) when the user names no environment, so give it a priority above
    the default ``local`` (priority 0) and below the ones it should yield to.

    Example::

        @hookimpl
        def phalanx_environments():
            return [EnvironmentSpec(name="mycluster", target="my_pkg.env:MyCluster",
                                    summary="ranks from MYCLUSTER_RANK", priority=50)]
    """


@hookspec
def phalanx_launchers() -> Iterable[LauncherSpec] | None:
    """Declare the launchers this plugin gives.

    Called once when a :class:`phalanx.Registry` is built. Return an iterable
    of :class:`~phalanx_core.LauncherSpec` (``None`` means none). Each target
    is a :class:`~phalanx_core.Launcher` subclass. Set ``interactive=True``
    for a launcher that works in a notebook, and ``creates_processes=False``
    for one that runs in processes something else made.

    Example::

        @hookimpl
        def phalanx_launchers():
            return [LauncherSpec(name="mylauncher", target="my_pkg.launch:MyLauncher",
                                 summary="starts ranks through my scheduler")]
    """


@hookspec
def phalanx_collectives() -> Iterable[CollectiveSpec] | None:
    """Declare the collectives this plugin gives.

    Called once when a :class:`phalanx.Registry` is built. Return an iterable
    of :class:`~phalanx_core.CollectiveSpec` (``None`` means none). Each
    target is a :class:`~phalanx_core.Collective` subclass that meets the
    contract written in that class; every strategy can then use it by name
    (``phalanx.resolve("ddp", collective="mine")``).

    Example::

        @hookimpl
        def phalanx_collectives():
            return [CollectiveSpec(name="mine", target="my_pkg.coll:MyCollective",
                                   summary="my transport", needs=("my_transport",),
                                   install="pip install my-transport")]
    """


@hookspec
def phalanx_precisions() -> Iterable[PrecisionSpec] | None:
    """Declare the precisions this plugin gives.

    Called once when a :class:`phalanx.Registry` is built. Return an iterable
    of :class:`~phalanx_core.PrecisionSpec` (``None`` means none). Each target
    is a :class:`~phalanx_core.Precision` subclass; its constructor receives
    the accelerator and must refuse one it does not support.

    Example::

        @hookimpl
        def phalanx_precisions():
            return [PrecisionSpec(name="fp8-mixed", target="my_pkg.fp8:FP8Mixed",
                                  summary="fp8 matmuls under autocast")]
    """


@hookspec
def phalanx_strategies() -> Iterable[StrategySpec] | None:
    """Declare the strategies this plugin gives.

    Called once when a :class:`phalanx.Registry` is built. Return an iterable
    of :class:`~phalanx_core.StrategySpec` (``None`` means none). Each target
    is a :class:`~phalanx_core.Strategy` subclass; the spec names its default
    launcher and collective, the accelerators it works with, and whether it
    is parallel. Every default can be replaced by a flag.

    Example::

        @hookimpl
        def phalanx_strategies():
            return [StrategySpec(name="my_ddp", target="my_pkg.strategy:MyDDP",
                                 summary="DDP with my tweaks", launcher="subprocess",
                                 collective="torch", parallel=True)]
    """


#: Hook name for each kind, in the order parts are built.
HOOKS: dict[str, str] = {
    "accelerator": "phalanx_accelerators",
    "environment": "phalanx_environments",
    "precision": "phalanx_precisions",
    "collective": "phalanx_collectives",
    "launcher": "phalanx_launchers",
    "strategy": "phalanx_strategies",
}
