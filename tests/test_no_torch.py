"""Listing and planning import no torch and no backend. Checked in fresh
subprocesses: in this process other tests have imported torch already."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess

BACKENDS = ("torch", "horovod", "torch_xla", "mpi4py")


def run_python(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


CHECK = f"""
import json, sys
{{body}}
print(json.dumps({{{{m: m in sys.modules for m in {BACKENDS!r}}}}}))
"""


@pytest.mark.parametrize(
    "body",
    [
        "import phalanx_core",
        "import phalanx",
        "import phalanx; r = phalanx.Registry(); assert r.names('strategy')",
        "import phalanx_torch.plugin, phalanx_torch.environments, phalanx_torch.launchers",
        "import io; from phalanx.cli import main; assert main(['list'], io.StringIO()) == 0",
        "import io; from phalanx.cli import main; assert main(['list', '--json'], io.StringIO()) == 0",
        (
            "import io; from phalanx.cli import main; "
            "assert main(['explain', '--plan-only', '--strategy', 'single_device', '--accelerator', 'cpu'], "
            "io.StringIO()) == 0"
        ),
    ],
    ids=[
        "core",
        "registry",
        "build-registry",
        "torch-entry-module",
        "list",
        "list-json",
        "explain-plan-only",
    ],
)
def test_imports_no_backend(body):
    imported = run_python(CHECK.format(body=body))
    assert imported == dict.fromkeys(BACKENDS, False)


def test_the_console_script_runs_list():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    data = json.loads(out.stdout)
    names = {(p["kind"], p["name"]) for p in data["parts"]}
    assert ("strategy", "single_device") in names
    assert any(p["name"] == "torch" and p["status"] == "loaded" for p in data["plugins"])


#: What listing needs none of: the interfaces, the strategy, the checkpoint
#: and launching code, and the standard modules behind them (issue 31, item
#: 9: `import phalanx` pulled zipfile, email, hashlib and concurrent.futures
#: in through the checkpoint code).
HEAVY = (
    "phalanx_core.strategy",
    "phalanx_core.checkpoint",
    "phalanx_core.saving",
    "phalanx_core.collective",
    "phalanx_core.launching",
    "phalanx._build",
    "phalanx._resolve",
    "zipfile",
    "concurrent.futures",
    "hashlib",
    # Entry points are read from the dist-info folders: importlib.metadata
    # (18-20 ms, with email) only for a zip or another package's finder.
    "importlib.metadata",
    "email",
)


@pytest.mark.parametrize(
    ("body", "allowed"),
    [
        ("import phalanx", ()),
        ("import phalanx; phalanx.Registry()", ()),
        ("import io; from phalanx.cli import main; assert main(['list'], io.StringIO()) == 0", ()),
    ],
    ids=["import", "registry", "list"],
)
def test_listing_loads_only_what_it_uses(body, allowed):
    code = f"import json, sys\n{body}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m not in allowed] == [], loaded
    from phalanx_core import Strategy  # the lazy names still import as before

    assert Strategy.__module__ == "phalanx_core.strategy"
