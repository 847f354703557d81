"""What a launcher reads from its ranks' output: whole lines marked with
their rank, out of a tool that tags each write (:class:`RankLines`), and
the traceback each rank printed, where the launcher saw only its output (a
tool that runs the ranks, mpirun or horovodrun, reports no traceback of its
own)."""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Iterable
from typing import IO, Any

__all__ = ["RANK_LINE", "RankLines", "last_tracebacks", "relay_output"]

#: How phalanx marks each line a rank writes (``phalanx run``): ``[rankN]: ``.
_RANK_MARK = re.compile(r"^\[rank\d+\]: ?")
#: A line :class:`RankLines` gives (``[rankN]: text``): the rank, the text.
RANK_LINE = re.compile(r"^\[rank(\d+)\]: ?(.*)$")
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


class RankLines:
    """Whole lines, each marked ``[rankN]: `` as every phalanx launcher marks
    a rank's output, out of the output of a tool that tags each *write* of a
    rank rather than each line (``mpirun --tag-output``: ``[1,0]<stdout>:``,
    ``horovodrun``: ``[0]<stdout>:``). There, a line written in two writes
    (``print()`` unbuffered writes its end of line apart) gets a second tag
    in its middle, and another rank's write can come between its halves.

    Feed it the tool's output as it comes, one stream at a time (one
    ``RankLines`` for stdout, another for stderr); each call returns the
    lines completed. ``tag`` matches one tag, its first group the rank. Text
    before any tag at the start of a line is the tool's own (mpirun's
    report), passed on unmarked, unless a rank's write without a line end
    came just before it, which it continues.
    """

    def __init__(self, tag: re.Pattern[str]) -> None:
        self._tag = tag
        self._open: dict[int, str] = {}
        self._last: int | None = None

    def feed(self, text: str) -> list[str]:
        out: list[str] = []
        tags = list(self._tag.finditer(text))
        head = text[: tags[0].start()] if tags else text
        if head:
            if self._last is not None and self._open.get(self._last):
                self._add(self._last, head, out)
            else:
                out.append(head if head.endswith("\n") or not tags else head + "\n")
        for i, found in enumerate(tags):
            end = tags[i + 1].start() if i + 1 < len(tags) else len(text)
            self._last = int(found.group(1))
            self._add(self._last, text[found.end() : end], out)
        return out

    def close(self) -> list[str]:
        """The lines a rank left without a line end, ended."""
        out = [f"[rank{rank}]: {rest}\n" for rank, rest in sorted(self._open.items()) if rest]
        self._open.clear()
        return out

    def _add(self, rank: int, piece: str, out: list[str]) -> None:
        pending = self._open.get(rank, "") + piece
        *lines, rest = pending.split("\n")
        out.extend(f"[rank{rank}]: {line}\n" for line in lines)
        self._open[rank] = rest


def relay_output(
    stream: IO[str],
    out: IO[str],
    tag: re.Pattern[str] | None = None,
    kept: collections.deque[tuple[float, str]] | None = None,
) -> threading.Thread:
    """Start a thread that passes ``stream`` (a pipe from the tool that runs
    the ranks) on to ``out`` as it comes, until it ends. With ``tag`` (see
    :class:`RankLines`), as whole lines marked ``[rankN]: ``. Each line
    passed on is also appended to ``kept``, with when it was read (for
    :func:`last_tracebacks` and the tool's own report). Join the thread
    after the tool has exited."""

    def run() -> None:
        whole = RankLines(tag) if tag is not None else None
        for text in stream:
            _write(whole.feed(text) if whole is not None else [text], out, kept)
        if whole is not None:
            _write(whole.close(), out, kept)

    thread = threading.Thread(target=run, name="phalanx-relay", daemon=True)
    thread.start()
    return thread


def _write(lines: list[str], out: Any, kept: collections.deque[tuple[float, str]] | None) -> None:
    for line in lines:
        if kept is not None:
            kept.append((time.time(), line))
        out.write(line)
    out.flush()
