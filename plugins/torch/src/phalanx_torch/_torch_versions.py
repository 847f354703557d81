"""Where the torch releases phalanx supports differ, each difference once.

phalanx-torch supports the torch releases its plugin's specs declare
(:data:`phalanx_torch.plugin.TORCH`: ``torch>=2.9``); the registry refuses
the others before anything imports torch. Inside that range the releases
differ in a few things phalanx meets; each has one function here, named for
what it does, its docstring naming the releases it serves, and every caller
goes through it (no ``try``/``except`` around a torch call elsewhere stands
for a version). The nox session ``torch_range`` runs the plugin's tests on
the oldest and the newest release of the range.

Importing this module imports torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["RELEASE", "gloo_connection_lines_hidden", "premul_sum_factor"]


def _release(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


#: The (major, minor) release of the torch in this process.
RELEASE = _release(torch.__version__)

# -- torch 2.9: gloo prints every connection ---------------------------------

#: torch 2.9's gloo writes a line to standard output (C++ ``std::cout``, so
#: neither Python's ``sys.stdout`` nor any logging level reaches it) each
#: time a rank of a gloo group has connected to its peers: ``[Gloo] Rank 0
#: is connected to 1 peer ranks. Expected number of connected peer ranks is
#: : 1``. gloo made it a log line at INFO (off by default) in September
#: 2025; torch 2.11, 2.13 and 2.14 print nothing (2.10 was not tried).
_GLOO_PRINTS_CONNECTIONS = RELEASE < (2, 10)
_GLOO_LINE = re.compile(rb"^\[Gloo\] Rank \d+ is (NOT )?connected to")


#: File descriptor 1 is the process's: one group is made with it redirected
#: at a time (a second thread would take the first one's pipe for the real
#: output, and leave it in place).
_STDOUT = threading.Lock()


@contextlib.contextmanager
def gloo_connection_lines_hidden() -> Iterator[None]:
    """Make a torch process group with gloo's connection lines left out of
    this process's standard output (torch 2.9; on later releases this does
    nothing). While the group is made, file descriptor 1 is a pipe whose
    other lines a thread passes on to the real standard output as they come,
    so nothing else written meanwhile is lost or held back. A process
    without a file descriptor 1 makes its group as it is."""
    if not _GLOO_PRINTS_CONNECTIONS:
        yield
        return
    with _STDOUT:
        sys.stdout.flush()
        try:
            real = os.dup(1)
        except OSError:  # no standard output to keep clean
            yield
            return
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        thread = threading.Thread(target=_pass_on, args=(read, real), name="phalanx-gloo-lines", daemon=True)
        thread.start()
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(real, 1)  # the pipe's last writer closes: the thread reads its end
            thread.join()
            os.close(real)


def _pass_on(read: int, real: int) -> None:
    """Copy lines from ``read`` to ``real`` until the pipe closes, leaving
    out gloo's connection lines."""
    pending = b""
    with open(read, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            _write(real, b"".join(line + b"\n" for line in lines if not _GLOO_LINE.match(line)))
    if pending and not _GLOO_LINE.match(pending):
        _write(real, pending)


def _write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


# -- before torch 2.13: PREMUL_SUM's factor cannot be read ------------------
# torch made ReduceOp.PREMUL_SUM callable and its factor readable from
# Python in 2026: 2.13 and 2.14 have both, 2.9 and 2.11 neither (2.11 seen
# on a GPU machine). Both are found by looking, not by release number.


def premul_sum_factor(op: Any) -> float | None:
    """The factor of a ``PREMUL_SUM`` ``ReduceOp``; None where torch does
    not let Python read it (torch 2.9's ``ReduceOp`` has no ``factor``)."""
    factor = getattr(op, "factor", None)
    return None if factor is None else float(factor)
