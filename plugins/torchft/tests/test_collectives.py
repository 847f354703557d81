"""The collective a user names under ``ddp_ft`` and ``hsdp_ft``: resolved,
refused where it cannot serve replica groups that come and go (naming the
capability it lacks and the collectives that have it), and said on
``phalanx explain``'s traffic line; built into the strategy twice, once for
within each group and once, never set up, for between the groups."""

from __future__ import annotations

import io
import json

import pytest

pytest.importorskip("torchft", reason="phalanx-torchft's tests need torchft: pip install 'torchft>=0.2,<0.3'")

import phalanx
from phalanx.cli import main
from phalanx_core import MisconfigurationError

pytest_plugins = ["phalanx_core.testing"]

THIRD_PARTY = (
    "from phalanx_core import CollectiveSpec, hookimpl\n"
    "@hookimpl\n"
    "def phalanx_collectives():\n"
    "    return [\n"
    "        CollectiveSpec(name='able', target='phalanx_thirdparty:Able',\n"
    "                       fault_tolerance=('liveness', 'reconfigure')),\n"
    "        CollectiveSpec(name='unable', target='phalanx_thirdparty:Unable'),\n"
    "    ]\n"
    "from phalanx_torch.collectives import TorchCollective\n"
    "class Able(TorchCollective):\n"
    "    name = 'able'\n"
    "class Unable(TorchCollective):\n"
    "    name = 'unable'\n"
    "    fault_tolerance = frozenset()\n"
)


@pytest.fixture
def third_party(phalanx_distribution):
    """A third party's two collectives over torch's, one that declares
    what ddp_ft needs, one that declares nothing; and a registry made
    after they were installed (the default one may be older)."""
    phalanx_distribution(
        "phalanx-thirdparty",
        entry_points={"thirdparty": "phalanx_thirdparty"},
        modules={"phalanx_thirdparty": THIRD_PARTY},
    )
    return phalanx.Registry()


def explain(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["explain", "--accelerator", "cpu", *argv], out)
    return code, out.getvalue()


WITHIN = {
    "ddp_ft": "gradients: DDP's buckets within the replica group through ",
    "hsdp_ft": "parameters and gradients: FSDP's all-gathers and reduce-scatters within the replica group through ",
}


@pytest.mark.parametrize("strategy", ["ddp_ft", "hsdp_ft"])
@pytest.mark.parametrize("collective", ["torch", "compressed", "hierarchical", "able"])
def test_explain_says_the_named_collective_carries_the_traffic_between_groups(
    third_party, strategy, collective
):
    code, out = explain("--strategy", strategy, "--devices", "2", "--collective", collective)
    assert code == 0, out
    [line] = [line for line in out.splitlines() if line.startswith("traffic  ")]
    text = line.split(None, 1)[1]
    assert text.startswith(WITHIN[strategy]), text
    if collective == "torch":
        assert "the torch collective's c10d group" in text
        assert "a 'torch' collective of their own (gloo), formed again at each TorchFT quorum" in text
    else:
        assert f"within the replica group through the {collective!r} collective" in text
        assert (
            f"through a {collective!r} collective of their own, formed again at each TorchFT quorum" in text
        )
    assert "TorchFT's managed gloo group" not in text
    code, out = explain("--json", "--strategy", strategy, "--devices", "2", "--collective", collective)
    assert json.loads(out)["traffic"] == text


@pytest.mark.parametrize(
    ("flags", "lacking"),
    [
        ({"collective": "mpi"}, "collective 'mpi' ('mpi' (phalanx-mpi 0.1.0)) declares none"),
        ({"collective": "compressed", "inner": "mpi"}, "its part 'inner: mpi' declares none"),
        (
            {"collective": "unable"},
            "collective 'unable' ('thirdparty' (phalanx-thirdparty 0.1.0)) declares none",
        ),
        (
            {"collective": "single_device"},
            "collective 'single_device' ('torch' (phalanx-torch 0.1.0)) declares none",
        ),
    ],
)
@pytest.mark.parametrize("strategy", ["ddp_ft", "hsdp_ft"])
def test_a_collective_without_the_capabilities_is_refused_naming_them(
    third_party, capsys, strategy, flags, lacking
):
    with pytest.raises(MisconfigurationError) as refused:
        third_party.plan(strategy, accelerator="cpu", devices=1, **flags)
    message = str(refused.value)
    assert (
        f"strategy {strategy!r} needs a collective with the capabilities liveness and reconfigure" in message
    )
    assert lacking in message, message
    assert (
        "Collectives that have them: able, compressed, hierarchical, torch; e.g. collective='torch'"
        in message
    )
    # Before anything else about it (mpi's launcher, say): on the command line too.
    code, _ = explain("--strategy", strategy, "--devices", "1", *_argv(flags))
    error = capsys.readouterr().err
    assert code != 0 and lacking in error, error


def _argv(flags: dict[str, str]) -> list[str]:
    argv = ["--collective", flags["collective"]]
    for key, value in flags.items():
        if key != "collective":
            argv += ["-o", f"{key}={value}"]
    return argv


def test_a_ready_collective_without_them_is_refused_when_built(third_party):
    from phalanx_torch.collectives import SingleDeviceCollective

    with pytest.raises(MisconfigurationError, match="lacks liveness and reconfigure"):
        third_party.resolve(
            "ddp_ft", accelerator="cpu", devices=1, collective=SingleDeviceCollective(), launcher="fork"
        )


@pytest.mark.parametrize("collective", ["torch", "compressed", "able"])
def test_the_strategy_gets_a_second_collective_of_the_kind_named_for_between_the_groups(
    third_party, collective
):
    strategy = third_party.resolve(
        "ddp_ft", accelerator="cpu", devices=1, collective=collective, launcher="fork", timeout=77
    )
    assert type(strategy.across) is type(strategy.collective)
    assert strategy.across is not strategy.collective
    assert not strategy.across.is_initialized
    assert strategy.across.timeout == strategy.collective.timeout == 77  # the same options
    assert {"liveness", "reconfigure"} <= strategy.across.fault_tolerance


def test_list_shows_what_each_collective_can_do_and_what_each_strategy_needs(third_party):
    out = io.StringIO()
    assert main(["list"], out) == 0
    rows = {tuple(line.split()[:2]): line for line in out.getvalue().splitlines()}
    assert rows[("collective", "torch")].endswith("[fault tolerance: liveness, reconfigure]")
    assert rows[("collective", "able")].endswith("[fault tolerance: liveness, reconfigure]")
    assert "fault tolerance" not in rows[("collective", "unable")]
    assert rows[("strategy", "ddp_ft")].endswith("[collective needs: liveness, reconfigure]")


def test_the_option_across_names_the_collective_between_the_groups_alone(third_party):
    """One name for both by default; ``across=`` (with ``across_options``)
    for the link between the groups alone: the one users want compressed,
    while the ranks of a group talk over their fast link uncompressed."""
    strategy = third_party.resolve(
        "ddp_ft",
        accelerator="cpu",
        devices=1,
        launcher="fork",
        across="compressed",
        across_options={"dtype": "fp16", "error_feedback": True},
    )
    assert type(strategy.collective).__name__ == "TorchCollective"
    assert type(strategy.across).__name__ == "CompressedCollective"
    assert (strategy.across.dtype, strategy.across.error_feedback) == ("fp16", True)
    code, out = explain("--strategy", "hsdp_ft", "--devices", "2", "-o", "across=compressed")
    assert code == 0, out
    lines = out.splitlines()
    assert any(line.split()[:3] == ["across:", "compressed", "'compose'"] for line in lines), out
    [traffic] = [line for line in lines if line.startswith("traffic  ")]
    assert "within the replica group through the 'torch' collective;" in traffic
    assert "across the step's groups through a 'compressed' collective of their own" in traffic
    code, out = explain("--json", "--strategy", "ddp_ft", "--devices", "1", "-o", "across=able")
    assert json.loads(out)["across"]["name"] == "able"


@pytest.mark.parametrize(
    ("strategy", "options", "message"),
    [
        ("ddp_ft", {"across": "mpi"}, "collective 'mpi' ('mpi' (phalanx-mpi 0.1.0)) declares none"),
        ("ddp_ft", {"across": "compressed", "across_options": {"inner": "mpi"}}, "its part 'inner: mpi'"),
        ("ddp_ft", {"across": 3}, "option across=3: name a collective"),
        (
            "ddp_ft",
            {"across_options": {"dtype": "fp16"}},
            "across_options is for the collective named by across=",
        ),
        ("ddp", {"across": "compressed"}, "option across names the collective between the replica groups"),
        ("ddp_ft", {"across": "compresed"}, "compressed"),  # an unknown name: the close one is said
    ],
)
def test_a_bad_across_is_refused_saying_why(third_party, strategy, options, message):
    with pytest.raises(Exception) as refused:  # noqa: PT011 - MisconfigurationError or UnknownNameError
        third_party.plan(strategy, accelerator="cpu", devices=1, **options)
    assert message in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # nccl moves CUDA tensors only: refused for CPU groups, as within them.
        ({"across": "torch", "across_options": {"backend": "nccl"}}, "nccl"),
        # A backend the torch collective cannot form a group of by hand.
        ({"across": "torch", "across_options": {"backend": "ucc"}}, "lacks reconfigure"),
    ],
)
def test_a_collective_between_the_groups_that_cannot_serve_them_is_refused_by_name(
    third_party, options, message
):
    with pytest.raises(Exception) as refused:  # noqa: PT011 - MisconfigurationError or UnavailableError
        third_party.resolve("ddp_ft", accelerator="cpu", devices=1, launcher="fork", **options)
    assert message in str(refused.value), str(refused.value)


def test_the_group_across_takes_every_argument_torchfts_manager_gives_its_configure():
    # The quorum's members reach the strategy through the group's configure,
    # which TorchFT's Manager calls positionally at each new quorum (8
    # arguments in torchft 0.2; 4 in its first releases): the override must
    # take exactly what the installed torchft's ProcessGroup.configure does.
    import datetime
    import inspect

    from phalanx_torchft._across import across_groups
    from torchft.process_group import ProcessGroup

    group = across_groups(None, None, datetime.timedelta(seconds=1))
    ours = inspect.signature(type(group).configure).parameters
    theirs = inspect.signature(ProcessGroup.configure).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]
