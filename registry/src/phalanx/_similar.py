"""Close matches for a mistyped name (difflib, imported only when a name
was mistyped, not on every listing)."""

from __future__ import annotations

from collections.abc import Iterable


def close_matches(word: str, candidates: Iterable[str], n: int) -> list[str]:
    """difflib's close matches of ``word`` among ``candidates``."""
    import difflib

    return difflib.get_close_matches(word, sorted(candidates), n=n)
