"""The Launcher interface: how a job's processes come to exist."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from .environment import ClusterEnvironment

__all__ = ["Launcher"]

T = TypeVar("T")


class Launcher(ABC):
    """Makes the job's processes and runs a function in each.

    Constructed by the registry as ``Launcher(environment=...,
    num_processes=..., num_nodes=..., **spec_options)``: ``num_processes`` is
    the number of ranks on this node (one per device), ``num_nodes`` the
    number of nodes.

    **The launch contract.** :meth:`launch` runs ``fn(*args, **kwargs)``
    once per rank and returns, in the calling process, a list of every
    rank's return value indexed by global rank. Return values cross process
    boundaries by pickling; a launcher that cannot carry them (a launcher
    that re-runs a script on other nodes) says in its docstring what it
    returns instead. Where the launcher does not create processes
    (``in_process``, under torchrun or srun), it returns ``[fn(...)]``: this
    rank's value alone.

    **The failure contract.** When any rank fails (raises, exits non-zero,
    or is killed), every other rank is stopped within seconds, no process of
    the job is left behind, and the caller gets
    :class:`~phalanx_core.WorkerFailedError` naming the first rank that
    failed, its exit code or signal, and its traceback. A launcher that
    does not create processes lets the exception of ``fn`` through
    unchanged, since nothing else needs stopping.

    A launcher that cannot see how a rank's process ended (a Ray actor's
    exit status is its raylet's, not the launching process's) names the
    rank and its node, and says so, with ``exitcode`` and ``signal``
    ``None``.

    **Warm ranks.** A launcher whose ranks outlive one launch (``ray`` with
    ``keep_alive=True``) sets :attr:`keeps_ranks`: each rank is then set up
    at its first launch and stays set up, its group included, and every
    later launch of the same strategy runs on that same strategy object
    (:attr:`Strategy.rank_state <phalanx_core.Strategy.rank_state>` holds
    what a rank keeps). :meth:`teardown`, which ``strategy.teardown()``
    calls in the launching process, ends them; in a warm rank,
    ``phalanx_core.teardown_kept_ranks()`` tears the kept strategies down.

    Callers never check a launcher's type: everything that differs between
    launchers is behind :meth:`launch` and :attr:`is_interactive_compatible`.
    A launcher whose constructor takes ``accelerator`` gets the strategy's
    accelerator from the registry (to ask a cluster for the right devices).

    Attributes:
        is_interactive_compatible: works in a notebook or REPL (it does not
            re-run ``__main__``).
        creates_processes: makes processes (``False`` for ``in_process``).
        keeps_ranks: its ranks stay up between launches (see above).
    """

    is_interactive_compatible: ClassVar[bool] = False
    creates_processes: ClassVar[bool] = True
    keeps_ranks: bool = False

    def __init__(
        self,
        *,
        environment: ClusterEnvironment | None = None,
        num_processes: int = 1,
        num_nodes: int = 1,
    ) -> None:
        self.environment = environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        """Where the sockets of a job this launcher starts listen, in a few
        words, for ``phalanx explain`` (the rendezvous store, the ranks'
        own connections); ``None`` when the launcher does not say."""
        return None

    def listening(self) -> str | None:
        """Where the sockets of the job this launcher (as built, with its
        options) starts listen: :meth:`listens` by default. A launcher
        whose options change it (a rendezvous elsewhere) says so here."""
        return type(self).listens(self.num_nodes)

    def explain(self) -> dict[str, str]:
        """What ``phalanx explain`` says of the job this launcher starts,
        past its parts and where it listens: a label (one word, at most 12
        characters) for each line. Nothing by default."""
        return {}

    @classmethod
    def runs_in_existing_processes(cls, environment: type[ClusterEnvironment]) -> bool:
        """Whether this launcher can be used where ``environment`` (a class
        whose ``creates_processes_externally`` is true) already started one
        process per rank, by running ``fn`` in place. The registry refuses
        a launcher named by the user there unless this says yes. The default:
        only a launcher that creates no processes. A launcher that re-runs
        the script says yes inside its own ranks, where it runs there."""
        return not cls.creates_processes

    @classmethod
    def runs_per_node(cls, environment: type[ClusterEnvironment]) -> bool:
        """Whether this launcher runs once per node where ``environment``
        (a class whose ``creates_processes_externally`` is true) started
        one process per node, and starts that node's ranks itself, as
        torchrun does under ``srun --ntasks-per-node=1``. The registry then
        keeps this launcher there (instead of ``in_process``), checks that
        the scheduler started one process on each of ``num_nodes`` nodes,
        and hands it that environment, from which it reads its node rank
        and node 0's address. The default: never."""
        return False

    @classmethod
    def started_this_process(cls) -> bool:
        """Whether this process is a rank that this launcher started (its own
        rank variables say so). The script resolves its flags again in the
        rank, where the launcher is ``in_process``; the options given for
        this launcher (``max_restarts``) were taken by it in the launching
        process, and the registry accepts them there without a part to take
        them. Under another launcher (torchrun) they are refused, saying to
        give them to what started the processes. The default: never."""
        return False

    def runs_in_place(self) -> bool:
        """Whether this process is already one rank of the job (started by
        ``phalanx run``, torchrun, srun, mpirun, or this launcher's own
        re-run of the script), where :meth:`launch` runs ``fn`` here.
        ``strategy.launch()`` with no function sets the rank up where this
        is true, and otherwise starts the ranks with :meth:`run_script`.
        The default: a launcher that creates no processes always runs in
        place, one that does never."""
        return not self.creates_processes

    @abstractmethod
    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the list of
        every rank's result, indexed by global rank (see the class's
        contracts). Raises :class:`~phalanx_core.WorkerFailedError` when a
        rank fails.

        Where ``fn`` runs in place, in one rank of a job that something
        else started (torchrun, srun, mpirun, ``phalanx run``), the list is
        still indexed by global rank: this rank's result at its rank, and
        ``None`` at the other ranks', whose results are in their own
        processes (:meth:`placed`)."""

    def placed(self, result: T) -> list[T | None]:
        """The list :meth:`launch` returns where ``fn`` ran in place: ``result``
        at this rank's global rank (the environment's), ``None`` elsewhere."""
        rank, size = 0, 1
        if self.environment is not None:
            rank, size = self.environment.global_rank, self.environment.world_size
        values: list[T | None] = [None] * max(size, rank + 1)
        values[rank] = result
        return values

    def teardown(self) -> None:  # noqa: B027 - optional hook, nothing kept by default
        """Release what this launcher keeps between launches (warm ranks,
        a cluster connection); called by ``strategy.teardown()``. Safe to
        call more than once, and in a rank, where there is nothing to
        release."""

    def run_script(self, command: Sequence[str]) -> None:
        """Run a Python program as every rank's main program, which is what
        ``phalanx run`` does: ``command`` is what follows ``python`` (a
        script's path or ``-m module``, then its arguments).

        A launcher that creates processes starts one per rank, prefixes
        each output line with its rank where it can, and raises
        :class:`~phalanx_core.WorkerFailedError` as :meth:`launch` does; one
        that does not runs the program in this process. The base says that
        this launcher cannot run programs.
        """
        from .errors import UnavailableError

        raise UnavailableError(
            f"launcher {type(self).__name__} runs functions (launch), not scripts, so `phalanx run` "
            "cannot use it; choose another launcher with --launcher, or call strategy.launch(fn) "
            "from your own script"
        )
