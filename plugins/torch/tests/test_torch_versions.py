"""The differences between the supported torch releases, each on the torch
this session runs (``nox -s torch_range`` runs these on both ends)."""

from __future__ import annotations

import os
import threading

import torch.distributed as dist
from reduce_ops import premul_sum

from phalanx_torch import _torch_versions as versions

GLOO = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"


def test_gloo_connection_lines_are_left_out_on_torch_2_9_and_nothing_else_is(capfd):
    """What reaches file descriptor 1 while a group is made (as gloo's
    std::cout does): gloo's lines go on torch 2.9 only, every other line
    comes through in order, a line written in pieces and one from another
    thread included."""
    with versions.gloo_connection_lines_hidden():
        os.write(1, b"before\n" + GLOO + b"a line in ")
        os.write(1, b"two pieces\n")
        writer = threading.Thread(target=os.write, args=(1, b"from a thread\n"))
        writer.start()
        writer.join()
        os.write(1, GLOO.replace(b"is connected", b"is NOT connected") + b"last, with no newline")
    os.write(1, b"\nafter\n")
    out = capfd.readouterr().out
    kept = "before\na line in two pieces\nfrom a thread\nlast, with no newline\nafter\n"
    if versions.RELEASE < (2, 10):
        assert out == kept
    else:
        assert out == kept.replace("before\n", "before\n" + GLOO.decode()).replace(
            "from a thread\n", "from a thread\n" + GLOO.decode().replace("is connected", "is NOT connected")
        )


def test_premul_sum_is_made_and_its_factor_read_where_torch_allows():
    op = premul_sum(0.25)
    assert op.op == dist.ReduceOp.PREMUL_SUM
    factor = versions.premul_sum_factor(op)
    if versions.RELEASE >= (2, 13):
        assert factor == 0.25
    elif versions.RELEASE == (2, 9):
        assert factor is None
    else:  # not tested in CI: one of the two
        assert factor in (None, 0.25)
    assert versions.premul_sum_factor(dist.ReduceOp.SUM) is None
