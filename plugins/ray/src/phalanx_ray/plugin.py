"""phalanx-ray's entry module: specs only; imports neither ray nor torch.

Declared in pyproject.toml as the ``ray`` entry point of the
``phalanx.plugins`` group.
"""

from __future__ import annotations

from phalanx_core import EnvironmentSpec, LauncherSpec, hookimpl

INSTALL = "pip install 'phalanx-ray[ray]'  (ray[default] 2.60.0 and torch)"
_NEEDS = ("ray", "torch>=2.9")


@hookimpl
def phalanx_environments() -> list[EnvironmentSpec]:
    # Above slurm (80) and horovod (90): a Ray cluster inside a Slurm
    # allocation gives its actors the allocation's SLURM_* variables, and
    # there the ranks are Ray's. Below torchelastic (100).
    return [
        EnvironmentSpec(
            name="ray",
            target="phalanx_ray.environment:RayEnvironment",
            summary="ranks that the ray launcher started as Ray actors: ranks from the variables it sets",
            priority=95,
        )
    ]


@hookimpl
def phalanx_launchers() -> list[LauncherSpec]:
    return [
        LauncherSpec(
            name="ray",
            target="phalanx_ray.launcher:RayLauncher",
            summary="one Ray actor per rank in a placement group, on a local Ray instance or a cluster "
            "(address=); keep_alive=True keeps them warm between launches",
            interactive=True,
            environment="ray",
            needs=_NEEDS,
            install=INSTALL,
        )
    ]
