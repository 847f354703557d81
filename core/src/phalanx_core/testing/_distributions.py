"""Throw-away distributions: real ``*.dist-info`` folders on ``sys.path``."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

__all__ = ["write_distribution"]

GROUP = "phalanx.plugins"


def write_distribution(
    root: Path,
    name: str,
    *,
    version: str = "0.1.0",
    entry_points: Mapping[str, str] | None = None,
    modules: Mapping[str, str] | None = None,
    group: str = GROUP,
) -> Path:
    """Write an installed-looking distribution into ``root`` and return ``root``.

    ``entry_points`` maps entry-point names to ``"module"`` or
    ``"module:attr"`` in the ``phalanx.plugins`` group; ``modules`` maps
    dotted module names to their source (dedented), written as files under
    ``root``. Put ``root`` on ``sys.path`` (the fixture does) and
    ``importlib.metadata`` finds the distribution exactly as it finds a
    wheel installed by pip.
    """
    root.mkdir(parents=True, exist_ok=True)
    normalized = name.replace("-", "_")
    info = root / f"{normalized}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    lines = [f"[{group}]"] + [f"{ep} = {target}" for ep, target in (entry_points or {}).items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    names = set(modules or {})
    for module, source in (modules or {}).items():
        parts = module.split(".")
        is_package = any(other.startswith(module + ".") for other in names)
        folder = root.joinpath(*(parts if is_package else parts[:-1]))
        folder.mkdir(parents=True, exist_ok=True)
        for depth in range(1, len(parts)):
            init = root.joinpath(*parts[:depth], "__init__.py")
            if not init.exists():
                init.write_text("", encoding="utf-8")
        target = folder / ("__init__.py" if is_package else f"{parts[-1]}.py")
        target.write_text(textwrap.dedent(source), encoding="utf-8")
    importlib.invalidate_caches()
    return root


def forget_modules(names: set[str]) -> None:
    """Drop ``names`` and their submodules from ``sys.modules``."""
    for loaded in list(sys.modules):
        if loaded.split(".")[0] in names:
            del sys.modules[loaded]
