"""What the schedulers' variables mean: reading them, host lists, ports and
layouts. Shared by the environments in :mod:`phalanx_torch.environments`;
imports no torch."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import zlib

from phalanx_core import MisconfigurationError
from phalanx_core.network import is_loopback, route_source

_LOOPBACK = "127.0.0.1"
#: Any port, for a route's source address (a UDP connect sends nothing).
_ANY_PORT = 9


# -- reading variables -----------------------------------------------------------


def _var(*names: str) -> str | None:
    """The value of the first of ``names`` that is set and not empty."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def _int_var(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise MisconfigurationError(
            f"environment variable {name}={value!r} is not an integer; fix or unset it"
        ) from None


def _first_int(names: tuple[str, ...], default: int | None = None) -> int | None:
    """The first of ``names`` that is set, as an int (``default`` when none is)."""
    for name in names:
        if os.environ.get(name):
            return _int_var(name, 0)
    return default


def _peek_int(*names: str) -> int | None:
    """Like :func:`_first_int` but never raises: for ``detect()``."""
    value = _var(*names)
    return int(value) if value is not None and value.strip().isdigit() else None


def _need_int(names: tuple[str, ...], who: str) -> int:
    value = _first_int(names)
    if value is None:
        raise MisconfigurationError(
            f"environment {who!r} needs {' or '.join(names)}, which is not set; start the script "
            f"with the launcher that sets it, or name another environment (environment=...)"
        )
    return value


def _port_from_job_id(job_id: str) -> int:
    """10000 + the last four digits of a numeric job id: the same on every rank."""
    digits = re.sub(r"\D", "", job_id)[-4:]
    return 10000 + int(digits or "0")


def _port_from_key(key: str) -> int:
    """A port in 20000-29999 from any job-wide string (crc32: stable across processes)."""
    return 20000 + zlib.crc32(key.encode()) % 10000


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_this_host(host: str) -> bool:
    """Whether a scheduler's host name is this machine: the same name, or
    the same short name where one of the two is short (``node1`` and
    ``node1.cluster``). Two qualified names, or an IP address, must match
    whole (``10.10.10.2`` is not ``10.10.10.0``; ``node1.a`` not ``node1.b``)."""
    if host in ("localhost", _LOOPBACK):
        return True
    mine = socket.gethostname()
    if host == mine:
        return True
    if _is_ip(host) or _is_ip(mine) or ("." in host and "." in mine):
        return False
    return host.split(".")[0] == mine.split(".")[0]


def _address(hosts: list[str]) -> str:
    """The main address: MASTER_ADDR if set; 127.0.0.1 on one node. On
    several, the first node's IP address, the same on every node: where the
    first node is this one, the address this node sends from to reach the
    next node of the job (never its own name, which Debian's hosts file maps
    to 127.0.1.1: gloo would listen there, where no other node reaches it);
    elsewhere the address the first node's name resolves to. A name that
    does not resolve leaves the name (127.0.0.1 on the first node itself)."""
    asked = _var("MASTER_ADDR")
    if asked is not None:
        return asked
    if not hosts or len(set(hosts)) == 1:
        return _LOOPBACK
    if not _is_this_host(hosts[0]):
        try:
            return str(socket.getaddrinfo(hosts[0], None, type=socket.SOCK_STREAM)[0][4][0])
        except OSError:
            return hosts[0]
    other = next((host for host in hosts if not _is_this_host(host)), None)
    try:
        source = route_source(other, _ANY_PORT) if other is not None else _LOOPBACK
    except OSError:
        return _LOOPBACK
    return _LOOPBACK if is_loopback(source) else source


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list: ``"node[1-3,5],gpu-0[08-10]"`` -> ``node1``,
    ``node2``, ``node3``, ``node5``, ``gpu-008``, ``gpu-009``, ``gpu-010``.
    Zero padding follows the range's first number; several brackets in one
    name expand as a product (``r[1-2]n[1-2]`` gives four hosts).

    Raises:
        ValueError: a bracket that does not close or a range that is not numeric.
    """
    items, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ValueError(f"host list {text!r}: ']' without '['")
        if depth == 0 and (ch == "," or ch.isspace()):
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise ValueError(f"host list {text!r}: '[' without ']'")
    return [host for item in (*items, current) if item for host in _expand_one(item, text)]


def _expand_one(item: str, text: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    hosts = []
    for part in match.group(1).split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"host list {text!r}: {part!r} is not a number or a range a-b")
        numbers = range(int(low), int(high or low) + 1)
        for number in numbers:
            hosts += _expand_one(f"{head}{str(number).zfill(len(low))}{tail}", text)
    return hosts


def _tasks_per_node(text: str) -> list[int]:
    """Slurm's ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise MisconfigurationError(f"cannot read tasks per node {text!r}; unset it or fix it")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _check_layout(
    *,
    who: str,
    world: tuple[str, int],
    nodes: tuple[str, int] | None,
    per_node: tuple[str, list[int]] | None,
    num_devices: int,
    num_nodes: int,
    fix: str,
    others_unseen: bool = False,
) -> None:
    """Raise when the processes a scheduler started are not devices x num_nodes.

    ``world``, ``nodes`` and ``per_node`` are (the variable read, its value);
    ``fix`` is the scheduler's own flags for ``{devices}`` per node on
    ``{num_nodes}`` nodes, as a format string. ``others_unseen``: ``per_node``
    holds this node's count only (torchrun's ``LOCAL_WORLD_SIZE``).
    """
    wanted = num_devices * num_nodes
    how = fix.format(devices=num_devices, num_nodes=num_nodes, total=wanted)
    if nodes is not None and nodes[1] != num_nodes:
        raise MisconfigurationError(
            f"{who} runs on {nodes[0]}={nodes[1]} node(s), but num_nodes={num_nodes} was asked for; "
            f"pass num_nodes={nodes[1]}, or start the job on {num_nodes} node(s) ({how})"
        )
    world_var, size = world
    here_as_asked = per_node is not None and per_node[1] == [num_devices]
    if size != wanted and others_unseen and here_as_asked and nodes is not None:
        # This node started what was asked; another did not. The plan check
        # across nodes, when the collective is set up, shows which node
        # differs in what, side by side.
        return
    if size != wanted:
        suggest = f"devices={size // nodes[1]}" if nodes and size % nodes[1] == 0 else "devices/num_nodes"
        raise MisconfigurationError(
            f"{who} started {world_var}={size} process(es), but devices={num_devices} x num_nodes="
            f"{num_nodes} = {wanted} were asked for; start {num_devices} per node ({how}), or set "
            f"{suggest} to match the job"
        )
    if per_node is not None and any(count != num_devices for count in per_node[1]):
        raise MisconfigurationError(
            f"{who} placed {per_node[0]}={','.join(map(str, per_node[1]))} process(es) per node, but "
            f"devices={num_devices} needs {num_devices} on every node; start them evenly ({how})"
        )


def _mpi_launcher_started_this(tasks: int | None, rank: int | None) -> bool:
    """Whether an ``mpirun`` (run inside a Slurm or LSF job) made this process
    rather than the scheduler's own launcher: OpenMPI's ``mpirun`` sets
    ``OMPI_COMM_WORLD_SIZE``, which ``srun`` never sets; a PMI launcher
    (MPICH's Hydra) sets ``PMI_SIZE``/``PMI_RANK`` that differ from the
    scheduler's task count and rank (``srun --mpi=pmi2`` sets equal ones).
    Then the ranks are the MPI launcher's and ``mpi`` must read them."""
    if _var("OMPI_COMM_WORLD_SIZE") is not None:
        return True
    size, pmi_rank = _peek_int("PMI_SIZE"), _peek_int("PMI_RANK")
    return size is not None and (size != tasks or (pmi_rank is not None and pmi_rank != rank))


# -- the environments ----------------------------------------------------------------
