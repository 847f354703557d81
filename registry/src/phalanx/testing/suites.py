"""Conformance suites: the tests a part must pass to keep its contract.

Subclass a suite in your own test file (a class named ``Test...``), name
your part, and pytest runs every test of the suite on it::

    from phalanx.testing.suites import CollectiveSuite, LauncherSuite


    class TestMyCollective(CollectiveSuite):
        collective = "mine"  # or "my-dist:mine"


    class TestMyLauncher(LauncherSuite):
        launcher = "mine"

The suites run real jobs through :func:`phalanx.resolve` (so the part is
found by name, through its entry point, as users find it), with the
``phalanx`` registry and the plugins the job needs installed:

- :class:`CollectiveSuite`: the whole Collective contract
  (:mod:`phalanx_core.testing.contract`: every operation, dtypes, in-place
  results, reduce ops with integer mean, subgroups and what non-members get,
  object collectives, async handles, bad arguments), in worlds of 1 to 3
  ranks, and a timeout naming the operation. An operation the collective
  declares in ``unsupported`` is checked to refuse clearly, never skipped.
- :class:`TrafficSuite`: training under ``ddp``, ``fsdp`` and ``manual``
  with the collective named: the gradients (DDP's buckets, FSDP's
  reduce-scatters, a user's own DDP over ``strategy.process_group``) go
  through the collective's own operations, counted there, and the weights
  equal those of the same steps computed in one process (to 1e-6).
- :class:`LauncherSuite`: every rank's value by global rank, the failure
  contract (a rank that raises, a rank killed by SIGKILL: the caller gets
  :class:`~phalanx_core.WorkerFailedError` naming it), and no process left
  behind (:mod:`phalanx_core.testing.processes`).
- :class:`EnvironmentSuite`: detection under the scheduler's variables and
  not without them, ranks and rendezvous read from them, and the registry
  choosing it over the environments of lower priority.
- :class:`AcceleratorSuite`: availability with a reason, refusal where
  unavailable, device parsing and refusals of bad ``devices`` flags.

Each test is bounded in time (the launchers' timeouts, and ``hang_guard``
seconds of SIGALRM in the test process); a hang fails, it never blocks CI.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from phalanx_core.errors import (
    CollectiveTimeoutError,
    MisconfigurationError,
    UnavailableError,
    WorkerFailedError,
)
from phalanx_core.testing.contract import AFTER_RECONFIGURE, CHECKS, check_collective
from phalanx_core.testing.processes import TAG_VAR, new_tag, reap

__all__ = ["AcceleratorSuite", "CollectiveSuite", "EnvironmentSuite", "LauncherSuite", "TrafficSuite"]


class _HangGuard(BaseException):
    """Raised by SIGALRM in a test that ran past its guard."""


@contextlib.contextmanager
def _bounded(seconds: float) -> Iterator[None]:
    def interrupt(signum: int, frame: Any) -> None:
        raise _HangGuard(f"the test still ran after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    tag = new_tag()
    monkeypatch.setenv(TAG_VAR, tag)
    try:
        yield
    finally:
        left = reap(tag, grace=10, children_of=os.getpid())
        assert not left, f"processes left behind (killed now): {left}"


def _expected_checks(unsupported: frozenset[str]) -> list[str]:
    ran: list[str] = []
    for name, (_, operations) in CHECKS.items():
        refused = sorted(unsupported & set(operations))
        if refused:
            ran.extend(f"refuses:{op}" for op in refused if f"refuses:{op}" not in ran)
        else:
            ran.append(name)
    return ran


# -- functions the ranks run (importable, so the spawn launcher can send them) --


def run_contract(strategy: Any) -> tuple[int, int, list[str], list[str]]:
    """In every rank: the whole contract on the strategy's collective."""
    collective = strategy.collective
    ran = check_collective(collective, device=strategy.root_device)
    return collective.rank, collective.world_size, ran, sorted(collective.unsupported)


def run_timeout(strategy: Any, wait: float, done: str) -> str:
    """Rank 0 all-reduces alone and must get CollectiveTimeoutError naming
    the operation; the other ranks stay away until it has (it creates the
    file ``done``), at most ``wait`` seconds, then leave."""
    import torch

    if strategy.global_rank == 0:
        try:
            strategy.collective.all_reduce(torch.ones(1))
        except CollectiveTimeoutError as exc:
            return f"timeout:{exc.operation}"
        finally:
            Path(done).touch()
        return "completed"
    deadline = time.monotonic() + wait
    while not Path(done).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "away"


def rank_value(strategy: Any, base: int) -> tuple[int, int]:
    """Every rank's value, to check that results come back by global rank."""
    return strategy.global_rank, base + strategy.global_rank * 10


def raise_on_rank(strategy: Any, rank: int) -> None:
    """``rank`` raises; the others wait at a barrier for it."""
    if strategy.global_rank == rank:
        raise ValueError(f"raised on purpose in rank {rank}")
    strategy.barrier()


def listeners_of_job(strategy: Any, launching: int) -> list[tuple[int, str, int]]:
    """Once every rank's group is up: the TCP sockets that every process
    of the job listens on: this rank, the launching process (pid
    ``launching``) and everything below it (a launcher program such as
    ``mpirun``, its daemons, the other ranks)."""
    from phalanx_core.testing.processes import descendants, listening_sockets

    strategy.barrier()
    found = listening_sockets({os.getpid(), launching} | descendants(launching))
    strategy.barrier()  # the others are still up while this rank looks
    return found


def _store_for_the_ranks(strategy: Any) -> tuple[Any, str, int]:
    """A TCPStore served by rank 0 on a free port of 127.0.0.1, where the
    ranks' configurations meet; every rank gets its address."""
    import datetime

    import torch.distributed as dist

    store = None
    if strategy.global_rank == 0:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
        )
    port = strategy.broadcast_object(store.port if store is not None else None, src=0)
    return store, "127.0.0.1", int(port)


def run_reconfigure(strategy: Any, fresh: Any) -> list[str]:
    """In every rank: the ``reconfigure`` scenario
    (:func:`~phalanx_core.testing.contract.check_reconfigure`) on ``fresh``,
    a never set-up collective of the suite's kind."""
    from phalanx_core.testing.contract import check_reconfigure

    store, host, port = _store_for_the_ranks(strategy)
    try:
        return check_reconfigure(
            fresh,
            host=host,
            port=port,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            prefix="phalanx/suite",
        )
    finally:
        fresh.teardown()
        strategy.barrier()  # rank 0's store serves until every rank is done
        del store


#: Seconds the peer-lost test's configurations may take to form, and each
#: operation in them: generous, for a loaded machine (the error it checks
#: comes at once: the dead peer's sockets close).
_LIVE_WAIT = 60.0


def _live(rank: int, size: int, host: str, port: int, index: int) -> Any:
    from phalanx_core import Membership

    return Membership(
        rank=rank, world_size=size, host=host, port=port, prefix=f"phalanx/live/{index}", timeout=_LIVE_WAIT
    )


def _member_that_dies(fresh: Any, host: str, port: int, rank: int, size: int) -> None:
    """A member of the first configuration that is killed by SIGKILL
    while the others are in an operation with it."""
    import datetime

    import torch.distributed as dist

    # Up (its imports done) before the others form the group with it.
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))  # type: ignore[attr-defined]
    client.set("phalanx/live/ready", "1")
    fresh.reconfigure(_live(rank, size, host, port, 0))
    time.sleep(1.0)  # the others are in their all_reduce by now
    os.kill(os.getpid(), signal.SIGKILL)


def run_peer_lost(strategy: Any, fresh: Any) -> tuple[str, str, float, float]:
    """In every rank of two: a group of three with a third member that
    rank 0 starts and that is killed in an all_reduce; the error each rank
    gets (its type and operation) and the seconds it took; then, after
    ``abort()``, the two survivors reconfigured alone, and their sum."""
    import datetime
    import multiprocessing

    import torch
    import torch.distributed as dist

    store, host, port = _store_for_the_ranks(strategy)
    size, rank = strategy.world_size + 1, strategy.global_rank
    child = None
    if rank == 0:
        child = multiprocessing.get_context("spawn").Process(
            target=_member_that_dies, args=(fresh, host, port, size - 1, size), daemon=True
        )
        child.start()
    try:
        client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=120))  # type: ignore[attr-defined]
        client.wait(["phalanx/live/ready"])  # the third member's process is up
        fresh.reconfigure(_live(rank, size, host, port, 0))
        start = time.monotonic()
        error = ("completed", "", 0.0)
        try:
            fresh.all_reduce(torch.ones(1 << 16))
        except Exception as exc:  # noqa: BLE001 - what it is, is the result
            error = (type(exc).__name__, str(getattr(exc, "operation", "")), time.monotonic() - start)
        fresh.abort()
        fresh.reconfigure(_live(rank, size - 1, host, port, 1))
        total = fresh.all_reduce(torch.ones(1))
        return (*error, float(total.item()))
    finally:
        if child is not None:
            child.join(timeout=30)
        fresh.teardown()
        strategy.barrier()
        del store


def kill_on_rank(strategy: Any, rank: int) -> None:
    """``rank`` is killed by SIGKILL; the others wait at a barrier for it."""
    if strategy.global_rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    strategy.barrier()


# -- collectives -------------------------------------------------------------------


def _with_collective(suite: Any, strategy: str, devices: int, options: Mapping[str, Any]) -> Any:
    """``strategy`` resolved with the suite's collective (by name), its
    accelerator, launcher and options, and ``options``."""
    import phalanx

    if not suite.collective:
        raise pytest.UsageError(f"{type(suite).__name__}: set collective = '<its name>'")
    flags: dict[str, Any] = {**suite.options, **options}
    if suite.launcher:
        flags["launcher"] = suite.launcher
    return phalanx.resolve(
        strategy, accelerator=suite.accelerator, devices=devices, collective=suite.collective, **flags
    )


class CollectiveSuite:
    """The Collective contract for the collective named ``collective``.

    Attributes:
        collective: its name (required).
        strategy: the strategy that carries it (``"ddp"``: DDP over your
            collective).
        launcher: how the ranks are made (``"spawn"``).
        accelerator: ``"cpu"``; a GPU collective names its accelerator.
        world_sizes: the worlds to run the contract in.
        options: more keywords for :func:`phalanx.resolve` (a collective's
            own options).
        timeout: seconds of the collective's ``timeout`` in the timeout
            test; ``None`` for a collective that cannot time out an
            operation (say so in its docs).
        hang_guard: seconds after which a test counts as hung.
    """

    collective: ClassVar[str] = ""
    strategy: ClassVar[str] = "ddp"
    launcher: ClassVar[str | None] = "spawn"
    accelerator: ClassVar[str] = "cpu"
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2, 3)
    options: ClassVar[Mapping[str, Any]] = {}
    timeout: ClassVar[float | None] = 3.0
    hang_guard: ClassVar[float] = 180.0

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "world_size" in metafunc.fixturenames:
            metafunc.parametrize("world_size", self.world_sizes)

    def resolve(self, devices: int, **options: Any) -> Any:
        """The strategy the tests launch: your collective in it by name."""
        return _with_collective(self, self.strategy, devices, options)

    def test_the_contract(self, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch):
            results = self.resolve(world_size).launch(run_contract)
        assert [r[0] for r in results] == list(range(world_size)), results
        for rank, size, ran, unsupported in results:
            assert size == world_size, f"rank {rank}: world_size {size}, expected {world_size}"
            assert ran == _expected_checks(frozenset(unsupported)), f"rank {rank} ran {ran}"

    def test_an_operation_that_times_out_says_which(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        if self.timeout is None:
            pytest.skip(f"{type(self).__name__} declares timeout = None: the collective cannot time out")
        done = str(tmp_path / "timed-out")
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch):
            results = self.resolve(2, timeout=self.timeout).launch(run_timeout, self.timeout * 3, done)
        assert results[0] == "timeout:all_reduce", results

    # -- when peers come and go (the fault-tolerance capabilities) ---------------

    def fresh(self, **options: Any) -> Any:
        """A collective of the suite's kind and options that was never set
        up (what a strategy reconfigures: ``ddp_ft``'s across its groups)."""
        return self.resolve(1, **options).collective

    def test_reconfigure_as_declared(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Declared: three ranks reconfigure it twice in a row, then to
        every rank, all but one, every rank and the same ranks again, with
        the contract checked after each. Not declared: ``reconfigure()``
        refuses, naming the capability."""
        fresh = self.fresh()
        if "reconfigure" not in fresh.fault_tolerance:
            _refuses_capability(fresh, "reconfigure")
            return
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch):
            results = self.resolve(3).launch(run_reconfigure, fresh)
        checks = len(AFTER_RECONFIGURE)
        every = [
            f"every rank, at once again: {checks} checks",
            f"all but the last: {checks} checks",
            f"every rank, back: {checks} checks",
            f"the same members again: {checks} checks",
        ]
        assert results[:2] == [every, every], results
        assert results[2] == [every[0], "all but the last: sat out", *every[2:]], results

    def test_a_peer_killed_in_an_operation_is_named_within_the_timeout(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Declared ``liveness`` (and ``reconfigure``, to form the group
        with a member that dies): a third member killed by SIGKILL in an
        all_reduce; the two others raise CollectiveConnectionError or
        CollectiveTimeoutError naming the operation, within the
        configuration's timeout (60 s, for a loaded machine: a dead peer's
        error comes at once), then ``abort()`` and go on as a group of two.
        Not declared: ``abort()`` refuses, naming the capability."""
        fresh = self.fresh()
        if not {"liveness", "reconfigure"} <= fresh.fault_tolerance:
            if "liveness" not in fresh.fault_tolerance:
                _refuses_capability(fresh, "liveness")
            return
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch):
            results = self.resolve(2).launch(run_peer_lost, fresh)
        for kind, operation, seconds, total in results:
            assert kind in ("CollectiveConnectionError", "CollectiveTimeoutError"), results
            assert operation == "all_reduce", results
            assert seconds <= _LIVE_WAIT, results
            assert total == 2.0, results


def _refuses_capability(fresh: Any, capability: str) -> None:
    """A collective that does not declare ``capability`` refuses its
    method with UnavailableError naming it."""
    from phalanx_core import Membership

    call = {
        "reconfigure": lambda: fresh.reconfigure(
            Membership(rank=0, world_size=1, host="127.0.0.1", port=1, prefix="phalanx/refused")
        ),
        "liveness": fresh.abort,
    }[capability]
    with pytest.raises(UnavailableError) as refused:
        call()
    assert repr(capability) in str(refused.value), str(refused.value)


# -- training traffic --------------------------------------------------------------


class TrafficSuite:
    """Training traffic through the collective named ``collective``: DDP's
    gradient buckets, FSDP's all-gathers and reduce-scatters, and a user's
    own DDP under ``manual`` go through the collective's operations (the
    suite counts every call on the collective object in each rank), and the
    weights after a few SGD steps equal those of the same steps computed in
    one process, to 1e-6 (:mod:`phalanx_core.testing.traffic`).

    A collective that lists an operation a strategy's traffic needs in
    ``unsupported`` (``reduce_scatter`` for ``fsdp``) is refused when
    resolving that strategy, naming it: leave that strategy out of
    ``strategies``.

    Attributes:
        collective: its name (required).
        strategies: the strategies to train under.
        launcher: how the ranks are made (``"spawn"``).
        accelerator: ``"cpu"``.
        devices: ranks per job (2).
        options: more keywords for :func:`phalanx.resolve`.
        hang_guard: seconds after which a test counts as hung.
    """

    collective: ClassVar[str] = ""
    strategies: ClassVar[tuple[str, ...]] = ("ddp", "fsdp", "manual")
    launcher: ClassVar[str | None] = "spawn"
    accelerator: ClassVar[str] = "cpu"
    devices: ClassVar[int] = 2
    options: ClassVar[Mapping[str, Any]] = {}
    hang_guard: ClassVar[float] = 240.0

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "strategy_name" in metafunc.fixturenames:
            metafunc.parametrize("strategy_name", self.strategies)

    def resolve(self, strategy: str, **options: Any) -> Any:
        """The strategy the test launches: your collective in it by name."""
        return _with_collective(self, strategy, self.devices, options)

    def test_training_traffic_goes_through_it(
        self, strategy_name: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import torch

        from phalanx_core.testing.traffic import STEPS, run_traffic

        strategy = self.resolve(strategy_name)
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch):
            results = strategy.launch(run_traffic, strategy_name)
        assert [r["rank"] for r in results] == list(range(self.devices)), results
        for r in results:
            where = f"strategy {strategy_name!r}, collective {self.collective!r}, rank {r['rank']}"
            carried = sum(
                r["bytes"].get(op, 0) for op in ("all_reduce", "reduce_scatter", "reduce_scatter_into")
            )
            assert carried >= STEPS * r["gradient_bytes"], (
                f"{where}: {carried} bytes of reductions went through the collective in {STEPS} steps, "
                f"for {r['gradient_bytes']} bytes of gradients a step (calls: {r['calls']}; the strategy's "
                f"process group is a {r['process_group']}): the gradients took another path"
            )
            torch.testing.assert_close(
                torch.tensor(r["weights"]),
                torch.tensor(r["reference"]),
                rtol=0,
                atol=1e-6,
                msg=functools.partial("{}: {}".format, where),
            )


# -- launchers ---------------------------------------------------------------------


class LauncherSuite:
    """The launch and failure contracts for the launcher named ``launcher``,
    which must run functions (a launcher that re-runs a script needs a
    script to test it; see phalanx-torch's ``subprocess`` tests).

    Attributes:
        launcher: its name (required).
        strategy: the strategy it launches (``"ddp"``).
        accelerator: ``"cpu"``.
        num_processes: ranks per launch (2).
        options: more keywords for :func:`phalanx.resolve`.
        hang_guard: seconds after which a test counts as hung.
        listens: a one-node job opens a TCP socket somewhere (a rendezvous
            store, the collective's connections); ``False`` for one whose
            ranks talk without any (XLA's CPU replicas, threads of one
            process). Either way, nothing may listen beyond loopback.
        sees_exit_codes: the launching process can see how a rank's
            process ended (its exit code or signal). ``False`` for a
            launcher whose ranks are other programs' children (Ray actors,
            whose raylet reaps them): a rank killed by SIGKILL must then
            still be named, with its node, and said to have died without a
            traceback, with ``exitcode`` and ``signal`` ``None``.
        launches_functions_here: ``launch(fn)`` works from pytest's own
            process. ``False`` for a launcher that re-runs the calling
            script for a function too (phalanx-torch's ``subprocess``): it
            would re-run pytest, so only the script tests run here; test its
            ``launch(fn)`` from a script of your own.
    """

    launcher: ClassVar[str] = ""
    strategy: ClassVar[str] = "ddp"
    accelerator: ClassVar[str] = "cpu"
    num_processes: ClassVar[int] = 2
    options: ClassVar[Mapping[str, Any]] = {}
    hang_guard: ClassVar[float] = 180.0
    sees_exit_codes: ClassVar[bool] = True
    listens: ClassVar[bool] = True
    launches_functions_here: ClassVar[bool] = True

    def flags(self) -> dict[str, Any]:
        """The ``phalanx.resolve`` arguments of the strategy the tests
        launch (a script writes them out as they are)."""
        if not self.launcher:
            raise pytest.UsageError(f"{type(self).__name__}: set launcher = '<its name>'")
        return {
            "strategy": self.strategy,
            "accelerator": self.accelerator,
            "devices": self.num_processes,
            "launcher": self.launcher,
            **self.options,
        }

    def resolve(self) -> Any:
        """The strategy the tests launch, with your launcher by name."""
        import phalanx

        return phalanx.resolve(**self.flags())

    def _launch(self, fn: Any, *args: Any) -> Any:
        """``launch(fn, *args)`` from this process, where the launcher can."""
        if not self.launches_functions_here:
            pytest.skip(f"launcher {self.launcher!r} re-runs the calling script for launch(fn) too (pytest)")
        return self.resolve().launch(fn, *args)

    def test_every_rank_value_comes_back_by_global_rank(self, monkeypatch: pytest.MonkeyPatch) -> None:
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch):
            results = self._launch(rank_value, 7)
        assert results == [(r, 7 + r * 10) for r in range(self.num_processes)]

    def test_a_rank_that_raises_fails_the_job_with_its_traceback(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        last = self.num_processes - 1
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch), pytest.raises(WorkerFailedError) as info:
            self._launch(raise_on_rank, last)
        assert info.value.rank == last, info.value
        assert f"raised on purpose in rank {last}" in (info.value.traceback or ""), info.value
        self._reported_alike(info.value, last)
        assert f"Fix the error rank {last} raised, shown above." in str(info.value), info.value

    def test_a_rank_killed_by_sigkill_fails_the_job(self, monkeypatch: pytest.MonkeyPatch) -> None:
        last = self.num_processes - 1
        with _bounded(self.hang_guard), _no_leftovers(monkeypatch), pytest.raises(WorkerFailedError) as info:
            self._launch(kill_on_rank, last)
        assert info.value.rank == last, info.value
        self._reported_alike(info.value, last)
        if self.sees_exit_codes:
            assert (info.value.signal, info.value.exitcode) == ("SIGKILL", -9), info.value
            assert "killed by SIGKILL (exit code -9)." in str(info.value), info.value
            assert "out-of-memory killer" in str(info.value), info.value
        else:
            assert info.value.signal is None, info.value
            assert info.value.exitcode is None, info.value
            assert info.value.node is not None, info.value
            assert not info.value.traceback, info.value
            assert "without a Python traceback" in str(info.value), info.value

    def _reported_alike(self, error: WorkerFailedError, rank: int) -> None:
        """Every launcher reports a failure in one shape (it builds it with
        :func:`phalanx_core.launching.worker_failed`): the message's first
        line names the rank, the world and the launcher, and every failure
        seen is kept, the root cause first."""
        from phalanx_core.launching import RankFailure

        first_line = str(error).splitlines()[0]
        assert first_line.startswith(f"the launched job failed: rank {rank} of {self.num_processes}"), error
        assert " failed first, " in first_line, error
        assert error.failures, f"WorkerFailedError.failures is empty: {error}"
        assert all(isinstance(f, RankFailure) for f in error.failures), error.failures
        assert error.failures[0].rank == rank, error.failures

    def test_a_one_node_launch_listens_on_loopback_only(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Nothing of a one-node job can be reached from another machine:
        every TCP socket that the processes of the job (the launching
        process and every process below it: a launcher program, the ranks)
        listen on while the job runs (the rendezvous store, the collective's
        connections, the launcher program's own) is on a loopback address."""
        import ipaddress

        with _bounded(self.hang_guard), _no_leftovers(monkeypatch):
            found = self._launch(listeners_of_job, os.getpid())
        sockets = sorted({s for rank in found if rank for s in rank})
        if self.listens:
            assert sockets, "no listening socket seen (the rendezvous store listens somewhere)"
        wide = [
            (pid, address, port)
            for pid, address, port in sockets
            if not ipaddress.ip_address(address).is_loopback
        ]
        assert not wide, f"a one-node job listens beyond loopback: {wide} (pid, address, port)"

    def test_a_flat_script_launches_itself(self, tmp_path: Any) -> None:
        """``python flat.py`` whose script calls ``strategy.launch()`` with no
        function: where the launcher runs scripts, every rank runs the rest
        of the script and the first process exits 0 once they are done;
        where it cannot, a refusal that names the ways that work."""
        import re
        import sys

        from phalanx_core.launcher import Launcher
        from phalanx_core.testing.processes import run_tagged

        script = tmp_path / "flat.py"
        script.write_text(_FLAT_SCRIPT.format(flags=repr(self.flags())))
        done = run_tagged([sys.executable, str(script)], timeout=self.hang_guard, cwd=tmp_path)
        output = done.stdout + done.stderr
        if type(self.resolve().launcher).run_script is Launcher.run_script:
            assert done.returncode == 1, output
            assert "strategy.launch() with no function makes this process a rank" in output, output
            assert "strategy.launch(main)" in output, output
            assert "phalanx run" in output, output
            return
        assert done.returncode == 0, output
        seen = sorted(
            re.findall(r"^\[rank(\d+)\]: flat rank (\d+) of (\d+) saw (\[[\d, ]*\])$", done.stdout, re.M)
        )
        everyone = str(list(range(self.num_processes)))
        n = str(self.num_processes)
        assert seen == [(str(r), str(r), n, everyone) for r in range(self.num_processes)], output

    @pytest.mark.parametrize("how", ["raise", "sigkill"])
    def test_a_failing_rank_of_a_script_is_reported_alike(self, how: str, tmp_path: Any) -> None:
        """The failure checks above, for a launcher that re-runs a script
        (``python flat.py`` calling ``strategy.launch()``): the first process
        exits non-zero with the same report, the failing rank named first
        with its traceback or its signal, and nothing is left running (the
        other ranks were blocked in a barrier on the lost one)."""
        import re
        import sys

        from phalanx_core.launcher import Launcher
        from phalanx_core.testing.processes import run_tagged

        if type(self.resolve().launcher).run_script is Launcher.run_script:
            pytest.skip(f"launcher {self.launcher!r} runs no scripts (test_a_flat_script_launches_itself)")
        last = self.num_processes - 1
        script = tmp_path / "failing.py"
        script.write_text(_FAILING_SCRIPT.format(flags=repr(self.flags()), last=last, how=how))
        done = run_tagged([sys.executable, str(script)], timeout=self.hang_guard, cwd=tmp_path)
        output = done.stdout + done.stderr
        # The ranks' output is above, each line marked with its rank; the
        # launching process says once which rank failed first and exits 1.
        assert done.returncode == 1, output
        who = rf"strategy\.launch\(\): rank {last}( \(node \d+(, host [^)]*)?\))?"
        if how == "raise":
            said = who + rf" raised first; its traceback is in the lines above marked \[rank{last}\]"
        elif self.sees_exit_codes:
            said = who + " was killed by SIGKILL first"
        else:
            said = who + " died first, how could not be seen"
        assert re.search(said, output), output
        assert "The other ranks were stopped." in output, output
        marked = [line for line in output.splitlines() if line.startswith(f"[rank{last}]: ")]
        if how == "raise":
            assert any(f"raised on purpose in rank {last}" in line for line in marked), output
            assert any(line.startswith(f"[rank{last}]: Traceback") for line in marked), output


#: A flat script (no function to launch) for the launcher suite: the rest of
#: the script is each rank's program. Its line is written in two writes, the
#: first flushed (mpirun and horovodrun tag each write of a rank, and another
#: rank's write may come between the two): the launcher puts it back
#: together, marked with the rank.
_FLAT_SCRIPT = """\
import sys
import time

import phalanx

strategy = phalanx.resolve(**{flags})
strategy.launch()
ranks = strategy.all_gather_object(strategy.global_rank)
sys.stdout.write(f"flat rank {{strategy.global_rank}}")
sys.stdout.flush()
time.sleep(0.2)
sys.stdout.write(f" of {{strategy.world_size}} saw {{ranks}}\\n")
sys.stdout.flush()
"""


#: A flat script of which the last rank fails, raising or killed by SIGKILL,
#: while the others wait for it in a barrier.
_FAILING_SCRIPT = """\
import os
import signal

import phalanx

strategy = phalanx.resolve(**{flags})
strategy.launch()
strategy.barrier()
if strategy.global_rank == {last}:
    if {how!r} == "raise":
        raise ValueError("raised on purpose in rank {last}")
    os.kill(os.getpid(), signal.SIGKILL)
strategy.barrier()
"""


# -- environments ------------------------------------------------------------------


class EnvironmentSuite:
    """Detection and ranks of the environment named ``environment``.

    Attributes:
        environment: its name (required).
        variables: what its scheduler sets in one rank's environment.
        expected: what the environment must read from them: any of
            ``world_size``, ``global_rank``, ``local_rank``, ``node_rank``,
            ``main_address``, ``main_port``.
        cleared: prefixes of variables removed first (other schedulers', so
            that the test sees only ``variables``).
    """

    environment: ClassVar[str] = ""
    variables: ClassVar[Mapping[str, str]] = {}
    expected: ClassVar[Mapping[str, Any]] = {}
    cleared: ClassVar[tuple[str, ...]] = (
        "SLURM_",
        "TORCHELASTIC_",
        "OMPI_",
        "PMI_",
        "PMIX_",
        "LSB_",
        "JSM_",
        "HOROVOD_",
        "KUBEFLOW",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PHALANX_",
    )

    def _entry(self) -> Any:
        import phalanx

        if not self.environment or not self.variables:
            raise pytest.UsageError(
                f"{type(self).__name__}: set environment = '<name>' and variables = {{...}}"
            )
        return phalanx.Registry().get("environment", self.environment)

    def _clear(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in list(os.environ):
            if name.startswith(self.cleared):
                monkeypatch.delenv(name)

    def test_detected_under_its_variables_and_reads_them(self, monkeypatch: pytest.MonkeyPatch) -> None:
        entry = self._entry()
        self._clear(monkeypatch)
        for name, value in self.variables.items():
            monkeypatch.setenv(name, value)
        cls = entry.load()
        assert cls.detect(), f"{self.environment}: detect() is false under {dict(self.variables)}"
        environment = cls()
        got = {key: getattr(environment, key) for key in self.expected}
        assert got == dict(self.expected)
        assert 0 <= environment.global_rank < environment.world_size
        assert 0 <= environment.local_rank <= environment.global_rank
        # A scheduler numbers its nodes: the launcher takes the rank it gives.
        assert environment.node_rank_given is True, f"{self.environment}: node_rank_given is not True"

    def test_not_detected_without_them(self, monkeypatch: pytest.MonkeyPatch) -> None:
        entry = self._entry()
        self._clear(monkeypatch)
        assert not entry.load().detect(), f"{self.environment}: detect() is true with no scheduler variables"

    def test_the_registry_chooses_it_under_its_variables(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import phalanx

        self._entry()
        self._clear(monkeypatch)
        for name, value in self.variables.items():
            monkeypatch.setenv(name, value)
        plan = phalanx.Registry().plan("auto", accelerator="cpu", devices=1, launcher="in_process")
        assert plan.environment is not None
        assert plan.environment.name == self.environment, plan.explain()


# -- accelerators ------------------------------------------------------------------


class AcceleratorSuite:
    """Availability and devices of the accelerator named ``accelerator``.
    On a machine without its hardware the suite checks the refusal (with
    the reason); with it, the device parsing.

    Attributes:
        accelerator: its name (required).
    """

    accelerator: ClassVar[str] = ""

    def _class(self) -> Any:
        import phalanx

        if not self.accelerator:
            raise pytest.UsageError(f"{type(self).__name__}: set accelerator = '<its name>'")
        return phalanx.Registry().get("accelerator", self.accelerator).load()

    def test_availability_has_a_reason_and_is_kept(self) -> None:
        cls = self._class()
        availability = cls.availability()
        assert isinstance(availability.available, bool)
        if not availability.available:
            assert availability.reason, f"{self.accelerator}: unavailable without a reason"
            with pytest.raises(UnavailableError) as info:
                cls()
            assert availability.reason in str(info.value)
            assert self.accelerator in str(info.value)
            return
        accelerator = cls()
        assert cls.device_count() >= 1
        assert len(accelerator.parallel_devices(1)) == 1
        assert accelerator.parallel_devices("auto"), "devices='auto' gave no device"
        assert accelerator.get_device(0) is not None

    @pytest.mark.parametrize("devices", [0, -2, "x", [0, 0], 2.5])
    def test_bad_devices_are_refused(self, devices: Any) -> None:
        cls = self._class()
        if not cls.availability().available:
            with pytest.raises(UnavailableError):
                cls()
            return
        with pytest.raises(MisconfigurationError) as info:
            cls().parallel_devices(devices)
        assert repr(devices) in str(info.value) or str(devices) in str(info.value), info.value
