"""What the registry says of phalanx-horovod with or without horovod: the
parts are listed either way, available only with horovod, and resolving one
without it raises UnavailableError saying how to install it. The entry module
imports neither horovod nor torch.

Where horovod is installed (the ``horovod`` session), "without horovod" is
a subprocess in which ``sys.modules["horovod"] = None`` makes Python's own
import system (and ``importlib.util.find_spec``) find no horovod."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.subprocess

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None
PARTS = (("collective", "horovod"), ("launcher", "horovod"), ("strategy", "horovod"))


def _python(code: str, *, hide_horovod: bool) -> subprocess.CompletedProcess[str]:
    prelude = "import sys\nsys.modules['horovod'] = None\n" if hide_horovod else ""
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _listed(hide_horovod: bool) -> dict[tuple[str, str], dict]:
    done = _python(
        """
        import sys
        from phalanx.cli import main
        sys.exit(main(["list", "--json"]))
        """,
        hide_horovod=hide_horovod,
    )
    assert done.returncode == 0, done.stderr
    return {(p["kind"], p["name"]): p for p in json.loads(done.stdout)["parts"]}


def test_listed_as_unavailable_with_the_install_line_without_horovod():
    parts = _listed(hide_horovod=True)
    for key in PARTS:
        part = parts[key]
        assert part["distribution"] == "phalanx-horovod"
        assert part["available"] is False, part
        assert "horovod" in part["reason"] and "HOROVOD_WITH_PYTORCH=1" in part["reason"], part
    # the environment reads variables only: it needs nothing
    assert parts[("environment", "horovod")]["available"] is True


def test_listed_as_available_with_horovod():
    if not HAVE_HOROVOD:  # the plain `tests` session: the test above is the one that applies
        assert all(not p["available"] for k, p in _listed(hide_horovod=False).items() if k in PARTS)
        return
    parts = _listed(hide_horovod=False)
    assert all(parts[key]["available"] for key in PARTS), [parts[k] for k in PARTS]


def test_resolving_without_horovod_raises_unavailable_saying_how_to_install():
    for flags in (
        '"horovod", accelerator="cpu", devices=2',
        '"ddp", accelerator="cpu", collective="horovod", launcher="fork"',
    ):
        done = _python(
            f"""
            import phalanx
            from phalanx_core import UnavailableError
            try:
                phalanx.resolve({flags})
            except UnavailableError as exc:
                print("UNAVAILABLE", exc)
            """,
            hide_horovod=True,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("UNAVAILABLE"), (flags, done.stdout, done.stderr)
        assert "horovod" in done.stdout and "pip install" in done.stdout, done.stdout


def test_the_entry_module_imports_neither_horovod_nor_torch():
    done = _python(
        """
        import sys
        from phalanx.cli import main
        import io, contextlib
        with contextlib.redirect_stdout(io.StringIO()):
            main(["list"])
        import phalanx_horovod.plugin, phalanx_horovod.environment
        print(sorted(m for m in ("horovod", "torch") if m in sys.modules))
        """,
        hide_horovod=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
