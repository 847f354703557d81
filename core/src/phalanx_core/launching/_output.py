"""What a launcher reads from its ranks' output: the traceback each rank
printed, where the launcher saw only its output (a tool that runs the
ranks, mpirun or horovodrun, reports no traceback of its own)."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["last_tracebacks"]

#: How phalanx marks each line a rank writes (``phalanx run``): ``[rankN]: ``.
_RANK_MARK = re.compile(r"^\[rank\d+\]: ?")
#: The lines between chained tracebacks.
_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
_HEADER = "Traceback (most recent call last):"


def last_tracebacks(lines: Iterable[tuple[float, str]], tag: re.Pattern[str]) -> dict[int, tuple[str, float]]:
    """Each rank's last traceback (with the tracebacks chained to it) in its
    output, and when its last line was read. ``lines`` are ``(when, line)``
    as the launcher read them; ``tag`` matches a rank's stderr line as the
    tool that ran the ranks marks it, its first group the rank, its second
    the text (``[1,0]<stderr>:text`` under ``mpirun --tag-output``).
    Other lines are left out, and a ``[rankN]: `` mark phalanx put is taken
    off the text."""
    said: dict[int, list[tuple[float, str]]] = {}
    for when, line in lines:
        tagged = tag.match(line.rstrip("\n"))
        if tagged is not None:
            text = _RANK_MARK.sub("", tagged.group(2))
            said.setdefault(int(tagged.group(1)), []).append((when, text))
    found = {}
    for rank, written in said.items():
        texts = [text for _, text in written]
        headers = [i for i, text in enumerate(texts) if text.startswith(_HEADER)]
        if not headers:
            continue
        start = headers[-1]
        # The exception's own line (the first that is not indented) ends it.
        end = next((i for i in range(start + 1, len(texts)) if texts[i][:1].strip()), None)
        if end is None:
            continue
        while True:  # take in the tracebacks this one is chained to
            above = next((i for i in range(start - 1, -1, -1) if texts[i].strip()), -1)
            earlier = [h for h in headers if h < above]
            if above < 0 or texts[above].strip() not in _CHAINED or not earlier:
                break
            start = earlier[-1]
        found[rank] = ("\n".join(texts[start : end + 1]) + "\n", written[end][0])
    return found
