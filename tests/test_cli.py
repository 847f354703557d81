"""The command line, in process (the subprocess checks are in test_no_torch)."""

from __future__ import annotations

import io
import json

import pytest

import phalanx
import phalanx.cli
from phalanx.cli import main


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out), out.getvalue()


def test_list_table_shows_parts_plugins_and_availability():
    code, out = run("list")
    assert code == 0
    assert "KIND" in out and "AVAILABLE" in out
    rows = [line.split()[:5] for line in out.splitlines()]  # column widths follow the longest names
    assert ["strategy", "single_device", "phalanx-torch", "0.1.0", "yes"] in rows
    assert ["torch", "phalanx-torch", "0.1.0", "loaded", "accelerators,"] in rows


def test_list_filters_by_kind_and_probes(monkeypatch):
    code, out = run("list", "--kind", "accelerator", "--probe", "--json")
    data = json.loads(out)
    assert {p["kind"] for p in data["parts"]} == {"accelerator"}
    [cpu] = [p for p in data["parts"] if p["name"] == "cpu"]
    assert cpu["available"] is True and cpu["distribution"] == "phalanx-torch"


def test_list_shows_unavailable_parts_with_the_install_line(phalanx_distribution):
    phalanx_distribution(
        "phalanx-fake-backend",
        entry_points={"fake": "phalanx_fake_backend"},
        modules={
            "phalanx_fake_backend": (
                "from phalanx_core import CollectiveSpec, hookimpl\n"
                "@hookimpl\n"
                "def phalanx_collectives():\n"
                "    return [CollectiveSpec(name='fakecoll', target='phalanx_fake_backend.impl:C',\n"
                "            needs=('fake_backend_lib',), install=\"pip install 'phalanx-fake-backend[fake]'\")]\n"
            )
        },
    )
    code, out = run("list", "--kind", "collective")
    row = next(line for line in out.splitlines() if line.split()[:2] == ["collective", "fakecoll"])
    assert "no: needs fake_backend_lib" in row and "pip install" not in row  # the column stays short
    assert (
        "  fakecoll (phalanx-fake-backend): needs fake_backend_lib: pip install 'phalanx-fake-backend[fake]'"
        in out.splitlines()
    )


def test_list_says_accelerators_are_installed_not_probed_and_stays_narrow():
    code, out = run("list")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("accelerator  ")]
    assert all(" installed " in row or " no: needs " in row for row in rows), rows
    assert "`phalanx list --probe` asks the hardware" in out
    # up to the summary, every row of the parts table fits in 100 columns
    for line in out.splitlines()[: out.splitlines().index("")]:
        assert len(line.rsplit("  ", 1)[0].rstrip()) <= 100, line


def test_a_plugin_filter_that_matches_no_plugin_says_so(monkeypatch):
    monkeypatch.setenv("PHALANX_PLUGINS", "troch")
    code, out = run("list")
    assert "PHALANX_PLUGINS names 'troch', which is no installed plugin (did you mean 'torch'?)" in out
    with pytest.raises(phalanx.UnknownNameError, match=r"PHALANX_PLUGINS names 'troch'"):
        phalanx.Registry().get("strategy", "ddp")


def test_plugins_left_out_by_a_filter_share_one_line(monkeypatch):
    monkeypatch.setenv("PHALANX_PLUGINS", "torch")
    code, out = run("list")
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("disabled")]
    assert len(lines) == 1, out
    assert lines[0].startswith("disabled (not in PHALANX_PLUGINS=torch): '"), lines
    assert "'compose' (phalanx-compose " in lines[0], lines


def test_list_shows_failed_plugins(phalanx_distribution):
    phalanx_distribution(
        "phalanx-broken",
        entry_points={"broken": "phalanx_broken"},
        modules={"phalanx_broken": "raise ImportError('cannot import this on purpose')\n"},
    )
    code, out = run("list")
    assert code == 0
    assert "failed: 'broken' (phalanx-broken 0.1.0): importing 'phalanx_broken' raised ImportError" in out
    code, out = run("list", "--verbose")
    assert "Traceback" in out
    code, out = run("list", "--json")
    [broken] = [p for p in json.loads(out)["plugins"] if p["name"] == "broken"]
    assert broken["status"] == "failed" and "Traceback" in broken["traceback"]


def test_explain_prints_the_plan():
    code, out = run("explain", "--strategy", "single_device", "--accelerator", "cpu")
    assert code == 0
    assert "launcher     in_process     'torch' (phalanx-torch 0.1.0)  the strategy's default" in out
    code, out = run("explain", "--json", "--devices", "1")
    assert json.loads(out)["parts"]["strategy"]["name"] == "single_device"


@pytest.mark.parametrize("devices", ["-1", "auto"])
def test_explain_says_how_many_devices_all_or_auto_take_here(devices):
    # The number the built strategy took, beside the flag as given; on the CPU
    # -1 and auto take one process (cpu's device count).
    code, out = run("explain", "--strategy", "ddp", "--accelerator", "cpu", "--devices", devices)
    assert code == 0
    assert out.splitlines()[0] == f"devices={phalanx.cli._devices(devices)!r} (1 on this machine) num_nodes=1"
    code, out = run("explain", "--strategy", "ddp", "--accelerator", "cpu", "--devices", devices, "--json")
    assert json.loads(out)["devices_here"] == 1
    code, out = run("explain", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2")
    assert out.splitlines()[0] == "devices=2 num_nodes=1"
    code, out = run("explain", "--strategy", "ddp", "--devices", devices, "--plan-only", "--json")
    assert json.loads(out)["devices_here"] is None  # nothing was built


@pytest.mark.parametrize(
    ("argv", "listens"),
    [
        (
            ["--strategy", "ddp_spawn", "--devices", "2"],
            "127.0.0.1 only: the launcher's rendezvous store and every rank's gloo",
        ),
        (
            ["--strategy", "ddp", "--devices", "2"],
            "127.0.0.1 only: the launching process's rendezvous store and every rank's gloo",
        ),
        (
            ["--strategy", "ddp", "--devices", "2", "--num-nodes", "2"],
            "node 0's rendezvous store (MASTER_PORT) and every rank's gloo on the address that reaches MASTER_ADDR",
        ),
    ],
)
def test_explain_says_where_the_job_listens(argv, listens, monkeypatch):
    monkeypatch.setenv("NODE_RANK", "0")  # what a node of a two-node job has
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    code, out = run("explain", "--accelerator", "cpu", *argv)
    assert code == 0
    [line] = [x for x in out.splitlines() if x.startswith("listens on")]
    assert line.startswith(f"listens on   {listens}")
    network = "gloo's own choice: the main address 127.0.0.1 leads to this host's loopback; with nodes on other hosts, this host takes the interface of the address they reach it at, when the group is made"
    assert out.splitlines()[-2] == f"network      {network}"
    code, out = run("explain", "--json", "--accelerator", "cpu", *argv)
    assert json.loads(out)["listens"].startswith(listens)
    assert json.loads(out)["network"] == network
    # One node: the launchers say nothing more; several: where they meet.
    said = (
        {"rendezvous": "once, at node 0's store at 127.0.0.1:29500: node 0 of 2"}
        if "--num-nodes" in argv
        else {}
    )
    assert json.loads(out)["launcher_says"] == said


def test_explain_takes_a_job_in_rounds_as_phalanx_run_does(monkeypatch):
    # --num-nodes MIN:MAX, --max-restarts and --rendezvous, as `phalanx run`
    # takes them (explain refused 2:3 as "invalid int value").
    for name in ("NODE_RANK", "MASTER_PORT"):  # --node-rank, --main-port set them: restored after
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)  # nodes in rounds need no node rank
    argv = ["explain", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "--num-nodes", "2:3"]
    etcd = ["--rendezvous", "etcd://10.0.0.1:2379,10.0.0.2:2379/myjob"]
    code, out = run(*argv, "--max-restarts", "3", *etcd)
    assert code == 0
    lines = {line[:12].strip(): line[13:] for line in out.splitlines()[1:]}
    assert out.splitlines()[0] == (
        "devices=2 num_nodes=3 options: min_nodes=2, "
        "rendezvous='etcd://10.0.0.1:2379,10.0.0.2:2379/myjob', max_restarts=3"
    )
    assert lines["rendezvous"] == (
        "in rounds, at etcd at 10.0.0.1:2379,10.0.0.2:2379 (job 'myjob'): 2 to 3 nodes (a round closes "
        "when 3 have joined, or 3 s after 2 have); the store's host: none: the keys are in etcd, and the "
        "job goes on where any node is lost"
    )
    assert lines["restarts"].startswith("up to 3 for the job (a round whose ranks failed counts once;")
    assert lines["listens on"].startswith("no store of the job's (its keys are in etcd)")
    # The same job on node 0's store, this node given rank 1.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    code, out = run(*argv, "--max-restarts", "1", "--node-rank", "1", "--main-port", "29531")
    assert code == 0
    [line] = [x for x in out.splitlines() if x.startswith("rendezvous")]
    assert line.endswith("the store's host: node rank 0; this node would like rank 1")
    assert "node 0's store at 127.0.0.1:29531" in line
    # A flag and an option that disagree are refused, as by `phalanx run`.
    code, _ = run(*argv, "--max-restarts", "1", "-o", "max_restarts=2", *etcd)
    assert code == 1


def test_explain_says_which_interface_the_ranks_use_and_refuses_none(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # restored afterwards; --main-address sets it
    argv = ["explain", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2"]
    code, out = run(*argv, "--main-address", "no-such-host.invalid", "-o", "interface=lo")
    assert code == 0
    assert "network      gloo on lo: the collective's option interface=" in out.splitlines()
    code, out = run(*argv, "--main-address", "no-such-host.invalid")
    assert code == 0  # explain says it; the ranks refuse it at set-up
    [line] = [x for x in out.splitlines() if x.startswith("network")]
    assert "the main address 'no-such-host.invalid' (MASTER_ADDR) does not resolve on this host" in line


@pytest.mark.parametrize(
    ("argv", "traffic"),
    [
        (
            ["--strategy", "ddp"],
            "DDP's gradient buckets and broadcasts go through the torch collective's own c10d group",
        ),
        (
            ["--strategy", "fsdp", "--collective", "thirdparty"],
            "fully_shard's all-gathers and reduce-scatters go through the 'thirdparty' collective's "
            "operations, as a torch ProcessGroup (CollectiveProcessGroup)",
        ),
        (
            ["--strategy", "manual", "--collective", "thirdparty"],
            "your DDP / FSDP / DTensor on strategy.process_group go through the 'thirdparty' collective's",
        ),
        (
            ["--strategy", "ddp", "--collective", "compressed"],
            "DDP's gradient buckets and broadcasts go through the 'compressed' collective's operations, "
            "as a torch ProcessGroup",
        ),
        (
            ["--strategy", "ddp", "--collective", "hierarchical"],
            "DDP's gradient buckets and broadcasts go through the 'hierarchical' collective's operations",
        ),
        (
            ["--strategy", "fsdp"],
            "fully_shard's all-gathers and reduce-scatters go through the torch collective's own c10d group",
        ),
        (
            ["--strategy", "fsdp", "--collective", "compressed"],
            "fully_shard's all-gathers and reduce-scatters go through the 'compressed' collective's",
        ),
        (
            ["--strategy", "fsdp", "--collective", "hierarchical"],
            "fully_shard's all-gathers and reduce-scatters go through the 'hierarchical' collective's",
        ),
        (["--strategy", "single_device", "--devices", "1"], None),
    ],
)
def test_explain_says_which_part_carries_the_training_traffic(phalanx_distribution, argv, traffic):
    phalanx_distribution(
        "phalanx-thirdparty",
        entry_points={"thirdparty": "phalanx_thirdparty"},
        modules={
            "phalanx_thirdparty": (
                "from phalanx_core import CollectiveSpec, hookimpl\n"
                "@hookimpl\n"
                "def phalanx_collectives():\n"
                "    return [CollectiveSpec(name='thirdparty', target='phalanx_thirdparty:C')]\n"
                "from phalanx_torch.collectives import TorchCollective\n"
                "class C(TorchCollective):\n"
                "    name = 'thirdparty'\n"
            )
        },
    )
    code, out = run("explain", "--accelerator", "cpu", "--devices", "2", *argv)
    assert code == 0, out
    lines = [line for line in out.splitlines() if line.startswith("traffic  ")]
    if traffic is None:
        assert not lines, out
    else:
        assert lines and lines[0].startswith(f"traffic      {traffic}"), out
    code, out = run("explain", "--json", "--accelerator", "cpu", "--devices", "2", *argv)
    got = json.loads(out)["traffic"]
    assert got is None if traffic is None else got.startswith(traffic)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precision", "16-mixed", "--accelerator", "cpu"], "'16-mixed' on accelerator 'cpu'"),
        (["--devices", "0,1", "--accelerator", "cpu"], "device indices mean nothing there"),
        (
            ["--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "--collective", "single_device"],
            "the 'single_device' collective is a world of one, but the job has 2 processes",
        ),
    ],
)
def test_explain_refuses_what_resolve_refuses(capsys, argv, message):
    assert main(["explain", *argv], io.StringIO()) != 0
    assert message in capsys.readouterr().err
    # --plan-only chooses the parts without building them, and says so
    code, out = run("explain", "--plan-only", *argv)
    if code == 0:
        assert out.splitlines()[-1].startswith("checked      the choice of parts only (--plan-only)")


def test_explain_says_what_it_checked():
    code, out = run("explain", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2")
    assert code == 0
    assert out.splitlines()[-1] == (
        "checked      everything resolve() checks; not the rendezvous, which needs the processes launch starts"
    )
    code, out = run("explain", "--json", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2")
    assert json.loads(out)["built"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "nope"], "unknown strategy 'nope'"),
        (["--strategy", "single_device", "--devices", "3"], "runs on one device in one process"),
        (["--precision", "fp9"], "unknown precision 'fp9'"),
    ],
)
def test_explain_fails_with_the_message_and_a_nonzero_code(capsys, argv, message):
    code, _ = run("explain", *argv)
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("phalanx explain: error: ")
    assert message in err
    assert "Traceback" not in err


def test_bad_usage_exits_with_argparse_code():
    with pytest.raises(SystemExit) as info:
        run("list", "--kind", "gpu")
    assert info.value.code == 2


def test_a_reader_that_leaves_early_gets_no_traceback():
    """``phalanx list | head -1``: the reader has gone when phalanx writes
    (here: before); the command ends quietly with the shell's SIGPIPE code."""
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()  # no reader left
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 141
    assert "Traceback" not in stderr, stderr


def test_list_points_out_a_plugin_whose_entry_module_is_slow_to_import(phalanx_distribution):
    """Issue 31, item 8: every `phalanx list` and `resolve()` imports every
    plugin's entry module, so one that imports a heavy backend at its top
    slows them all; `phalanx list` names it, with the rule and the way to
    skip it."""
    phalanx_distribution(
        "phalanx-slow",
        entry_points={"slow": "phalanx_slow"},
        modules={
            "phalanx_slow": (
                "import time\n"
                "from phalanx_core import CollectiveSpec, hookimpl\n"
                "time.sleep(0.6)  # a heavy backend imported at the top\n"
                "@hookimpl\n"
                "def phalanx_collectives():\n"
                "    return [CollectiveSpec(name='slowcoll', target='phalanx_slow.impl:C')]\n"
            )
        },
    )
    registry = phalanx.Registry()  # the first import of the entry module, timed
    [record] = [p for p in registry.plugins if p.provider.plugin == "slow"]
    assert record.import_seconds >= 0.6 and record.to_dict()["import_seconds"] == record.import_seconds
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(phalanx.cli, "Registry", lambda: registry)
        assert phalanx.cli.main(["list"], out) == 0
    slow = [line for line in out.getvalue().splitlines() if line.startswith("slow: ")]
    assert len(slow) == 1, out.getvalue()  # the in-repo plugins' entry modules are light
    assert "'slow' (phalanx-slow 0.1.0): its entry module 'phalanx_slow' took" in slow[0]
    assert "PHALANX_DISABLE_PLUGINS=slow skips it" in slow[0]
