"""The ``ray`` launcher: one Ray actor per rank, placed in a placement group.

**Where the ranks run.** With ``address=`` (a Ray address, ``"auto"``, or
``RAY_ADDRESS`` set) the launcher joins that cluster and never stops it;
in a process that already called ``ray.init()``, it uses that instance;
otherwise it starts a local Ray instance for the job and stops it after.
The ranks are packed as the strategy says: one placement-group bundle per
node (``devices`` ranks, each with ``cpus_per_rank`` CPUs, and a GPU each
under ``accelerator="cuda"``), on as many distinct Ray nodes as
``num_nodes`` (``STRICT_SPREAD``). A group the cluster can never hold is
refused at once, naming what was asked and what each node has; one whose
resources exist but are in use is waited for ``placement_timeout`` seconds.

**The rank protocol.** Every actor gets the variables the ``ray``
environment and torch's ``env://`` rendezvous read (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ``PHALANX_RAY_JOB``), and the launching
process's ``PHALANX_*`` variables (``phalanx run``'s flags). Rank 0's actor
hosts the rendezvous ``TCPStore`` on a port the kernel gives, on
``127.0.0.1`` for one node and on its node's address for several; the
ranks join it as clients (``TORCHELASTIC_USE_AGENT_STORE``). For one node,
gloo listens on the loopback interface too (``GLOO_SOCKET_IFNAME``, unless
it is set), and a local Ray instance the launcher starts has its node
address at ``127.0.0.1``, where Ray's own servers then listen. Under
``cuda``, the actors of a node see every GPU the node's ranks were given
(``CUDA_VISIBLE_DEVICES``), local rank *i* the *i*-th, as torchrun's do.

**Output.** What a rank writes to its stdout and stderr (its file
descriptors: native code's lines too) is printed by the launching process,
each line prefixed ``[rankN]:``, before ``launch`` returns.

**The failure contract.** The first rank that raises, or whose actor dies,
ends the job: every actor is killed at once (``ray.kill``, which does not
wait on a method still running), the placement group removed, and
:func:`phalanx_core.launching.worker_failed` names the rank that failed
first (:func:`~phalanx_core.launching.root_cause`), its node and its host,
with its traceback, keeping every failure seen in ``.failures``. A dead
actor's exit code cannot be seen from here (its raylet reaps it), so
``exitcode`` and ``signal`` are ``None`` then. Ctrl-C in the launching
process does the same, then raises ``KeyboardInterrupt``.

**Warm ranks.** With ``keep_alive=True`` the actors, their process group
and the strategy each rank set up stay between launches of the same
strategy: a notebook cell launches again in milliseconds, and what a rank
put in ``strategy.rank_state`` is there. ``strategy.teardown()`` (or the
interpreter's exit) ends them.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError, UnavailableError, WorkerFailedError
from phalanx_core.launching import (
    CAUSE_GRACE,
    LOOPBACK,
    RESTART_COUNT_VAR,
    RankFailure,
    carried_variables,
    check_count,
    listen_variables,
    rank_variables,
    worker_failed,
)

from .environment import JOB_VAR, NODES_VAR, in_rank

if TYPE_CHECKING:
    from phalanx_core import Accelerator, ClusterEnvironment

__all__ = ["RayCluster", "RayLauncher"]

T = TypeVar("T")

#: Seconds a warm rank has to tear its strategy down before it is killed.
CLOSE_GRACE = 5.0
_TAG = "launcher 'ray'"


class RayLauncher(Launcher):
    """Starts one Ray actor per rank and runs ``fn`` in each; returns every
    rank's result, indexed by global rank (see the module's docstring).

    Options:
        address: the Ray cluster to join (``"auto"``, ``"host:6379"``,
            ``"ray://host:10001"``); default ``RAY_ADDRESS``, else a local
            Ray instance started for the job.
        keep_alive: keep the actors and their group up between launches.
        cpus_per_rank: CPUs Ray reserves for each rank (1).
        runtime_env: Ray's runtime environment for the actors (``pip``,
            ``env_vars``, ``working_dir``); ``phalanx run`` ships the working
            directory to a cluster it joined, unless this names one.
        placement_timeout: seconds to wait for resources that the cluster
            has but that are in use (60).
        max_restarts: how many times a failed job (a rank that raised, an
            actor killed, a node lost) is started again: every actor is
            killed and new ones are placed on what the cluster has then
            (default 0). ``strategy.restart_count`` tells the ranks.
    """

    is_interactive_compatible: ClassVar[bool] = True

    def __init__(
        self,
        *,
        environment: ClusterEnvironment | None = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        accelerator: Accelerator | None = None,
        address: str | None = None,
        keep_alive: bool = False,
        cpus_per_rank: float = 1,
        runtime_env: dict[str, Any] | None = None,
        placement_timeout: float = 60.0,
        max_restarts: int = 0,
    ) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        check_count("ray", "num_processes", num_processes)
        check_count("ray", "num_nodes", num_nodes)
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise MisconfigurationError(
                f"{_TAG}: address={address!r}; give a Ray address ('auto', 'host:6379', "
                "'ray://host:10001'), or none for a local Ray instance"
            )
        if not isinstance(keep_alive, bool):
            raise MisconfigurationError(f"{_TAG}: keep_alive={keep_alive!r}; expected True or False")
        if (
            isinstance(cpus_per_rank, bool)
            or not isinstance(cpus_per_rank, (int, float))
            or cpus_per_rank < 0
        ):
            raise MisconfigurationError(f"{_TAG}: cpus_per_rank={cpus_per_rank!r}; expected a number >= 0")
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise MisconfigurationError(
                f"{_TAG}: runtime_env={runtime_env!r}; expected a dict of Ray's runtime environment "
                "(e.g. {'pip': [...], 'env_vars': {...}})"
            )
        if (
            isinstance(placement_timeout, bool)
            or not isinstance(placement_timeout, (int, float))
            or placement_timeout <= 0
        ):
            raise MisconfigurationError(
                f"{_TAG}: placement_timeout={placement_timeout!r}; expected seconds, more than 0"
            )
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise MisconfigurationError(
                f"{_TAG}: max_restarts={max_restarts!r}; expected an int of at least 0"
            )
        device = getattr(accelerator, "name", "cpu")
        if device not in ("cpu", "cuda"):
            raise MisconfigurationError(
                f"{_TAG} asks Ray for CPUs or GPUs for each rank, and accelerator {device!r} is neither; "
                "use accelerator='cpu' or 'cuda' with it, or another launcher"
            )
        self.device = device
        self.address = address
        self.keep_alive = keep_alive
        self.keeps_ranks = keep_alive
        self.cpus_per_rank = float(cpus_per_rank)
        self.runtime_env = dict(runtime_env or {})
        self.placement_timeout = float(placement_timeout)
        self.max_restarts = max_restarts
        self._job: _Job | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_job"] = None  # the actors belong to the launching process
        return state

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        if num_nodes == 1:
            return (
                "127.0.0.1 only: rank 0's actor hosts the rendezvous store, and every rank's gloo (and "
                "Ray's own servers, in a local Ray instance the launcher starts)"
            )
        return (
            "rank 0's actor hosts the rendezvous store on its node's address; every rank's gloo "
            "listens on the interface that reaches it"
        )

    @classmethod
    def runs_in_existing_processes(cls, environment: type[ClusterEnvironment]) -> bool:
        """Yes in its own ranks (a script it runs resolves there)."""
        return in_rank()

    def runs_in_place(self) -> bool:
        return in_rank()

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        if self.runs_in_place():  # a rank of a script this launcher runs: here
            return self.placed(fn(*args, **kwargs))  # type: ignore[return-value]
        restart = 0
        while True:
            job = self._job if self._job is not None else _Job(self, script=False, restart=restart)
            try:
                results = job.run("run", job.put((fn, args, kwargs)))
                break
            except WorkerFailedError as exc:
                self._job = None
                job.close()
                if restart >= self.max_restarts:
                    raise
                restart += 1
                _say_restart(exc, restart, self.max_restarts)
            except BaseException:
                self._job = None
                job.close()
                raise
        if not self.keep_alive:
            job.close()
        elif self._job is None:
            self._job = job
            atexit.register(self.teardown)
        return results

    def run_script(self, command: Sequence[str]) -> None:
        """Run the program as every rank's main program, one actor each.
        On a cluster it joined, the working directory goes with it as Ray's
        ``working_dir`` (the script must be inside it); on a local instance
        the actors run in this directory."""
        if not command:
            raise MisconfigurationError("phalanx run: name the script to run (or -m module)")
        for restart in range(self.max_restarts + 1):
            job = _Job(self, script=True, restart=restart)
            try:
                job.run("run_script", job.command(list(command)), job.cwd)
                return
            except WorkerFailedError as exc:
                if restart >= self.max_restarts:
                    raise
                _say_restart(exc, restart + 1, self.max_restarts)
            finally:
                job.close()

    def teardown(self) -> None:
        """End the warm ranks (``keep_alive``) and what their job holds."""
        job, self._job = self._job, None
        if job is not None:
            with contextlib.suppress(Exception):
                atexit.unregister(self.teardown)
            job.close()


# -- one job: its cluster, placement group and actors -----------------------------------


class RayCluster:
    """The Ray instance of one job: one this process had joined already,
    one at ``address``, or a local one started for the job, for ``cpus``
    CPUs (a local one has at least that many). An instance a
    ``RayCluster`` started or joined is shut down (left, for a cluster)
    when the last job using it calls :meth:`close`: two warm jobs of one
    notebook share it. Public for other launchers that run on Ray
    (phalanx-torchft's replica groups): one Ray instance per process,
    whoever starts the job."""

    #: Jobs now using the instance a launcher here started or joined, and
    #: whether that is a local instance it started.
    _users = 0
    _ours = False
    _local = False
    _address: str | None = None

    def __init__(self, address: str | None, cpus: float, runtime_env: dict[str, Any] | None = None) -> None:
        import ray

        self.closed = False
        self.started = RayCluster._ours and RayCluster._local
        if ray.is_initialized():
            joined = RayCluster._address if RayCluster._ours else "the Ray instance ray.init() gave"
            if address is not None and (not RayCluster._ours or address != RayCluster._address):
                raise MisconfigurationError(
                    f"{_TAG}: address={address!r}, but this process is already joined to {joined} "
                    "(one Ray instance per process); drop address= to run there, or end what uses "
                    "it first (strategy.teardown() of a warm job, or ray.shutdown())"
                )
            if RayCluster._ours:
                RayCluster._users += 1
            else:
                self.closed = True  # the user's own: never shut down here
            return
        address = address or os.environ.get("RAY_ADDRESS") or None
        options: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if address is not None:
            _answers(address)
            try:
                ray.init(address=address, runtime_env=runtime_env or None, **options)
            except ConnectionError as exc:
                raise UnavailableError(
                    f"{_TAG}: the Ray cluster at address={address!r} did not let this process join "
                    f"({_first_lines(str(exc), 2)}). Where something listens there, this is often "
                    "token authentication (on by default in Ray 2.60): set RAY_AUTH_MODE=token (and the "
                    "cluster's token) before Python starts, as for every driver of that cluster; else "
                    "start a cluster (`ray start --head`), check the address, or give no address (and "
                    "unset RAY_ADDRESS) for a local Ray instance started for the job"
                ) from exc
        else:
            # The job's own instance: as many CPUs as its ranks reserve, as
            # spawn starts as many ranks as asked on any machine.
            with _on_loopback():
                ray.init(
                    address="local",
                    num_cpus=max(os.cpu_count() or 1, math.ceil(cpus)),
                    include_dashboard=False,
                    **options,
                )
        #: Whether this job's instance is a local one a launcher started.
        self.started = RayCluster._local = address is None
        RayCluster._ours = True
        RayCluster._users = 1
        RayCluster._address = address or "a local Ray instance started for a job"

    def close(self) -> None:
        import ray

        if self.closed:
            return
        self.closed = True
        RayCluster._users -= 1
        if RayCluster._users <= 0:
            RayCluster._ours = False
            ray.shutdown()  # stops a local instance; only leaves a cluster joined


def _say_restart(failure: WorkerFailedError, restart: int, max_restarts: int) -> None:
    """Say on stderr which rank failed and that every rank starts again, in
    a new placement group on what the cluster has now."""
    first = failure.failures[0] if failure.failures else None
    if failure.signal:
        how = f"killed by {failure.signal}"
    elif first is not None and first.died:
        how = "its actor's process died: killed, or crashed"
    else:
        how = f"exit code {failure.exitcode}"
    last = (failure.traceback or "").strip().splitlines()[-1:]
    sys.stderr.write(
        f"{_TAG}: rank {failure.rank} failed ({how}{': ' + last[0] if last else ''}); every rank is stopped "
        f"and started again, placed anew (restart {restart} of {max_restarts})\n"
    )
    sys.stderr.flush()


class _Job:
    def __init__(self, launcher: RayLauncher, *, script: bool, restart: int = 0) -> None:
        import ray

        self.restart = restart
        self.launcher = launcher
        self.id = uuid.uuid4().hex
        self.size = launcher.num_processes * launcher.num_nodes
        self.actors: list[Any] = []
        self.nodes: list[dict[str, Any]] = []
        self.pg: Any = None
        self.outbox: Any = None
        self.cwd: str | None = None
        per_rank = launcher.cpus_per_rank
        runtime_env = dict(launcher.runtime_env)
        joins = not ray.is_initialized() and bool(launcher.address or os.environ.get("RAY_ADDRESS"))
        if script and joins:
            runtime_env.setdefault("working_dir", os.getcwd())
        self.working_dir = runtime_env.get("working_dir")
        # A copy: ray.init rewrites a local working_dir to the URI it uploaded.
        self.cluster = RayCluster(
            launcher.address, per_rank * self.size, dict(runtime_env) if joins else None
        )
        try:
            if script and self.cluster.started:
                self.cwd = os.getcwd()
            if joins:
                runtime_env = {}  # the job's, given to ray.init
            self.pg = self._place()
            from ray.util.scheduling_strategies import (
                NodeAffinitySchedulingStrategy,
                PlacementGroupSchedulingStrategy,
            )

            from ._actor import Outbox, Rank

            # On the launching process's own node, strictly: it lives as
            # long as the job can, and a lost node takes no output with it.
            # Placed by Ray (or with a soft affinity, which Ray may pass
            # over), it could land on a rank's node, or, after a restart, on
            # a node just lost that Ray had not marked dead yet: the
            # restarted ranks' output then went nowhere.
            here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
            outbox = ray.remote(Outbox).options(num_cpus=0, max_restarts=0, scheduling_strategy=here)
            self.outbox = outbox.remote()
            rank_actor = ray.remote(Rank)

            made: list[tuple[int, Any]] = []
            for node in range(launcher.num_nodes):
                for _ in range(launcher.num_processes):
                    options: dict[str, Any] = {
                        "num_cpus": per_rank,
                        "num_gpus": 1 if launcher.device == "cuda" else 0,
                        "max_restarts": 0,
                        "max_task_retries": 0,
                        "scheduling_strategy": PlacementGroupSchedulingStrategy(
                            placement_group=self.pg, placement_group_bundle_index=node
                        ),
                    }
                    if runtime_env:
                        options["runtime_env"] = runtime_env
                    made.append((node, rank_actor.options(**options).remote(self.outbox, self.id)))
            infos = self._get([actor.describe.remote() for _, actor in made], "start the ranks' actors")
            self._number(made, infos)
            self._rendezvous()
        except BaseException:
            self.close()
            raise

    # -- setting up ------------------------------------------------------------------

    def _bundle(self) -> dict[str, float]:
        launcher = self.launcher
        bundle = {"CPU": launcher.cpus_per_rank * launcher.num_processes}
        if launcher.device == "cuda":
            bundle["GPU"] = float(launcher.num_processes)
        return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}

    def _place(self) -> Any:
        """A placement group of one bundle per node, on distinct nodes;
        refused at once where the cluster can never hold it."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        launcher = self.launcher
        bundle = self._bundle()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        fits = [n for n in nodes if all(n.get("Resources", {}).get(k, 0) >= v for k, v in bundle.items())]
        asked = (
            f"{launcher.num_nodes} node(s) with {_resources(bundle)} each ({launcher.num_processes} rank(s) "
            f"per node, {launcher.cpus_per_rank:g} CPU{' and 1 GPU' if launcher.device == 'cuda' else ''} "
            "per rank)"
        )
        if len(fits) < launcher.num_nodes:
            have = "; ".join(_describe_node(n) for n in nodes) or "none alive"
            raise UnavailableError(
                f"{_TAG}: the job asks for {asked}, and the Ray cluster can never hold it: "
                f"{len(fits)} of its {len(nodes)} node(s) could ({have}). Ask for fewer ranks per "
                "node (devices=), fewer nodes (num_nodes=) or fewer CPUs per rank (cpus_per_rank=), "
                "or add nodes to the cluster"
            )
        pg = placement_group(
            [bundle] * launcher.num_nodes, strategy="STRICT_SPREAD" if launcher.num_nodes > 1 else "PACK"
        )
        done, _ = ray.wait([pg.ready()], timeout=launcher.placement_timeout)
        if not done:
            remove_placement_group(pg)
            free = _resources({k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")})
            raise UnavailableError(
                f"{_TAG}: the job asks for {asked}; the cluster has such nodes, but after "
                f"{launcher.placement_timeout:g} s their resources are still in use (free now, over the "
                f"whole cluster: {free}). Wait for other jobs to end, or raise placement_timeout="
            )
        return pg

    def _number(self, made: list[tuple[int, Any]], infos: list[dict[str, Any]]) -> None:
        """Global ranks: node by node; within a node, by GPU (so that local
        rank i uses the i-th GPU the node's actors were given)."""
        by_node: dict[int, list[tuple[dict[str, Any], Any]]] = {}
        for (node, actor), info in zip(made, infos, strict=True):
            by_node.setdefault(node, []).append((info, actor))
        for node in sorted(by_node):
            members = sorted(by_node[node], key=lambda pair: [_gpu_key(g) for g in pair[0]["gpus"]])
            for info, actor in members:
                self.actors.append(actor)
                self.nodes.append({**info, "node": node})

    def _rendezvous(self) -> None:
        launcher = self.launcher
        main = LOOPBACK if launcher.num_nodes == 1 else self.nodes[0]["address"]
        port = self._get([self.actors[0].host_store.remote(main)], "host the rendezvous store")[0]
        # The user's PHALANX_* settings; never the variables of the launch
        # that made this process a rank (PHALANX_LAUNCH_*): Ray's actors are
        # ranks of this launch, not of that one.
        carried = carried_variables()
        common = {
            **carried,
            JOB_VAR: self.id,
            NODES_VAR: str(launcher.num_nodes),
            RESTART_COUNT_VAR: str(self.restart),
        }
        if launcher.num_nodes == 1:
            # Every rank on one node: gloo on loopback, as the store, unless
            # the user chose its interface (here; a local instance's actors
            # inherit this process's variables).
            common.update(listen_variables(LOOPBACK))
        gpus: dict[int, list[str]] = {}
        for info in self.nodes:
            gpus.setdefault(info["node"], []).extend(info["gpus"])
        calls = []
        for rank, (actor, info) in enumerate(zip(self.actors, self.nodes, strict=True)):
            node = info["node"]
            variables = {
                **common,
                **rank_variables(
                    rank=rank,
                    world_size=self.size,
                    local_rank=rank - node * launcher.num_processes,
                    local_world_size=launcher.num_processes,
                    node_rank=node,
                    main_address=main,
                    main_port=port,
                    agent_store=True,
                ),
            }
            if gpus[node]:
                variables["CUDA_VISIBLE_DEVICES"] = ",".join(sorted(gpus[node], key=_gpu_key))
            calls.append(actor.set_variables.remote(rank, variables))
        self._get(calls, "set up the ranks")

    def _get(self, refs: list[Any], doing: str) -> list[Any]:
        """``ray.get`` of set-up calls, bounded; a failure says what failed."""
        import ray

        try:
            return list(ray.get(refs, timeout=max(self.launcher.placement_timeout, 60.0)))
        except ray.exceptions.GetTimeoutError:
            raise UnavailableError(
                f"{_TAG}: could not {doing} within {max(self.launcher.placement_timeout, 60.0):g} s; "
                "the cluster is overloaded, or a runtime_env takes long to build (raise "
                "placement_timeout=)"
            ) from None
        except ray.exceptions.RuntimeEnvSetupError as exc:
            raise UnavailableError(
                f"{_TAG}: Ray could not set up the runtime environment of the ranks' actors "
                f"(runtime_env={self.launcher.runtime_env!r}): {_first_lines(str(exc))}"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise UnavailableError(
                f"{_TAG}: a rank's actor died while the job started: {_first_lines(str(exc))}"
            ) from None

    def put(self, payload: Any) -> Any:
        """The function and its arguments, once, in Ray's object store."""
        import ray

        try:
            return ray.put(payload)
        except Exception as exc:
            fn = getattr(payload[0], "__qualname__", payload[0]) if isinstance(payload, tuple) else payload
            raise MisconfigurationError(
                f"{_TAG} sends fn and its arguments to every rank's actor by pickling them "
                f"(cloudpickle), and {fn!r} or an argument cannot be pickled ({type(exc).__name__}: "
                f"{exc}). Pass what can be pickled: build models, loaders and open files inside fn"
            ) from exc

    def command(self, command: list[str]) -> list[str]:
        """The script's path as the actors see it: relative to the working
        directory shipped to a cluster, which must hold it."""
        if command[0] == "-m" or self.working_dir is None:
            return command
        root = os.path.abspath(self.working_dir)
        script = os.path.abspath(command[0])
        if os.path.commonpath([root, script]) != root:
            raise MisconfigurationError(
                f"phalanx run --launcher ray: the script {command[0]!r} is outside the working "
                f"directory {root!r}, which is what goes to the cluster's nodes (Ray's working_dir); "
                "run it from a directory that holds it, or give runtime_env={'working_dir': ...}"
            )
        return [os.path.relpath(script, root), *command[1:]]

    # -- running -----------------------------------------------------------------------

    def run(self, method: str, *call: Any) -> list[Any]:
        """Call ``method`` on every rank's actor and wait for all of them,
        printing their output; the first failure ends the job."""
        import ray

        pending = {getattr(actor, method).remote(*call): rank for rank, actor in enumerate(self.actors)}
        results: dict[int, Any] = {}
        failures: list[RankFailure] = []
        settle: float | None = None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
            self.print_output()
            for ref in ready:
                rank = pending.pop(ref)
                failure = self._outcome(ray, ref, rank, results)
                if failure is not None:
                    failures.append(failure)
            if failures:
                # A rank that raises may make its peers fail with a lost
                # connection first: while every failure seen is such, wait
                # a moment for the cause.
                if not all(f.lost_a_peer for f in failures):
                    break
                settle = settle if settle is not None else time.monotonic() + CAUSE_GRACE
                if time.monotonic() >= settle:
                    break
        if failures:
            self.kill()
            raise worker_failed("ray", failures, self.size, stopped="Every other rank's actor was killed")
        self.print_output()
        return [results[rank] for rank in range(self.size)]

    def print_output(self) -> None:
        import ray

        if self.outbox is None:
            return
        with contextlib.suppress(ray.exceptions.RayError):
            for rank, stream, lines in ray.get(self.outbox.take.remote(), timeout=30):
                out = sys.stdout if stream == "out" else sys.stderr
                out.write("".join(f"[rank{rank}]: {line}\n" for line in lines))
                out.flush()

    def _outcome(self, ray: Any, ref: Any, rank: int, results: dict[int, Any]) -> RankFailure | None:
        """The result of ``rank``'s call, into ``results``; or its failure,
        with where it ran."""
        info = self.nodes[rank]
        node, host = info["node"], info["hostname"]
        try:
            message = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            says = _first_lines(str(exc)).rstrip(".")
            died = (
                f"Ray says: {says}. It was killed (SIGKILL from the out-of-memory killer, `ray.kill`, "
                "`ray stop`) or crashed in native code. Check the memory use on that node "
                f"({info['address']}), and its log: /tmp/ray/session_latest/logs/worker-*-{info['pid']}.err "
                "on that node"
            )
            return RankFailure(rank, when=time.time(), node=node, host=host, died=died)
        except ray.exceptions.RayError as exc:  # its result could not come back (unpicklable)
            text = f"its result could not be carried back: {_first_lines(str(exc))}\n"
            return RankFailure(rank, when=time.time(), node=node, host=host, traceback=text)
        if message[0] == "result":
            results[rank] = message[1]
            return None
        _, text, when, code = message
        return RankFailure(rank, exitcode=code, traceback=text, when=when, node=node, host=host)

    # -- ending --------------------------------------------------------------------------

    def kill(self) -> None:
        """Every actor at once (not waiting on a method still running), and
        the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in [*self.actors, self.outbox]:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        self.actors = []
        self.outbox = None
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None

    def close(self) -> None:
        """Warm ranks tear their strategies down (bounded), then every actor
        is killed and the cluster left (or stopped, if the job started it)."""
        import ray

        if self.launcher.keep_alive and self.actors:
            with contextlib.suppress(Exception):
                ray.wait(
                    [a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=CLOSE_GRACE
                )
        self.kill()
        self.cluster.close()


def _resources(bundle: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(bundle.items())) or "nothing"


def _describe_node(node: dict[str, Any]) -> str:
    have = {k: v for k, v in node.get("Resources", {}).items() if k in ("CPU", "GPU")}
    return f"{node.get('NodeManagerAddress', '?')}: {_resources(have)}"


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)


@contextlib.contextmanager
def _on_loopback() -> Iterator[None]:
    """While a local Ray instance starts: its node address ``127.0.0.1``,
    where Ray then puts its servers (GCS, raylet, every worker's and the
    driver's gRPC server, its agents), so that nothing of it can be reached
    from another machine. On Linux Ray gives a local instance the address
    of the route out instead (for nodes that may join it later), and turns
    a ``127.0.0.1`` given to it (``_node_ip_address``) into that address;
    it keeps ``127.0.0.1`` where clusters are off, as on macOS and Windows
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, read once, when ray is
    imported: so the flag it was read into is set here, and put back)."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # another Ray: its own choice
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _first_lines(text: str, count: int = 6) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:count])


def _answers(address: str) -> None:
    """Refuse at once an address where nothing accepts a connection
    (ray.init tries one for ~14 minutes)."""
    import socket

    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        raise UnavailableError(
            f"{_TAG}: no Ray cluster answers at address={address!r} (nothing accepts a connection "
            f"at {hostport}: {exc}). Start one (`ray start --head`), check the address, or give no "
            "address (and unset RAY_ADDRESS) for a local Ray instance started for the job"
        ) from None
