"""What the registry says of phalanx-ray, with or without ray installed: both
parts are listed, the launcher available only with ray, and listing them
imports neither ray nor torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

HAVE_RAY = importlib.util.find_spec("ray") is not None


def test_listed_with_the_install_line_and_without_importing_ray_or_torch():
    code = (
        "import json, sys, phalanx\n"
        "parts = [dict(kind=str(e.kind), name=e.name, missing=e.missing()) for e in phalanx.Registry().entries()]\n"
        "print(json.dumps({'parts': parts, 'imported': [m for m in ('ray', 'torch') if m in sys.modules]}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    report = json.loads(done.stdout)
    assert report["imported"] == []
    parts = {(p["kind"], p["name"]): p for p in report["parts"]}
    assert parts[("environment", "ray")]["missing"] in ((), [], None)
    launcher = parts[("launcher", "ray")]
    assert bool(launcher["missing"]) is (not HAVE_RAY), launcher


def test_phalanx_list_names_the_install_line_where_ray_is_missing():
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    parts = {(p["kind"], p["name"]): p for p in json.loads(done.stdout)["parts"]}
    launcher = parts[("launcher", "ray")]
    assert launcher["distribution"] == "phalanx-ray"
    assert launcher["available"] is HAVE_RAY
    if not HAVE_RAY:
        assert "pip install 'phalanx-ray[ray]'" in launcher["reason"]
