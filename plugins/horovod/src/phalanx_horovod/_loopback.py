"""Horovod's HTTP servers on 127.0.0.1 only, for a launch on this machine.

``horovod.run`` and ``horovodrun`` host two HTTP servers in the launching
process: the rendezvous of Horovod's gloo context, and (``horovod.run``)
the store that carries ``fn`` to the ranks and their results back. Horovod
0.28 binds both to every interface (``('', port)`` in
``horovod.runner.util.network.find_port``, which ``horovod.runner.http.http_server``
imports) and has no option for it. Its ranks on this machine reach them at
127.0.0.1, the address of the loopback interface it is given
(``network_interfaces``), so :func:`servers_on_loopback` binds them there,
on a port the kernel gives.

``python -m phalanx_horovod._loopback ARGS`` is ``horovodrun ARGS`` with
that done (the launcher's ``run_script``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from phalanx_core.launching import LOOPBACK

__all__ = ["servers_on_loopback"]


def _find_port(server_factory: Callable[[tuple[str, int]], Any]) -> tuple[Any, int]:
    """horovod's ``find_port``, on loopback: the server, and its port."""
    server = server_factory((LOOPBACK, 0))
    return server, int(server.server_address[1])


@contextlib.contextmanager
def servers_on_loopback() -> Iterator[None]:
    """While it lasts, the HTTP servers Horovod starts in this process
    listen on 127.0.0.1 only. Changes horovod's module for the whole
    process meanwhile (one launch at a time, as ``horovod.run`` allows
    anyway: it sets this process's signal handlers); a horovod without
    that function is left alone."""
    from horovod.runner.http import http_server  # type: ignore[import-not-found, import-untyped, unused-ignore]

    saved = getattr(http_server, "find_port", None)
    if saved is None:
        yield
        return
    http_server.find_port = _find_port
    try:
        yield
    finally:
        http_server.find_port = saved


if __name__ == "__main__":
    from horovod.runner.launch import run_commandline  # type: ignore[import-not-found, import-untyped, unused-ignore]

    sys.argv[0] = "horovodrun"
    with servers_on_loopback():
        run_commandline()
