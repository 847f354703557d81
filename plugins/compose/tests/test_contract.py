"""The whole collective contract on ``compressed`` and ``hierarchical``,
over the torch collective (gloo), on 1 to 3 ranks of one node."""

from __future__ import annotations

from typing import Any, ClassVar

from phalanx.testing.suites import CollectiveSuite


class TestCompressedOverTorch(CollectiveSuite):
    collective = "compressed"
    options: ClassVar[dict[str, Any]] = {"inner": "torch"}


class TestCompressedWithErrorFeedback(CollectiveSuite):
    """The contract with error feedback on. Its timeout, reconfigure and
    liveness are those of TestCompressedOverTorch's collective: error
    feedback changes only the values sent (a residual kept per tensor), not
    how an operation waits, fails or is formed again; those three run
    there, not again here (CI's time)."""

    collective = "compressed"
    options: ClassVar[dict[str, Any]] = {"inner": "torch", "dtype": "fp16", "error_feedback": True}
    test_an_operation_that_times_out_says_which = None  # type: ignore[assignment]
    test_reconfigure_as_declared = None  # type: ignore[assignment]
    test_a_peer_killed_in_an_operation_is_named_within_the_timeout = None  # type: ignore[assignment]


class TestHierarchicalOnOneNode(CollectiveSuite):
    """On one node, the intra collective's (the 2-node layout is in
    test_hierarchical.py)."""

    collective = "hierarchical"
    options: ClassVar[dict[str, Any]] = {"intra": "torch", "inter": "torch"}
