#!/usr/bin/env python3
"""The house's counts (issue "The house"): what each package's source
uses that it should not, counted the same way before and after a change.

    python3 .ci/house_counts.py          # the counts
    python3 .ci/house_counts.py -v       # and every place counted

Reads the source as text; imports nothing of phalanx or torch. The store
clients a node and the parses of ``--rendezvous`` a launch are counted by
tests (``plugins/torch/tests/test_launch_plans.py``), not here.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = (
    sorted(ROOT.glob("core/src/*"))
    + sorted(ROOT.glob("registry/src/*"))
    + sorted(ROOT.glob("plugins/*/src/*"))
)
#: The fault-tolerance modules (issue 59's "Any in the fault-tolerance modules").
FAULT_TOLERANCE = [
    "plugins/torch/src/phalanx_torch/_nodes",
    "plugins/torch/src/phalanx_torch/_launch",
    "plugins/torch/src/phalanx_torch/launchers.py",
    "plugins/torch/src/phalanx_torch/nodes.py",
    "plugins/torchft/src/phalanx_torchft",
]

#: ``torch.x._name``, ``from torch.x import _name``, ``from torch.x._mod import``.
PRIVATE_TORCH = [
    re.compile(r"\btorch(?:\.[A-Za-z]\w*)*\.(_[A-Za-z]\w*)"),
    re.compile(r"^\s*from (torch(?:\.\w+)*) import \(?([^)#]*)"),
    re.compile(r"\b(?:c10d|_c10d|dist|distributed_c10d)\.(_[A-Za-z]\w*)"),
]
ENV_WRITE = re.compile(r"os\.environ\[[^]]+\]\s*=|os\.environ\.(?:setdefault|update)\(|os\.putenv\(")


def files(*roots: pathlib.Path) -> list[pathlib.Path]:
    out: list[pathlib.Path] = []
    for root in roots:
        out.extend([root] if root.is_file() else sorted(root.rglob("*.py")))
    return out


def code_lines(path: pathlib.Path):
    """(number, line) of the lines outside docstrings and comments."""
    in_doc = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if in_doc:
            if in_doc in stripped:
                in_doc = None
            continue
        for quote in ('"""', "'''"):
            if stripped.startswith((quote, "r" + quote)):
                if stripped.count(quote) == 1:
                    in_doc = quote
                break
        else:
            if not stripped.startswith("#"):
                yield number, line.split("  #")[0]


def private_torch() -> list[str]:
    found = []
    for path in files(*SOURCES):
        for number, line in code_lines(path):
            names = set()
            for pattern in PRIVATE_TORCH[0], PRIVATE_TORCH[2]:
                names.update(m.group(1) for m in pattern.finditer(line) if not m.group(1).startswith("__"))
            match = PRIVATE_TORCH[1].match(line)
            if match:
                module, imported = match.groups()
                if any(part.startswith("_") for part in module.split(".")):
                    names.add(module)
                names.update(
                    n.strip().split(" as ")[0] for n in imported.split(",") if n.strip().startswith("_")
                )
            if re.search(r":\s*Any\s*=\s*(?:torch|c10d|distributed_c10d|dist)\b", line):
                names.add("(an alias typed Any: " + line.strip() + ")")
            for name in sorted(names):
                found.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    return found


def anys() -> list[str]:
    found = []
    for path in files(*(ROOT / p for p in FAULT_TOLERANCE)):
        for number, line in code_lines(path):
            if re.search(r"\bAny\b", line) and "import" not in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def cross_private() -> list[str]:
    found = []
    packages = {path.name for path in SOURCES}
    for source in SOURCES:
        for path in files(source):
            for number, line in code_lines(path):
                for other in packages - {source.name}:
                    if re.search(rf"\b{other}(?:\.\w+)*\._[A-Za-z]\w*", line) or re.match(
                        rf"\s*from {other}(?:\.\w+)* import .*\b_[A-Za-z]\w*", line
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def env_writes() -> list[str]:
    found = []
    for path in files(*SOURCES):
        for number, line in code_lines(path):
            if ENV_WRITE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def loggers() -> tuple[int, int]:
    modules = [p for p in files(*SOURCES) if p.name != "__init__.py" and p.stat().st_size > 0]
    with_logger = [p for p in modules if "logging.getLogger(__name__)" in p.read_text()]
    return len(with_logger), len(modules)


def long_modules() -> list[str]:
    out = []
    for path in files(*SOURCES):
        count = len(path.read_text().splitlines())
        if count > 500:
            out.append(f"{count:5d} {path.relative_to(ROOT)}")
    return sorted(out, reverse=True)


def duplicate_pairs() -> list[str] | None:
    if shutil.which("duplicates") is None:
        return None
    text = subprocess.run(
        ["duplicates", "--most", "200", "--seconds", "200", "--repo", str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    pattern = re.compile(r"^D\d+ \S*/src/\S* ~ \S*/src/")
    return [line for line in text.splitlines() if pattern.match(line) and "boilerplate" not in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="list every place counted")
    args = parser.parse_args()
    counts = [
        ("private torch names used (places)", private_torch()),
        ("Any in the fault-tolerance modules", anys()),
        ("private names imported across distributions", cross_private()),
        ("environment variables written by package code", env_writes()),
        ("modules over 500 lines", long_modules()),
    ]
    dups = duplicate_pairs()
    if dups is not None:
        counts.append(("duplicates pairs in package source (not boilerplate)", dups))
    for title, places in counts:
        print(f"{len(places):4d}  {title}")
        if args.verbose:
            for place in places:
                print(f"        {place}")
    with_logger, modules = loggers()
    print(f"{with_logger:4d}  modules with a logger (of {modules})")


if __name__ == "__main__":
    main()
