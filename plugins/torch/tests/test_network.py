"""Which interface the torch collective's ranks connect over, and the
errors for an address that cannot work (one host: loopback and the
machine's own interfaces; the multi-host cases run in tests/multihost)."""

from __future__ import annotations

import socket

import pytest

from phalanx_core import CollectiveConnectionError, MisconfigurationError
from phalanx_torch._launch import listen as _listen
from phalanx_torch.collectives import TorchCollective


@pytest.fixture
def clean(monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)


def _outward() -> str | None:
    """An address of this machine other than loopback, where it has one."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                import fcntl
                import struct

                reply = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not address.startswith("127."):
                return address
    return None


def test_a_main_address_on_loopback_leaves_the_choice_to_the_backend(clean):
    choice = _listen.choose_network("127.0.0.1", 29500, "gloo")
    assert choice.interface is None and choice.variables == {} and choice.problem is None
    assert (
        choice.reason
        == "the main address 127.0.0.1 leads to this host's loopback; with nodes on other hosts, this host takes the interface of the address they reach it at, when the group is made"
    )


def test_the_route_to_the_main_address_names_the_interface(clean):
    address = _outward()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    interface = _listen.interface_of(address)
    choice = _listen.choose_network(address, 29500, "nccl")
    assert choice.interface == interface
    assert choice.variables == {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}
    assert choice.main_seen_as == address
    assert (
        choice.reason
        == f"{interface} ({address}) is where the route to the main address {address} leaves from"
    )


def test_variables_you_set_are_kept(clean, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    choice = _listen.choose_network("127.0.0.1", 29500, "gloo")
    assert (choice.interface, choice.variables) == ("lo", {})
    assert choice.reason == "GLOO_SOCKET_IFNAME=lo in the environment"


def test_the_interface_option_must_exist_and_agree_with_the_variables(clean, monkeypatch):
    assert _listen.choose_network("127.0.0.1", 29500, "gloo", "lo").variables == {"GLOO_SOCKET_IFNAME": "lo"}
    with pytest.raises(
        ValueError, match=r"interface='nope0' is not a network interface of this host; it has .*lo"
    ):
        _listen.choose_network("127.0.0.1", 29500, "gloo", "nope0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    with pytest.raises(
        ValueError, match=r"interface='lo', but GLOO_SOCKET_IFNAME=eth9 is set in the environment"
    ):
        _listen.choose_network("127.0.0.1", 29500, "gloo", "lo")


def test_a_main_address_that_does_not_resolve_is_a_problem_named_before_anything_waits(clean):
    choice = _listen.choose_network("no-such-host.invalid", 29500, "gloo")
    assert choice.problem is not None
    assert choice.problem.startswith(
        "the main address 'no-such-host.invalid' (MASTER_ADDR) does not resolve on this host"
    )


class _Env:
    main_address = "no-such-host.invalid"
    main_port = 29500
    world_size = 2
    global_rank = 1
    local_rank = 0
    node_rank = 1


def test_setup_refuses_a_main_address_it_cannot_reach(clean):
    collective = TorchCollective(timeout=5)
    with pytest.raises(CollectiveConnectionError) as info:
        collective.setup(_Env())  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(
        f"setup() on the 'torch' collective (gloo, rank 1 of 2 on {socket.gethostname()}): "
    )
    assert "does not resolve" in message and info.value.operation == "setup"


def test_setup_refuses_an_interface_this_host_lacks(clean):
    env = _Env()
    env.main_address = "127.0.0.1"
    with pytest.raises(
        MisconfigurationError, match=r"collective 'torch': interface='nope0' is not a network interface"
    ):
        TorchCollective(interface="nope0").setup(env)  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"TorchCollective\(interface=3\)"):
        TorchCollective(interface=3)  # type: ignore[arg-type]


def test_network_describes_the_choice_for_explain(clean):
    collective = TorchCollective()
    assert collective.network("127.0.0.1", 29500, 1) == "one rank: no connections to other ranks"
    assert collective.network("127.0.0.1", 29500, 2) == (
        "gloo's own choice: the main address 127.0.0.1 leads to this host's loopback; with nodes on other hosts, this host takes the interface of the address they reach it at, when the group is made"
    )
    assert TorchCollective(interface="lo").network("127.0.0.1", 29500, 2) == (
        "gloo on lo: the collective's option interface="
    )


def test_a_scheduler_job_s_main_address_is_the_first_node_s_ip_on_every_node(monkeypatch):
    """Slurm and LSF name hosts; node 0's own name may lead to 127.0.1.1
    there, so every node takes node 0's IP address instead."""
    from phalanx_torch._launch import scheduler_vars as _scheduler_vars

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    me = socket.gethostname()
    # On the first node: the address it reaches the next node from.
    monkeypatch.setattr(_scheduler_vars, "route_source", lambda host, port: {"phx-n9": "10.9.0.1"}[host])
    assert _scheduler_vars._address([me, "phx-n9"]) == "10.9.0.1"
    # Elsewhere: what the first node's name resolves to.
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host == "phx-n0":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.9.0.7", 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(_scheduler_vars.socket, "getaddrinfo", resolve)
    assert _scheduler_vars._address(["phx-n0", me]) == "10.9.0.7"
    assert _scheduler_vars._address(["phx-unknown.invalid", me]) == "phx-unknown.invalid"
    assert _scheduler_vars._address([me, me]) == "127.0.0.1"  # one node
    monkeypatch.setenv("MASTER_ADDR", "head")
    assert _scheduler_vars._address(["phx-n0", me]) == "head"
