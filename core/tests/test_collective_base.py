from __future__ import annotations

import pytest

from phalanx_core import (
    FAULT_TOLERANCE,
    OPERATIONS,
    Collective,
    CollectiveTimeoutError,
    CompletedWork,
    Membership,
    MisconfigurationError,
    NonMember,
    NotInGroupError,
    UnavailableError,
    check_one_per_rank,
    check_rank,
    check_reduce_op,
    check_scatter_list,
    poll,
    timed_out,
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


# -- the checks and waits every collective shares ------------------------------


class _Shaped:
    def __init__(self, shape: tuple[int, ...], dtype: str = "float32") -> None:
        self.shape, self.dtype = shape, dtype


def test_check_one_per_rank_names_the_operation_and_the_count():
    assert check_one_per_rank((1, 2), 2, operation="all_to_all") == [1, 2]
    with pytest.raises(
        MisconfigurationError, match=r"all_to_all\(\): give one tensor per rank \(3 in this group\), got 2"
    ):
        check_one_per_rank([1, 2], 3, operation="all_to_all")


def test_check_scatter_list_says_which_entry_is_wrong():
    tensor = _Shaped((2,))
    got = check_scatter_list([_Shaped((2,)), _Shaped((2,))], tensor, 2, src=1)
    assert len(got) == 2
    with pytest.raises(
        MisconfigurationError, match=r"scatter\(src=1\): .* one tensor per rank \(2 in this group\); got None"
    ):
        check_scatter_list(None, tensor, 2, src=1)
    with pytest.raises(MisconfigurationError, match=r"got 1 tensor\(s\)"):
        check_scatter_list([tensor], tensor, 2, src=0)
    with pytest.raises(
        MisconfigurationError, match=r"scatter_list\[1\] is \(3,\), but the tensor that receives is \(2,\)"
    ):
        check_scatter_list([_Shaped((2,)), _Shaped((3,))], tensor, 2, src=0)
    check_scatter_list([_Shaped((2,), "int64")] * 2, tensor, 2, src=0)  # dtypes: the backend converts
    with pytest.raises(
        MisconfigurationError, match=r"scatter_list\[0\] is \(2,\) int64, but .* \(2,\) float32"
    ):
        check_scatter_list([_Shaped((2,), "int64")] * 2, tensor, 2, src=0, dtype=True)


def test_poll_asks_until_done_or_the_deadline():
    answers = iter([False, False, True])
    assert poll(lambda: next(answers), 10.0)
    asked: list[int] = []
    assert not poll(lambda: asked.append(1) or False, 0.05, spin=0.01, spin_nap=0.0, nap=0.005)
    assert len(asked) >= 2


def test_timed_out_is_the_error_every_collective_raises():
    error = timed_out("mine", "all_reduce", 3.0, where="rank 1 of 2", then="end the job", missing_ranks=(0,))
    assert isinstance(error, CollectiveTimeoutError)
    assert (error.operation, error.timeout, error.missing_ranks) == ("all_reduce", 3.0, (0,))
    assert str(error) == (
        "all_reduce() on the 'mine' collective (rank 1 of 2) did not complete within 3 s; ranks [0] did not "
        "arrive. A rank may have died, hung, or not called the same operation in the same order; end the job"
    )


INTO = {"all_gather_into", "reduce_scatter_into"}


class NoGatherInto(Partial):
    """Gathers and reduce-scatters, as new tensors only: the contract's
    defaults give the into-forms."""

    unsupported = frozenset(OPERATIONS) - {"barrier", "all_gather", "reduce_scatter", *INTO}
    world_size = 2  # type: ignore[assignment]

    def all_gather(self, tensor, *, async_op=False):
        import torch

        parts = [tensor.clone(), torch.full_like(tensor, 9.0)]
        return CompletedWork(parts) if async_op else parts

    def reduce_scatter(self, tensor, op="sum", *, async_op=False):
        part = tensor[0] * 2
        return CompletedWork(part) if async_op else part


def test_the_into_forms_default_to_the_operation_they_extend_and_one_copy():
    torch = pytest.importorskip("torch")
    coll = NoGatherInto()
    out = torch.zeros(2, 3)
    assert coll.all_gather_into(out, torch.ones(3)) is out
    assert out.tolist() == [[1.0] * 3, [9.0] * 3]
    flat = torch.zeros(6)
    assert coll.all_gather_into(flat, torch.ones(3), async_op=True).wait() is flat
    assert flat.tolist() == [1.0] * 3 + [9.0] * 3
    part = torch.zeros(2)
    assert coll.reduce_scatter_into(part, torch.tensor([1.0, 2.0, 3.0, 4.0])) is part
    assert part.tolist() == [2.0, 4.0]
    with pytest.raises(
        MisconfigurationError, match=r"all_gather_into\(\): the output has 5 elements and the input 3"
    ):
        coll.all_gather_into(torch.zeros(5), torch.ones(3))
    with pytest.raises(MisconfigurationError, match=r"the output is torch.float64 .* one dtype"):
        coll.reduce_scatter_into(torch.zeros(2, dtype=torch.float64), torch.zeros(4))
    with pytest.raises(MisconfigurationError, match=r"the output is not contiguous .*\.contiguous\(\)"):
        coll.all_gather_into(torch.zeros(3, 2).t(), torch.ones(3))


def test_an_operation_refused_refuses_the_into_form_that_extends_it():
    class Derived(Partial):
        unsupported = frozenset(OPERATIONS) - {"barrier", *INTO}

    assert Derived.unsupported >= INTO
    with pytest.raises(UnavailableError, match=r"all_gather_into\(\) is not available on the 'partial'"):
        Derived().all_gather_into(None, None)

    class OwnInto(Partial):
        unsupported = frozenset(OPERATIONS) - {"barrier", "all_gather_into"}

        def all_gather_into(self, output, tensor, *, async_op=False):
            return output

    assert "all_gather_into" not in OwnInto.unsupported
    assert OwnInto().all_gather_into("out", None) == "out"


def test_plan_mismatch_shows_the_differing_fields_side_by_side():
    from phalanx_core import PlanMismatchError, plan_mismatch

    same = {"strategy": "ddp", "devices per node": "2", "torch": "2.13.0"}
    assert plan_mismatch({0: same, 1: dict(same)}) is None
    error = plan_mismatch({0: same, 1: {**same, "strategy": "fsdp"}, 2: {**same, "torch": "2.12.0"}})
    assert isinstance(error, PlanMismatchError)
    assert error.differences == {
        "strategy": {0: "ddp", 1: "fsdp", 2: "ddp"},
        "torch": {0: "2.13.0", 1: "2.13.0", 2: "2.12.0"},
    }
    lines = str(error).splitlines()
    assert lines[0].endswith("they differ in strategy, torch:")
    assert lines[1:4] == [
        "              node 0  node 1  node 2",
        "    strategy  ddp     fsdp    ddp",
        "    torch     2.13.0  2.13.0  2.12.0",
    ]
    assert lines[4].startswith("Start every node with the same command")


def test_plan_mismatch_of_many_nodes_shows_one_node_per_value():
    from phalanx_core import plan_mismatch

    posts = {n: {"devices per node": "2"} for n in range(64)}
    posts[37] = {"devices per node": "1"}
    error = plan_mismatch(posts)
    assert error is not None and "(2 of 64 nodes shown, one per value)" in str(error)
    assert "    devices per node  2       1" in str(error).splitlines()
    assert error.differences["devices per node"][37] == "1"


# -- when peers come and go ----------------------------------------------------------


def test_a_collective_without_a_capability_refuses_its_method_naming_it():
    collective = Partial()
    assert collective.fault_tolerance == frozenset()
    membership = Membership(rank=0, world_size=1, host="127.0.0.1", port=29500, prefix="q/1")
    for call, capability in (
        (lambda: collective.reconfigure(membership), "reconfigure"),
        (collective.abort, "liveness"),
        (lambda: collective.shrink([0]), "shrink"),
    ):
        with pytest.raises(
            UnavailableError, match=rf"'partial' collective .* does not declare the '{capability}'"
        ):
            call()


def test_a_collective_declares_only_capabilities_that_exist():
    assert FAULT_TOLERANCE == ("liveness", "reconfigure", "shrink")
    with pytest.raises(
        MisconfigurationError, match="'heal' is no fault-tolerance capability; the capabilities are"
    ):

        class Healing(Partial):
            fault_tolerance = frozenset({"liveness", "heal"})


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.1:29500/torchft/7/0", ("10.0.0.1", 29500, "torchft/7/0")),
        ("host-a:1/p", ("host-a", 1, "p")),
        ("[::1]:4000/q", ("::1", 4000, "q")),
    ],
)
def test_a_membership_reads_the_address_torchft_gives(address, expected):
    membership = Membership.at(address, rank=1, world_size=3, label="quorum 7", timeout=5)
    assert (membership.host, membership.port, membership.prefix) == expected
    assert (membership.rank, membership.world_size, membership.timeout) == (1, 3, 5)
    assert membership.describe() == f"quorum 7: rank 1 of 3 at {expected[0]}:{expected[1]}/{expected[2]}"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Membership.at("10.0.0.1:29500", rank=0, world_size=1), r"expected HOST:PORT/PREFIX"),
        (lambda: Membership.at("no port/x", rank=0, world_size=1), r"expected HOST:PORT/PREFIX"),
        (
            lambda: Membership(rank=3, world_size=3, host="h", port=1, prefix="p"),
            r"one of 0 .. world_size - 1",
        ),
        (lambda: Membership(rank=0, world_size=0, host="h", port=1, prefix="p"), r"at least one member"),
        (lambda: Membership(rank=0, world_size=1, host="h", port=0, prefix="p"), r"a port of 1 .. 65535"),
        (lambda: Membership(rank=0, world_size=1, host="h", port=1, prefix=""), r"a prefix of its own"),
        (lambda: Membership(rank=True, world_size=1, host="h", port=1, prefix="p"), r"rank=True.*an int"),
        (
            lambda: Membership(rank=0, world_size=1, host="h", port=1, prefix="p", timeout=0),
            r"positive number",
        ),
    ],
)
def test_a_bad_membership_says_what_is_wrong(make, match):
    with pytest.raises(MisconfigurationError, match=match):
        make()
