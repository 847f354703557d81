"""The whole collective contract on ``compressed`` and ``hierarchical``,
over the torch collective (gloo), on 1 to 3 ranks of one node."""

from __future__ import annotations

from typing import Any, ClassVar

from phalanx.testing.suites import CollectiveSuite


class TestCompressedOverTorch(CollectiveSuite):
    collective = "compressed"
    options: ClassVar[dict[str, Any]] = {"inner": "torch"}


class TestCompressedWithErrorFeedback(CollectiveSuite):
    collective = "compressed"
    options: ClassVar[dict[str, Any]] = {"inner": "torch", "dtype": "fp16", "error_feedback": True}


class TestHierarchicalOnOneNode(CollectiveSuite):
    """On one node, the intra collective's (the 2-node layout is in
    test_hierarchical.py)."""

    collective = "hierarchical"
    options: ClassVar[dict[str, Any]] = {"intra": "torch", "inter": "torch"}
