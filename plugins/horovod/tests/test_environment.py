"""The ``horovod`` environment under horovodrun's variables (what
``horovodrun --gloo -np 4 -H a:2,b:2`` sets in rank 3), read without
horovod: the variables only. The real horovodrun is in test_horovodrun.py."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

import phalanx
from phalanx.testing.suites import EnvironmentSuite
from phalanx_core import MisconfigurationError
from phalanx_horovod.environment import HorovodEnvironment

RANK_3_OF_4 = {
    "HOROVOD_RANK": "3",
    "HOROVOD_SIZE": "4",
    "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2",
    "HOROVOD_CROSS_RANK": "1",
    "HOROVOD_CROSS_SIZE": "2",
    "HOROVOD_HOSTNAME": "b",
    "HOROVOD_CONTROLLER": "gloo",
    "HOROVOD_CPU_OPERATIONS": "gloo",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
    "HOROVOD_GLOO_RENDEZVOUS_PORT": "41234",
}


class TestHorovodEnvironment(EnvironmentSuite):
    environment = "horovod"
    variables: ClassVar[dict[str, str]] = RANK_3_OF_4
    expected: ClassVar[dict[str, Any]] = {"world_size": 4, "global_rank": 3, "local_rank": 1, "node_rank": 1}


class TestUnderMpirun(EnvironmentSuite):
    """horovodrun with the MPI controller: OpenMPI's variables are there
    too, and horovod (priority 90) wins over mpi (50)."""

    environment = "horovod"
    variables: ClassVar[dict[str, str]] = {
        **RANK_3_OF_4,
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    }
    expected: ClassVar[dict[str, Any]] = {"world_size": 4, "global_rank": 3}


@pytest.fixture
def horovodrun(monkeypatch: pytest.MonkeyPatch):
    for name in list(__import__("os").environ):
        if name.startswith(EnvironmentSuite.cleared):
            monkeypatch.delenv(name)
    for name, value in RANK_3_OF_4.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_the_port_is_the_same_on_every_rank_and_master_variables_win(horovodrun):
    port = HorovodEnvironment().main_port
    assert 20000 <= port < 30000
    horovodrun.setenv("HOROVOD_RANK", "0")
    assert HorovodEnvironment().main_port == port
    horovodrun.setenv("MASTER_PORT", "1234")
    horovodrun.setenv("MASTER_ADDR", "10.0.0.7")
    assert (HorovodEnvironment().main_address, HorovodEnvironment().main_port) == ("10.0.0.7", 1234)


def test_several_nodes_need_master_addr_for_a_torch_group(horovodrun):
    with pytest.raises(MisconfigurationError, match=r"MASTER_ADDR.*rank 0's host"):
        HorovodEnvironment().main_address


def test_one_node_uses_loopback(horovodrun):
    for name, value in {"HOROVOD_CROSS_SIZE": "1", "HOROVOD_CROSS_RANK": "0", "HOROVOD_SIZE": "2"}.items():
        horovodrun.setenv(name, value)
    horovodrun.setenv("HOROVOD_RANK", "1")
    assert HorovodEnvironment().main_address == "127.0.0.1"


@pytest.mark.parametrize(
    ("devices", "num_nodes", "words"),
    [
        (4, 1, ["num_nodes=1", "HOROVOD_CROSS_SIZE=2"]),
        (3, 2, ["HOROVOD_SIZE=4", "devices=2"]),
        (1, 2, ["HOROVOD_SIZE=4", "devices=2"]),
    ],
)
def test_a_layout_other_than_horovodruns_is_refused(horovodrun, devices, num_nodes, words):
    with pytest.raises(MisconfigurationError) as info:
        HorovodEnvironment().validate(num_devices=devices, num_nodes=num_nodes)
    for word in words:
        assert word in str(info.value)


def test_the_layout_of_the_job_is_accepted(horovodrun):
    HorovodEnvironment().validate(num_devices=2, num_nodes=2)


def test_a_variable_that_is_not_a_number_is_named(horovodrun):
    horovodrun.setenv("HOROVOD_RANK", "three")
    with pytest.raises(MisconfigurationError, match="HOROVOD_RANK='three'"):
        HorovodEnvironment().global_rank


def test_under_horovodrun_the_processes_exist_so_the_launcher_runs_in_place(horovodrun):
    plan = phalanx.Registry().plan("ddp", accelerator="cpu", devices=2, num_nodes=2)
    assert plan.environment.name == "horovod"
    assert plan.launcher.name == "in_process", plan.explain()
