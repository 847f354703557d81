"""Several hosts on one machine, made of Linux network namespaces, for tests
of jobs that span nodes. Needs root, ``ip`` (iproute2) and ``unshare``
(util-linux)::

    from phalanx_core.testing.hosts import TestBed, missing

    @pytest.mark.skipif(missing() is not None, reason=str(missing()))
    def test_two_nodes():
        with TestBed(2) as bed:
            a, b = bed.hosts
            print(a.name, a.address, a.interface)     # node0 192.168.77.1 eth0
            a.run(["python", "-c", "import socket; print(socket.gethostname())"])

Each host is a network namespace with loopback up and one interface,
``eth0``, plugged into a bridge that lives in a namespace of its own (the
switch), so the hosts reach each other on private addresses and nothing
else; the machine's own interfaces and routes are never touched. A command
run on a host sees that host's network only, its own host name (a UTS
namespace per command, ``unshare --uts``) and its own ``/etc/hosts``
(``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over it):

- ``names_on_loopback=True`` (the default) is what Debian and Ubuntu
  install: a host's own name maps to ``127.0.1.1``, the other hosts' names
  to their addresses (a cluster's DNS). Software that finds its address
  from its host name (gloo, the c10d store) then finds loopback: the trap
  that multi-node jobs fall into.
- ``names_on_loopback=False``: every name, its own included, maps to the
  host's address on the bridge.

:meth:`TestBed.close` (the ``with`` block's end, also when a test fails)
kills every process still running in a host's namespace, by pid, then
removes the namespaces and their ``/etc/netns`` folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Host", "TestBed", "missing"]

_NETNS_ETC = Path("/etc/netns")


def missing() -> str | None:
    """Why a test bed cannot be made here, or ``None`` when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"network namespaces need `{tool}` ({package})"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


@dataclass
class Host:
    """One host of a :class:`TestBed`."""

    #: Its host name (``node0``, ``node1``, ...).
    name: str
    #: Its address on the bridge (``192.168.77.1``, ...).
    address: str
    #: The network namespace it is.
    namespace: str
    #: The name of its interface on the bridge.
    interface: str = "eth0"
    _processes: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs on this host."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.name,
            *argv,
        ]

    def popen(self, argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host (``subprocess.Popen`` options); the
        test bed kills it at the end if it still runs."""
        process = subprocess.Popen(self.command(argv), **options)
        self._processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], *, timeout: float = 60, **options: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on this host to its end (``subprocess.run``
        options; output captured as text unless told otherwise)."""
        options.setdefault("capture_output", True)
        options.setdefault("text", True)
        return subprocess.run(self.command(argv), timeout=timeout, **options)


class TestBed:
    """``count`` hosts on a private network; see the module's docstring.

    ``subnet`` is the first three numbers of the hosts' addresses (host
    ``i`` is ``<subnet>.<i + 1>``, on a /24). The default sorts above
    ``127.0.1.1``: gloo connects each pair of ranks from the rank whose
    address sorts higher, so a node-0 rank that wrongly listens on its
    host name's loopback address is dialled by the others, and fails, rather
    than dialling out and hiding the fault (as on ``10.x`` addresses). Use it as a context manager,
    or call :meth:`open` and :meth:`close`.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, count: int = 2, *, names_on_loopback: bool = True, subnet: str = "192.168.77") -> None:
        if not 1 <= count <= 250:
            raise ValueError(f"TestBed(count={count!r}): between 1 and 250 hosts")
        self.tag = uuid.uuid4().hex[:6]
        self.names_on_loopback = names_on_loopback
        self.switch = f"phx{self.tag}sw"
        self.hosts = [
            Host(name=f"node{i}", address=f"{subnet}.{i + 1}", namespace=f"phx{self.tag}n{i}")
            for i in range(count)
        ]

    def __enter__(self) -> TestBed:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        """Make the namespaces, the bridge and the hosts files."""
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                port = f"port{i}"
                _ip("netns", "add", host.namespace)
                _ip("-n", host.namespace, "link", "set", "lo", "up")
                veth = ["type", "veth", "peer", "name", port, "netns", self.switch]
                _ip("link", "add", host.interface, "netns", host.namespace, *veth)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
                _ip("-n", host.namespace, "link", "set", host.interface, "up")
                folder = _NETNS_ETC / host.namespace
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text(self.hosts_file(host))
        except BaseException:
            self.close()
            raise

    def hosts_file(self, host: Host) -> str:
        """What ``/etc/hosts`` holds on ``host``."""
        lines = ["127.0.0.1\tlocalhost"]
        for other in self.hosts:
            if other is host and self.names_on_loopback:
                lines.append(f"127.0.1.1\t{other.name}")
            else:
                lines.append(f"{other.address}\t{other.name}")
        # c10d names every peer of its dual-stack sockets by a reverse
        # lookup of its IPv4-mapped IPv6 address, which glibc asks DNS for
        # (not /etc/hosts' IPv4 lines); no DNS server is reachable from the
        # namespaces, so it warned "The hostname of the client socket
        # cannot be retrieved. err=-3" (EAI_AGAIN) on every run.
        mapped = ["127.0.0.1", "127.0.1.1", *(other.address for other in self.hosts)]
        lines += [f"::ffff:{address}\tmapped-{address.replace('.', '-')}" for address in mapped]
        return "\n".join(lines) + "\n"

    def pids(self, host: Host) -> list[int]:
        """The processes running in ``host``'s namespace now."""
        command = ["ip", "netns", "pids", host.namespace]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        return [int(pid) for pid in done.stdout.split()]

    def cut(self, host: Host) -> None:
        """Cut ``host`` off the network (its port of the bridge down):
        what it sends is lost, and nothing of it reaches the others, not
        even the closing of its connections (as a host that loses its
        power or its network). Kill its processes after, with
        :meth:`kill_all`, for a host that never comes back."""
        _ip("-n", self.switch, "link", "set", f"port{self.hosts.index(host)}", "down")

    def reconnect(self, host: Host) -> None:
        """Put a host that :meth:`cut` took off the network back on it."""
        _ip("-n", self.switch, "link", "set", f"port{self.hosts.index(host)}", "up")

    def limit(self, host: Host, rate: str | None) -> None:
        """Limit ``host``'s link to ``rate`` each way (tc's token bucket:
        ``"100mbit"``), or lift the limit (``None``): a slow link between
        racks or sites, for benchmarks."""
        port = f"port{self.hosts.index(host)}"
        for namespace, device in ((host.namespace, host.interface), (self.switch, port)):
            if rate is None:
                subprocess.run(
                    ["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"],
                    capture_output=True,
                    timeout=30,
                )
                continue
            command = ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate]
            done = subprocess.run(
                ["ip", "netns", "exec", namespace, *command, "burst", "256kb", "latency", "100ms"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if done.returncode != 0:
                raise RuntimeError(f"tc in {namespace}: {done.stderr.strip()}")

    def bytes_sent(self, host: Host) -> int:
        """The bytes ``host`` has sent on its link since the bed was made
        (its interface's own counter: every byte of every process, the
        stores' and the heartbeats' too)."""
        command = ["ip", "-n", host.namespace, "-j", "-s", "link", "show", "dev", host.interface]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        return int(json.loads(done.stdout)[0]["stats64"]["tx"]["bytes"])

    def start_etcd(self, folder: Path, hosts: Sequence[Host] | None = None) -> str:
        """One etcd member on each of ``hosts`` (default: every host), its
        data under ``folder``, the v3 API only (as etcd 3.6 runs); they
        end with the bed; with pre-vote (a member cut off and back does
        not disturb the others' leader). Their client addresses, ``"A:2379,B:2379,..."``
        (for ``--rendezvous etcd://...``). Needs ``etcd`` on the PATH."""
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        hosts = list(self.hosts if hosts is None else hosts)
        members = ",".join(f"{h.name}=http://{h.address}:2380" for h in hosts)
        for host in hosts:
            argv = [
                etcd, "--name", host.name, "--data-dir", str(folder / f"etcd-{host.name}"),
                "--listen-client-urls", f"http://{host.address}:2379",
                "--advertise-client-urls", f"http://{host.address}:2379",
                "--listen-peer-urls", f"http://{host.address}:2380",
                "--initial-advertise-peer-urls", f"http://{host.address}:2380",
                "--initial-cluster", members, "--initial-cluster-state", "new",
                # A member cut off and back does not make the others elect a
                # leader again (etcd 3.5 and later pre-vote by default).
                "--pre-vote",
                "--log-level", "error",
            ]  # fmt: skip
            host.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return ",".join(f"{h.address}:2379" for h in hosts)

    def kill_all(self, host: Host) -> int:
        """SIGKILL every process of ``host`` at once, as a lost machine
        would end them; return how many there were."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def close(self) -> None:
        """Kill what still runs on the hosts; remove the namespaces."""
        for host in self.hosts:
            for process in host._processes:
                if process.poll() is None:
                    process.kill()
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                for pid in self.pids(host):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            for process in host._processes:
                with contextlib.suppress(subprocess.SubprocessError):
                    process.wait(timeout=30)
            host._processes.clear()
        for namespace in [host.namespace for host in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)
            shutil.rmtree(_NETNS_ETC / namespace, ignore_errors=True)
