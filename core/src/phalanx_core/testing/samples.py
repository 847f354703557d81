"""Did a job that restarted train on every sample once? For tests and
benchmarks of jobs that survive a lost rank or node.

The job's every rank appends one line per finished step to a file
``seen-<anything>.txt`` in one folder (the folder every node shares)::

    <restarts> <resumed step> <world size> <epoch> <step> <sample> <sample> ...

A round of the job is told apart by its restart count and the step it
resumed from. A round's steps past the step the next round resumed from
were lost with it (in no checkpoint), and do not count::

    finding = sample_finding(out, samples=96, epochs=2)
    assert finding is None, finding
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

__all__ = ["rounds_taking_over", "sample_finding", "trained"]

#: A round: (its restart count, the step it resumed from).
Round = tuple[int, int]


def _lines(out: Path) -> list[list[int]]:
    return [
        list(map(int, line.split()))
        for log in out.glob("seen-*.txt")
        for line in log.read_text().splitlines()
    ]


def trained(out: Path, epochs: int) -> dict[int, Counter[int]]:
    """Every sample each epoch trained on, counted over every rank's log,
    without the steps a round lost."""
    lines = [((r, resumed), epoch, step, indices) for r, resumed, _w, epoch, step, *indices in _lines(out)]
    following = dict(itertools.pairwise(sorted({key for key, *_ in lines})))
    counts: dict[int, Counter[int]] = {e: Counter() for e in range(epochs)}
    for key, epoch, step, indices in lines:
        if key in following and step > following[key][1]:
            continue
        counts[epoch].update(indices)
    return counts


def rounds_taking_over(out: Path) -> dict[int, list[int]]:
    """Per epoch, the world sizes of the rounds that took it over from a
    round of another world size."""
    first: dict[Round, tuple[int, int]] = {}  # round -> (its first epoch, world)
    for restarts, resumed, world, epoch, *_ in _lines(out):
        key = (restarts, resumed)
        first[key] = min(first.get(key, (epoch, world)), (epoch, world))
    found: dict[int, list[int]] = {}
    for before, after in itertools.pairwise(sorted(first)):
        if first[after][1] != first[before][1]:
            found.setdefault(first[after][0], []).append(first[after][1])
    return found


def sample_finding(out: Path, samples: int, epochs: int) -> str | None:
    """``None`` when every one of ``samples`` samples of each epoch was
    trained on exactly once, but for the repeats ``DistributedSampler``
    adds where a round on another number of ranks took over the rest of an
    epoch that does not split evenly over them (at most ``world - 1`` per
    such round); else what is wrong, in a sentence."""
    changed = rounds_taking_over(out)
    for epoch, seen in trained(out, epochs).items():
        missing = sorted(set(range(samples)) - set(seen))
        if missing:
            return f"epoch {epoch}: {len(missing)} samples never trained ({missing[:10]}...)"
        repeats = sum(n - 1 for n in seen.values())
        allowed = sum(world - 1 for world in changed.get(epoch, []))
        if repeats > allowed:
            repeated = [i for i, n in seen.items() if n > 1]
            return f"epoch {epoch}: {repeats} repeats, {allowed} allowed ({repeated}; taking over: {changed})"
    return None
