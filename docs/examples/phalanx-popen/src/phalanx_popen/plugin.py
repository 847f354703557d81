"""The entry module: declarations only (``phalanx list`` imports it)."""

from phalanx_core import LauncherSpec, hookimpl


@hookimpl
def phalanx_launchers():
    return [
        LauncherSpec(
            name="popen",
            target="phalanx_popen.launcher:PopenLauncher",  # imported when used
            summary="one subprocess.Popen per rank on this machine",
        )
    ]
