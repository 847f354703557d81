"""Which network Open MPI's TCP transport is kept on (no MPI needed: the
choice is made before mpi4py starts MPI)."""

from __future__ import annotations

import pytest

from phalanx_core.network import interface_network, interface_of, route_source
from phalanx_mpi.collective import _tcp_network


@pytest.fixture
def clean(monkeypatch):
    for name in ("MASTER_ADDR", "OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl_tcp_if_exclude"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_nothing_on_one_host_or_without_a_main_address(clean):
    assert _tcp_network() == {}
    clean.setenv("MASTER_ADDR", "127.0.0.1")
    assert _tcp_network() == {}


def test_a_network_you_named_is_kept(clean):
    clean.setenv("MASTER_ADDR", "192.0.2.77")
    clean.setenv("OMPI_MCA_btl_tcp_if_exclude", "docker0")
    assert _tcp_network() == {}


def test_the_network_of_the_route_to_the_main_address(clean):
    try:
        source = route_source("192.0.2.77")  # TEST-NET-1: only a route is asked for, nothing is sent
    except OSError:
        pytest.skip("no route leaves this machine")
    interface = interface_of(source)
    if interface is None or interface == "lo":
        pytest.skip("the route leaves by no interface that can be told")
    clean.setenv("MASTER_ADDR", "192.0.2.77")
    assert _tcp_network() == {"OMPI_MCA_btl_tcp_if_include": interface_network(interface)}
