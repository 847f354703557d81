"""What runs inside the Ray actors: a rank (:class:`Rank`), its output
carried to the launching process (:class:`Outbox`), and the rendezvous
store rank 0 hosts. Imported by ray in the actors; imports ray and torch
only inside methods."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from phalanx_core.launching import exit_code_of, failure_text, hosted_store, run_program

#: Lines Ray writes into a worker's stdout to name the task it runs, for its
#: own log prefixes; not the rank's output.
_RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:")


class Outbox:
    """The ranks' output on its way to the launching process: each rank's
    reader threads put lines, the launcher takes them. One actor per job,
    with no CPU of its own."""

    def __init__(self) -> None:
        self._lines: list[tuple[int, str, list[str]]] = []

    def put(self, rank: int, stream: str, lines: list[str]) -> None:
        self._lines.append((rank, stream, lines))

    def take(self) -> list[tuple[int, str, list[str]]]:
        lines, self._lines = self._lines, []
        return lines


class _Capture:
    """This process's stdout and stderr (file descriptors 1 and 2, so what
    native code writes too) sent line by line to ``sink`` while it is open;
    :meth:`close` gives the descriptors back and returns once every line
    written before it was sent."""

    def __init__(self, sink: Callable[[str, list[str]], None]) -> None:
        self._sink = sink
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        _flush()
        for fd, stream in ((1, "out"), (2, "err")):
            read, write = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write, fd)
            os.close(write)
            thread = threading.Thread(
                target=self._pump, args=(read, stream), name=f"phalanx-std{stream}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _pump(self, read: int, stream: str) -> None:
        partial = b""
        try:
            while True:
                chunk = os.read(read, 1 << 16)
                if not chunk:
                    break
                *lines, partial = (partial + chunk).split(b"\n")
                self._send(stream, lines)
        finally:
            os.close(read)
            self._send(stream, [partial] if partial else [])

    def _send(self, stream: str, lines: list[bytes]) -> None:
        text = [line.decode(errors="replace") for line in lines]
        text = [line for line in text if not line.startswith(_RAY_MARKERS)]
        if text:
            with contextlib.suppress(Exception):  # the launcher has gone: nobody to tell
                self._sink(stream, text)

    def close(self, wait: float = 10.0) -> None:
        _flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # the pipe's last writer in this process: its reader sees the end
            os.close(saved)
        self._saved.clear()
        # A process this rank started and left running (a data loader's
        # worker) may still hold the pipe; its lines come later, or not.
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class Rank:
    """One rank: a Ray actor that runs the function (or the script) each
    launch sends, in its main thread, with its output captured."""

    def __init__(self, outbox: Any, job: str) -> None:
        self.rank = -1
        self.job = job
        self._outbox = outbox
        self._store: Any = None

    def __repr__(self) -> str:  # Ray prefixes this actor's own log lines with it
        return f"rank{self.rank}" if self.rank >= 0 else "phalanx-rank"

    def describe(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {
            "address": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "cwd": os.getcwd(),
        }

    def set_variables(self, rank: int, variables: dict[str, str]) -> None:
        """This rank's number and the variables the ``ray`` environment and
        torch's ``env://`` rendezvous read."""
        self.rank = rank
        os.environ.update(variables)
        if variables.get("OMP_NUM_THREADS") == "1" and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)

    def host_store(self, address: str) -> int:
        """Host the job's rendezvous store (rank 0), listening on
        ``address`` only, on a port the kernel gives: no port is chosen by
        binding and closing a socket. The ranks join it as clients
        (``TORCHELASTIC_USE_AGENT_STORE``). Kept while this actor lives."""
        self._store = hosted_store(address, wait_for_workers=False)
        return int(self._store.port)

    def _sink(self, stream: str, lines: list[str]) -> None:
        import ray

        ray.get(self._outbox.put.remote(self.rank, stream, lines))

    def run(self, payload: tuple[Callable[..., Any], Sequence[Any], dict[str, Any]]) -> tuple[Any, ...]:
        """``fn(*args, **kwargs)``: ``("result", value)``, or ``("error",
        traceback, when, None)`` where it raised (the launcher reports it,
        once)."""
        fn, args, kwargs = payload
        capture = _Capture(self._sink)
        try:
            return ("result", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the launcher
            return ("error", failure_text(exc, skip_frames=1), time.time(), None)
        finally:
            capture.close()

    def run_script(self, command: Sequence[str], cwd: str | None) -> tuple[Any, ...]:
        """``python *command`` in this process: ``("result", None)``, or
        ``("error", traceback, when, exit code)``. Its traceback is also
        written to its stderr, where the ``[rankN]:`` lines show it."""
        capture = _Capture(self._sink)
        try:
            if cwd is not None:
                os.chdir(cwd)
            run_program(list(command))
            return ("result", None)
        except SystemExit as exc:
            code = exit_code_of(exc.code)  # a message goes to stderr, and gives 1
            return ("result", None) if code == 0 else ("error", None, time.time(), code)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the launcher
            text = failure_text(exc, skip_frames=1)
            sys.stderr.write(text)
            return ("error", text, time.time(), 1)
        finally:
            capture.close()

    def close(self) -> None:
        """Tear down the strategies this warm rank kept (their groups)."""
        from phalanx_core import teardown_kept_ranks

        teardown_kept_ranks()
