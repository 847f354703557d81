from __future__ import annotations

import pytest

from phalanx_core import (
    OPERATIONS,
    Collective,
    CompletedWork,
    MisconfigurationError,
    NonMember,
    NotInGroupError,
    UnavailableError,
    check_rank,
    check_reduce_op,
)


def test_non_members_are_refused_every_operation_by_name():
    group = NonMember([1, 3], parent="torch", world_rank=0)
    assert group.is_member is False and group.rank == -1 and group.world_size == 2
    assert group.global_ranks == (1, 3)
    for op in OPERATIONS:
        with pytest.raises(
            NotInGroupError, match=rf"{op}\(\) called on a 'torch' group of ranks \[1, 3\], but rank 0"
        ):
            getattr(group, op)(None)


class Partial(Collective):
    name = "partial"
    unsupported = frozenset(op for op in OPERATIONS if op != "barrier")

    def setup(self, environment, accelerator=None): ...
    def teardown(self): ...

    is_initialized = True  # type: ignore[assignment]
    rank = 0  # type: ignore[assignment]
    world_size = 1  # type: ignore[assignment]

    def barrier(self, *, async_op=False):
        return CompletedWork() if async_op else None

    def new_group(self, ranks):
        return self


def test_declared_unsupported_operations_refuse_clearly():
    coll = Partial()
    assert coll.barrier() is None
    with pytest.raises(UnavailableError, match=r"send\(\) is not available on the 'partial' collective"):
        coll.send(None, 1)


def test_undeclared_missing_operations_cannot_be_instantiated():
    class Abstract(Collective):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Abstract()  # type: ignore[abstract]


def test_unsupported_must_name_real_operations():
    with pytest.raises(TypeError, match="names \\['all_reduce_fast'\\], which are not operations"):

        class Typo(Partial):
            unsupported = frozenset({"all_reduce_fast"})


def test_timeout_is_validated():
    assert Partial(timeout=3).timeout == 3.0
    for bad in (0, -1, "10", True):
        with pytest.raises(MisconfigurationError, match="the timeout is a positive number of seconds"):
            Partial(timeout=bad)


def test_reduce_ops_and_ranks_are_checked_by_name():
    assert check_reduce_op("MEAN") == "mean"
    with pytest.raises(
        MisconfigurationError, match="op='avg' is not a reduce op for the 'x' collective; use one of 'sum'"
    ):
        check_reduce_op("avg", collective="x")
    assert check_rank(1, 2, operation="broadcast", argument="src") == 1
    with pytest.raises(MisconfigurationError, match=r"broadcast\(src=2\): the ranks of this group are 0..1"):
        check_rank(2, 2, operation="broadcast", argument="src")


def test_completed_work_runs_its_finish_once():
    calls = []
    work = CompletedWork(finish=lambda: calls.append(1) or "done")
    assert not work.is_completed()
    assert work.wait() == "done" and work.wait() == "done"
    assert calls == [1] and work.is_completed()


class _BreaksItsDeclaration:
    """Declares that new_group makes only the whole world, then makes a
    smaller group anyway: what the conformance kit must catch."""

    subgroups = False
    world_size, rank = 2, 0

    def new_group(self, ranks):
        return self


def test_the_kit_holds_a_collective_to_its_subgroups_declaration():
    pytest.importorskip("torch")
    from phalanx_core.testing.contract import check_groups

    with pytest.raises(AssertionError, match=r"subgroups = False, yet new_group of fewer"):
        check_groups(_BreaksItsDeclaration())
