"""The argument checks, waits and plan comparison that collectives share,
so that every implementation refuses the same mistakes in the same words."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

from ._operations import REDUCE_OPS, Tensor
from .errors import CollectiveTimeoutError, MisconfigurationError, PlanMismatchError

__all__ = [
    "check_into",
    "check_one_per_rank",
    "check_rank",
    "check_reduce_op",
    "check_scatter_list",
    "plan_mismatch",
    "poll",
    "timed_out",
]


def check_reduce_op(
    op: str, allowed: Sequence[str] = REDUCE_OPS, *, collective: str = "", is_bool: bool = False
) -> str:
    """Return ``op`` lower-cased if it is one of ``allowed`` (and, for a bool
    tensor, ``"min"`` or ``"max"``); raise :class:`MisconfigurationError`
    saying what is allowed otherwise."""
    if isinstance(op, str):
        name = op.lower()
        if name in allowed:
            if is_bool and name not in ("min", "max"):
                raise MisconfigurationError(
                    f"op={op!r} on a bool tensor: only 'min' (logical and) and 'max' (logical or) "
                    "are defined for bool tensors; convert to an integer dtype for counting"
                )
            return name
    who = f" for the {collective!r} collective" if collective else ""
    raise MisconfigurationError(
        f"op={op!r} is not a reduce op{who}; use one of {', '.join(map(repr, allowed))}"
    )


def check_rank(value: int, world_size: int, *, operation: str, argument: str) -> int:
    """Return ``value`` if it is a rank of a group of ``world_size``; raise
    :class:`MisconfigurationError` naming the operation otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world_size:
        raise MisconfigurationError(
            f"{operation}({argument}={value!r}): the ranks of this group are 0..{world_size - 1}; "
            f"give {argument} as a rank of the group (not a world rank, in a subgroup)"
        )
    return value


def check_one_per_rank(tensors: Sequence[Tensor], world_size: int, *, operation: str) -> list[Tensor]:
    """Return ``tensors`` as a list if it holds one tensor per rank of a
    group of ``world_size`` (``all_to_all``'s argument); raise
    :class:`MisconfigurationError` naming the operation otherwise."""
    if len(tensors) != world_size:
        raise MisconfigurationError(
            f"{operation}(): give one tensor per rank ({world_size} in this group), got {len(tensors)}"
        )
    return list(tensors)


def check_into(output: Tensor, tensor: Tensor, world_size: int, *, operation: str) -> None:
    """Check the two tensors of ``all_gather_into(output, tensor)`` or
    ``reduce_scatter_into(output, tensor)``: contiguous, of one dtype and
    device, and the larger (``output`` for a gather, ``tensor`` for a
    reduce-scatter) holding ``world_size`` times the other's elements;
    raise :class:`MisconfigurationError` saying which is wrong."""
    gather = operation == "all_gather_into"
    whole, part = (output, tensor) if gather else (tensor, output)
    whole_name, part_name = ("output", "input") if gather else ("input", "output")
    if whole.numel() != part.numel() * world_size:
        raise MisconfigurationError(
            f"{operation}(): the {whole_name} has {whole.numel()} elements and the {part_name} "
            f"{part.numel()}; the {whole_name} must hold the {part_name}'s times the group's size "
            f"({world_size})"
        )
    if output.dtype != tensor.dtype or output.device != tensor.device:
        raise MisconfigurationError(
            f"{operation}(): the output is {output.dtype} on {output.device} and the input "
            f"{tensor.dtype} on {tensor.device}; give two tensors of one dtype on one device"
        )
    for name, t in (("output", output), ("input", tensor)):
        if not t.is_contiguous():
            raise MisconfigurationError(
                f"{operation}(): the {name} is not contiguous (shape {tuple(t.shape)}, stride "
                f"{tuple(t.stride())}); give a contiguous tensor (.contiguous() makes one)"
            )


def check_scatter_list(
    scatter_list: Sequence[Tensor] | None,
    tensor: Tensor,
    world_size: int,
    *,
    src: int,
    dtype: bool = False,
) -> list[Tensor]:
    """On the source rank of ``scatter``: return ``scatter_list`` as a list
    if it holds one tensor per rank, each shaped like ``tensor`` (the one
    that receives; and of its dtype, with ``dtype=True``, for a backend that
    cannot convert); raise :class:`MisconfigurationError` saying which is
    wrong otherwise."""
    if scatter_list is None or len(scatter_list) != world_size:
        got = "None" if scatter_list is None else f"{len(scatter_list)} tensor(s)"
        raise MisconfigurationError(
            f"scatter(src={src}): the source rank gives scatter_list, one tensor per rank "
            f"({world_size} in this group); got {got}"
        )
    for i, t in enumerate(scatter_list):
        if tuple(t.shape) != tuple(tensor.shape) or (dtype and t.dtype != tensor.dtype):
            wanted = f"{tuple(tensor.shape)} {tensor.dtype}" if dtype else f"{tuple(tensor.shape)}"
            got = f"{tuple(t.shape)} {t.dtype}" if dtype else f"{tuple(t.shape)}"
            raise MisconfigurationError(
                f"scatter(src={src}): scatter_list[{i}] is {got}, but the tensor that receives is "
                f"{wanted}; give tensors like the one that receives"
            )
    return list(scatter_list)


def poll(
    done: Callable[[], bool],
    timeout: float,
    *,
    spin: float = math.inf,
    spin_nap: float | None = None,
    nap: float = 0.0,
) -> bool:
    """Call ``done()`` until it is true (return ``True``) or ``timeout``
    seconds have passed (return ``False``): how a collective whose backend
    progresses only while it is asked (MPI's ``Test``, Horovod's ``poll``)
    waits, to a deadline. For the first ``spin`` seconds it asks again at
    once (after ``time.sleep(spin_nap)``, a yield of the GIL with ``0.0``,
    unless ``None``); after that it sleeps ``nap`` seconds between asks, so
    that a long wait leaves the CPU to the other threads."""
    if done():
        return True
    start = time.monotonic()
    deadline = start + timeout
    while not done():
        now = time.monotonic()
        if now > deadline:
            return False
        if now - start >= spin:
            time.sleep(nap)
        elif spin_nap is not None:
            time.sleep(spin_nap)
    return True


def timed_out(
    collective: str,
    operation: str,
    timeout: float,
    *,
    where: str,
    then: str,
    missing_ranks: tuple[int, ...] | None = None,
) -> CollectiveTimeoutError:
    """The :class:`CollectiveTimeoutError` of ``operation`` on the collective
    named ``collective``, in the words every collective uses: ``where`` is
    this rank in its group (``"rank 0 of 2"``, with what the backend adds),
    ``then`` what the user should do now that the backend is in the state
    it is (end the job, raise ``timeout=``)."""
    who = f"; ranks {list(missing_ranks)} did not arrive" if missing_ranks else ""
    return CollectiveTimeoutError(
        f"{operation}() on the {collective!r} collective ({where}) did not complete within {timeout:g} s"
        f"{who}. A rank may have died, hung, or not called the same operation in the same order; {then}",
        operation=operation,
        timeout=timeout,
        missing_ranks=missing_ranks,
    )


def plan_mismatch(posts: Mapping[int, Mapping[str, str]]) -> PlanMismatchError | None:
    """The :class:`PlanMismatchError` for the plans the nodes posted (node
    rank -> :attr:`Collective.plan_facts`), or ``None`` when they agree. The
    message shows each differing field side by side, one column per node."""
    nodes = sorted(posts)
    fields = list(dict.fromkeys(f for node in nodes for f in posts[node]))
    differences = {
        f: {node: str(posts[node].get(f, "(not said)")) for node in nodes}
        for f in fields
        if len({str(posts[node].get(f, "(not said)")) for node in nodes}) > 1
    }
    if not differences:
        return None
    shown = nodes if len(nodes) <= 8 else _first_of_each_value(differences, nodes)
    rows = [["", *(f"node {n}" for n in shown)]] + [
        [f, *(values[n] for n in shown)] for f, values in differences.items()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    table = "\n".join("    " + line for line in lines)
    left = "" if len(shown) == len(nodes) else f" ({len(shown)} of {len(nodes)} nodes shown, one per value)"
    return PlanMismatchError(
        f"the nodes of this job resolved different plans, so their ranks would wait for each other "
        f"in different places; they differ in {', '.join(differences)}{left}:\n{table}\n"
        "Start every node with the same command (the same flags and resolve() call, the same "
        "number of devices) and the same installed versions",
        differences=differences,
    )


def _first_of_each_value(differences: Mapping[str, Mapping[int, str]], nodes: list[int]) -> list[int]:
    """A few nodes that show every value of every differing field."""
    chosen: list[int] = []
    for values in differences.values():
        seen: set[str] = {values[n] for n in chosen}
        for node in nodes:
            if values[node] not in seen:
                seen.add(values[node])
                chosen.append(node)
    return sorted(set(chosen))
