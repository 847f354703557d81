"""Rounds of nodes met by counters on the job's store: phalanx's own
rendezvous, the same whether node 0 hosts the store (``rendezvous="c10d"``)
or it is in etcd (where a node's place is given by the store's ``enter``,
ordered by etcd's revisions: etcd has no atomic add, and compare-and-swaps
on one key race).

Elastic's dynamic rendezvous keeps every node of a round, and its
heartbeat, in one pickled blob that each node rewrites with a
compare-and-set every keep-alive interval. Its writes collide more the more
nodes there are (``N / keep_alive x window``, the window growing with the
blob), until no round forms or the keep-alive that lets one form puts a
restart after a lost node at minutes (``bench/rendezvous_scale.py``; its
figures in bench/README.md). Here every request is a small one, and a node makes a fixed number
of them per round, whatever the number of nodes:

- a node joins round ``r`` with ``add("r/joined", 1)``; the number it gets
  is its place, and it writes the node rank it would like and its address
  under that place;
- the node whose place reaches ``min_nodes`` (or any after it) sets
  ``r/min``; every node waits for that key, then for ``last_call`` seconds
  for the round to close (a node looks at one key every 0.1 s, up to 1 s
  from 2,000 nodes: about 2,000 small reads a second at most, in all);
- the round closes with one ``compare_set`` of ``r/closed`` to the number of
  nodes it takes (the first writer wins, every node reads what it wrote): at
  once by the node whose place is ``max_nodes``, else by whichever node's
  last call ends first, with the count joined by then;
- the node in place 1 reads what the round's nodes wrote and gives them
  their node ranks, in the order of the ranks they would like, then of
  their addresses: a node would like its rank of the round before (so
  that the ranks stay where they were while the nodes do), and in its
  first round the ``node_rank`` it was started with; every other node
  reads its own rank (one ``get``);
- that node also writes the round's members (``r/members``: node rank,
  address and host name of each) and, from the members of the round met
  before, those that did not come back (``r/left``; one ``get`` for every
  node): a node lost with its host is named so, where its peers only saw
  a connection close;
- a node whose place is above that number came late: it joins ``r + 1``,
  and the nodes of round ``r`` see it there (``num_nodes_waiting``, one
  small read a second) and meet it in a new round, as with elastic;
- with the job's secret, a node waiting in round ``r + 1`` whose entry
  does not prove it is not counted by the nodes of round ``r``, which go
  on training; the first to read its entry marks its place refused
  (``r+1/refused/P``, and a count of such places, which round ``r + 1``
  takes in addition to ``max_nodes``), and that node ends;
- a node that stops waiting (its ``join_timeout`` passed) writes
  ``abandoned`` as the round's end if nobody closed it, so that a node
  arriving after it never forms a round with a node that has left.

There is no heartbeat: a lost node does not join the next round, which
closes without it after ``last_call`` (a node lost between joining a round
and its close is the one case this cannot see: the other nodes wait for
it as they exchange their ranks, up to the store's timeout, as they do
under elastic's dynamic rendezvous for a node lost once a round is
complete). A waiting node
looks at the store (``check`` of one key) rather than blocking in its
``wait``: a ``wait`` that times out makes c10d print two warning lines, and
a blocked client holds its connection. Imports torch only when a
rendezvous is made.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from . import job_keys
from .job_secret import NONE, SECRET_VAR, JobSecret, SecretRefused, Signed
from .job_store import read_when_set
from .ledger import StopRequested

if TYPE_CHECKING:
    pass

__all__ = ["CountedRounds"]

logger = logging.getLogger(__name__)

#: Seconds between a waiting node's looks at whether the job was closed.
JOB_CLOSED_EVERY = 1.0
#: Seconds ``num_nodes_waiting`` keeps what it read (the rank loop asks every
#: ``monitor_interval``, 0.1 s): one small read a second per node.
WAITING_CACHE = 1.0
#: The round's end written by a node that stopped waiting for it.
ABANDONED = "abandoned"
#: What a place whose node did not prove the job's secret is given for its rank.
REFUSED = "refused"


class CountedRounds:
    """The rounds of one node (see the module's text). The interface is the
    part of elastic's ``RendezvousHandler`` that
    :class:`~phalanx_torch._nodes.rounds` uses: ``next_rendezvous`` gives
    ``(store of the round, node rank, number of nodes, this node's address)``
    and raises elastic's ``RendezvousTimeoutError`` and
    ``RendezvousClosedError``."""

    def __init__(
        self,
        store: Any,  # torch's Store, and the etcd store's enter/entered (multi_set: outside torch's stubs)
        run_id: str,
        *,
        min_nodes: int,
        max_nodes: int,
        join_timeout: float,
        last_call: float,
        address: str | None = None,
        node_rank: int | None = None,
        by_entries: bool = False,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.min_nodes = int(min_nodes)
        self.max_nodes = int(max_nodes)
        self.join_timeout = float(join_timeout)
        self.last_call = float(last_call)
        self.address = address or socket.getfqdn()
        #: The node rank this node would like: the one it was started with,
        #: then the one it had in the round before.
        self.wanted = node_rank
        #: Places given by the store's ``enter`` (etcd's, ordered by its
        #: revisions), else by its ``add`` (node 0's store, atomic there).
        self.by_entries = by_entries
        #: The round this node is in (-1: none yet), and its place in the
        #: round it is joining or in.
        self.round = -1
        self.place = 0
        self._joining = -1
        #: The rounds this node joined while it waits to meet the others.
        self._visited: list[int] = []
        self._waiting: tuple[float, int] | None = None
        #: The members of the round met before this node's round that did
        #: not join it (node rank, address, host name), and that round.
        self.left: list[tuple[int, str, str]] = []
        self.previous = -1
        #: The nodes of this node's round that did not prove the job's
        #: secret, and got no rank (rank wanted or -1, address, host).
        self.refused: list[tuple[int, str, str]] = []
        #: The places of the round after this node's whose entries were
        #: read (whether each proved the job's secret), and that round.
        self._looked: dict[int, bool] = {}
        self._looked_round = -1
        #: Nodes waiting in the round after this node's that did not prove
        #: the job's secret, not counted and marked refused, for this node
        #: to name (those it marked first; taken by the rounds' handler).
        self.turned_away: list[tuple[int, str, str]] = []
        #: What this node's writes prove, and what it checks of the others'.
        self.secret = JobSecret(None)
        #: Set when this node is to stop waiting (the node watch read
        #: another node's failure): the wait raises ``StopRequested``.
        self.stop: threading.Event | None = None

    # -- keys (their names are job_keys') --------------------------------------

    def _enter(self, round_: int) -> int:
        """Join round ``round_``: this node's place in it (1 for the first)."""
        key = job_keys.joined(round_)
        return int(self.store.enter(key)) if self.by_entries else int(self.store.add(key, 1))

    def _joined(self, round_: int) -> int:
        """How many nodes joined round ``round_``."""
        key = job_keys.joined(round_)
        return int(self.store.entered(key)) if self.by_entries else int(self.store.add(key, 0))

    # -- a round ----------------------------------------------------------------

    def next_rendezvous(self) -> tuple[Any, int, int, str]:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError

        deadline = time.monotonic() + self.join_timeout
        store = self.store
        round_ = max(self.round + 1, int(store.add(job_keys.OPEN, 0)))
        self._waiting = None
        self._visited = []
        while True:
            if self.is_closed():
                raise RendezvousClosedError
            self._joining = round_
            self._visited.append(round_)
            self.place = place = self._enter(round_)
            wanted = "-" if self.wanted is None else str(self.wanted)
            entry = f"{wanted} {self.address} {socket.gethostname()}"
            proof = self.secret.sign(Signed.NODE, self.run_id, round_, place, entry)
            store.set(job_keys.node(round_, place), f"{entry} {proof}")
            if place >= self.min_nodes:
                store.set(job_keys.least(round_), "1")
            if place >= self.max_nodes and place == self.max_nodes + self._turned_away_in(round_):
                self._close(round_, str(place))
            end = self._await_end(round_, deadline)
            if end is None:  # out of time: leave the round, unless it closed meanwhile
                end = self._close(round_, ABANDONED)
                store.set(job_keys.least(round_), "1")  # the nodes waiting for it look at its end
                if end == ABANDONED or place > int(end):
                    raise RendezvousTimeoutError  # (what joined() reads stays the round's)
            if end != ABANDONED and place <= int(end):
                break
            round_ += 1  # late, or the round was left: the next one
        self.round, self._joining = round_, -1
        world_size = int(end)
        giver = self._giver(round_, place)
        if place == giver:
            previous = int(store.add(job_keys.OPEN, 0)) - 1  # the round met before (-1: none)
            store.set(job_keys.OPEN, str(round_ + 1))  # where a new node starts
            self._give_ranks(round_, world_size, previous)
        # Written by the giver once it has seen the round closed (at its
        # own look, up to a poll after this node's): looked for, not waited
        # for (a wait holds the connection the heartbeat beats on).
        given_bytes, left_bytes = read_when_set(
            store,
            [job_keys.rank(round_, giver, place), job_keys.left(round_, giver)],
            interval=self.poll(),
            stop=self.stop,
            stopped=StopRequested,
            look_now=place == giver,
        )
        given = bytes(given_bytes).decode()
        if given == REFUSED:
            raise SecretRefused
        rank_text, _, proof = given.partition(" ")
        lines = bytes(left_bytes).decode().split("\n")
        body, last = "\n".join(lines[:-1]), lines[-1].removeprefix("proof ")
        if not (
            self.secret.proves(proof, Signed.RANK, self.run_id, round_, place, rank_text)
            and self.secret.proves(last, Signed.LEFT, self.run_id, round_, body)
        ):
            raise self._stranger_gave(round_, giver)
        rank = int(rank_text)
        self.wanted = rank
        previous_text, size_text = lines[0].split()
        self.previous, world_size = int(previous_text), int(size_text)
        named = lines[1:-1]
        self.left = [_member(line) for line in named if not line.startswith("refused ")]
        self.refused = [
            _member(line.removeprefix("refused ")) for line in named if line.startswith("refused ")
        ]
        # Under the giver's place: a node that is not the job's and gave
        # ranks of its own (it took place 1) meets no node of the job's.
        round_store = dist.PrefixStore(job_keys.round_store(round_, giver), store)  # type: ignore[attr-defined]
        logger.debug("round %d met: node %d of %d (ranks given by place %d)", round_, rank, world_size, giver)
        return round_store, rank, world_size, self.address

    def _giver(self, round_: int, place: int) -> int:
        """The place of the node that gives round ``round_``'s ranks: the
        first whose entry proves the job's secret (place 1 without a
        secret; a node that is not the job's may take place 1, as a node
        that asks to join a running job does). Each node reads the places
        before its own until one proves: one read a node where the first
        does, none without a secret."""
        if not self.secret.on:
            return 1
        for before in range(1, place):
            entry = bytes(self.store.get(job_keys.node(round_, before))).decode()
            if self.secret.proves(_proof(entry), Signed.NODE, self.run_id, round_, before, _entry(entry)):
                return before
        return place

    def _stranger_gave(self, round_: int, giver: int) -> Exception:
        """The error of a node whose round's ranks, as read, do not prove
        the job's secret (written by something that is not a node of this
        job's, or by a node whose secret is not this node's)."""
        from phalanx_core import MisconfigurationError

        _, address, host = _member(bytes(self.store.get(job_keys.node(round_, giver))).decode())
        return MisconfigurationError(
            f"the ranks of round {round_} were given by a node that did not prove the job's secret "
            f"({SECRET_VAR}), or were changed since: the giver's place is {giver} (address {address}, host "
            f"{host}). "
            "Either that node is not one of this job's (something else reached the job's store), or the "
            f"nodes do not share one secret: give every node the same {SECRET_VAR}, keep the job's store "
            "on a private network (see the security page), and start the job again"
        )

    def _give_ranks(self, round_: int, world_size: int, previous: int) -> None:
        """Node ranks for the round's nodes, in the order of the ranks they
        would like (a node that would like none last), then of their
        addresses, then of their places; the round's members, and the
        members of round ``previous`` (the round met before) that are not
        among them. A member came back where a node of this round would
        like its rank (its rank of the round before) from its address."""
        store = self.store
        places = range(1, world_size + 1)
        keys = [job_keys.node(round_, place) for place in places]
        entries = [bytes(value).decode() for value in store.multi_get(keys)]
        nodes = [_member(entry) for entry in entries]
        # A node that did not prove the job's secret gets no rank (and the
        # round is the smaller by it): its place is marked refused.
        proven = [
            self.secret.proves(_proof(entry), Signed.NODE, self.run_id, round_, place, _entry(entry))
            for place, entry in zip(places, entries, strict=True)
        ]
        # This node, not the others, is the odd one where it has no secret
        # and others prove one, or where as many nodes prove another secret
        # as prove its own (an entry that proves no secret at all never
        # makes it odd): it gives no ranks and takes none (the nodes that
        # share its secret, if any, read that they are refused).
        rivals = sum(1 for entry, ok in zip(entries, proven, strict=True) if not ok and _proof(entry) != NONE)
        odd = any(_proof(entry) != NONE for entry in entries) if not self.secret.on else sum(proven) <= rivals
        if odd:
            store.multi_set(
                [job_keys.rank(round_, self.place, place) for place in places],
                [REFUSED for _ in places],
            )
            raise SecretRefused
        # A node turned away while it waited was named then (and is gone).
        refused = [
            f"{REFUSED} {wanted if wanted >= 0 else '-'} {address} {host}"
            for place, (wanted, address, host), ok in zip(places, nodes, proven, strict=True)
            if not ok and not store.check([job_keys.refused(round_, place)])
        ]
        order = sorted(
            (wanted if wanted >= 0 else 1 << 62, address, place, host)
            for place, (wanted, address, host), ok in zip(places, nodes, proven, strict=True)
            if ok
        )
        left: list[str] = []
        if previous >= 0 and store.check([job_keys.members(previous)]):
            back = {(wanted, address) for wanted, address, _ in nodes}
            *before, proof = bytes(store.get(job_keys.members(previous))).decode().split("\n")
            # Members written by a node that is not the job's name no one.
            if self.secret.proves(
                proof.removeprefix("proof "), Signed.MEMBERS, self.run_id, previous, "\n".join(before)
            ):
                left = [line for line in before if _member(line)[:2] not in back]
        members = [f"{rank} {address} {host}" for rank, (_, address, _, host) in enumerate(order)]
        joined_members = "\n".join(members)
        # In one request, the members and who left first: a node reads them
        # once it has read its rank (etcd's writes go 128 to a transaction,
        # in this order).
        body = "\n".join([f"{previous} {len(order)}", *left, *refused])
        given = [
            f"{rank} {self.secret.sign(Signed.RANK, self.run_id, round_, place, rank)}"
            for rank, (_, _, place, _) in enumerate(order)
        ]
        refused_places = [place for place, ok in zip(places, proven, strict=True) if not ok]
        store.multi_set(
            [
                job_keys.members(round_),
                job_keys.left(round_, self.place),
                *(job_keys.rank(round_, self.place, place) for _, _, place, _ in order),
                *(job_keys.rank(round_, self.place, place) for place in refused_places),
            ],
            [
                "\n".join(
                    [
                        *members,
                        f"proof {self.secret.sign(Signed.MEMBERS, self.run_id, round_, joined_members)}",
                    ]
                ),
                f"{body}\nproof {self.secret.sign(Signed.LEFT, self.run_id, round_, body)}",
                *given,
                *(REFUSED for _ in refused_places),
            ],
        )

    def _close(self, round_: int, value: str) -> str:
        """Propose the round's end; what it is (the first proposal wins)."""
        got = self.store.compare_set(job_keys.closed(round_), "", value)
        return bytes(got).decode()

    def _await_end(self, round_: int, deadline: float) -> str | None:
        """Wait for round ``round_`` to close; its end, or ``None`` at the deadline.

        The keys are looked at every :meth:`poll` seconds, not waited for
        with the store's ``wait``: a ``wait`` that times out makes c10d print
        two warning lines, and a blocked one holds the client."""
        from torch.distributed.elastic.rendezvous import RendezvousClosedError

        store = self.store
        closed, least = job_keys.closed(round_), job_keys.least(round_)
        # Every end of a round is written after its ``min`` key (a node that
        # leaves writes it too), so one key is looked at each time.
        key = least
        last_call_ends: float | None = None
        look_closed = time.monotonic() + JOB_CLOSED_EVERY
        while True:
            if store.check([key]):
                if key == closed:
                    return bytes(store.get(closed)).decode()
                key, last_call_ends = closed, time.monotonic() + self.last_call
                continue
            now = time.monotonic()
            if last_call_ends is not None and now >= last_call_ends:
                joined = self._joined(round_)
                most = self.max_nodes + self._turned_away_in(round_)
                return self._close(round_, str(min(joined, most)))
            if now >= deadline:
                return None
            if now >= look_closed:
                if self.is_closed():
                    raise RendezvousClosedError
                # Turned away (a node alone in a round after the job's): looked
                # at only before the round has its MIN nodes, so that a round
                # that forms costs no more requests.
                if key == least and self._refused_while_waiting(round_):
                    raise SecretRefused
                look_closed = now + JOB_CLOSED_EVERY
            if self.stop is None:
                time.sleep(self.poll())
            elif self.stop.wait(self.poll()):
                raise StopRequested

    def poll(self) -> float:
        """Seconds between two looks at the round's keys: 0.1 s for a few
        nodes, growing with the nodes so that all of them together ask the
        store at most about 2,000 times a second (1 s from 2,000 nodes)."""
        return min(1.0, max(0.1, self.max_nodes / 2000))

    # -- what the rank loop asks--------------------------------------------------

    @property
    def joined_any(self) -> bool:
        """Whether this node has joined a round (met, or is waiting in one)."""
        return self.round >= 0 or bool(self._visited)

    def joined(self) -> list[str]:
        """The addresses of the nodes that joined the rounds this node joined
        while it waits (read from the store; for messages): a node that
        stopped waiting first left its round, and this node went on to the
        next, but both were there. Empty where this node waits for none."""
        if self._joining < 0:
            return []
        found: set[str] = set()
        for round_ in self._visited:
            count = self._joined(round_)
            keys = [job_keys.node(round_, place) for place in range(1, count + 1)]
            present = [key for key in keys if self.store.check([key])]
            if present:
                found.update(_member(bytes(value).decode())[1] for value in self.store.multi_get(present))
        return sorted(found)

    def joined_count(self) -> int:
        round_ = self._joining
        return self._joined(round_) if round_ >= 0 else 0

    def num_nodes_waiting(self) -> int:
        """The nodes that joined the round after this node's (they wait for
        this round's nodes to meet them): one small read a second."""
        now = time.monotonic()
        if self._waiting is not None and now - self._waiting[0] < WAITING_CACHE:
            return self._waiting[1]
        return self.waiting_now()

    def waiting_now(self) -> int:
        if self.round < 0:
            return 0
        count = self._joined(self.round + 1)
        if count and self.secret.on:
            count = self._proven_waiting(self.round + 1, count)
        self._waiting = (time.monotonic(), count)
        return count

    def _proven_waiting(self, round_: int, count: int) -> int:
        """Of the ``count`` nodes waiting in round ``round_`` (the one after
        this node's), those whose entry proves the job's secret. One that
        does not is not counted, so it starts no new round (the ranks train
        on), and is marked refused (``refused/P``, which it reads within a
        second and stops); the node that marks it first names it. Each
        place's entry is read once (a place whose entry is not written yet
        is read at the next look)."""
        if self._looked_round != round_:
            self._looked, self._looked_round = {}, round_
        for place in range(1, count + 1):
            if place in self._looked:
                continue
            key = job_keys.node(round_, place)
            if not self.store.check([key]):
                continue
            entry = bytes(self.store.get(key)).decode()
            ok = self.secret.proves(_proof(entry), Signed.NODE, self.run_id, round_, place, _entry(entry))
            self._looked[place] = ok
            if not ok and int(self.store.add(job_keys.refused(round_, place), 1)) == 1:
                self.store.add(job_keys.refused(round_), 1)
                self.turned_away.append(_member(entry))
        return sum(1 for place, ok in self._looked.items() if ok and place <= count)

    def _turned_away_in(self, round_: int) -> int:
        """How many places of round ``round_`` were marked refused while
        their nodes waited (see :meth:`_proven_waiting`): the round takes
        ``max_nodes`` more than that, as those nodes have left it."""
        return int(self.store.add(job_keys.refused(round_), 0))

    def _refused_while_waiting(self, round_: int) -> bool:
        """Whether a node of the running job marked this node's place in
        ``round_`` refused (see :meth:`_proven_waiting`), and the round met
        before, which the job's nodes are in, is not this node's job: its
        members do not prove this node's secret (or prove one, where this
        node has none). A node of the job never takes a mark for itself."""
        if not self.store.check([job_keys.refused(round_, self.place)]):
            return False
        members = job_keys.members(round_ - 1)
        if round_ < 1 or not self.store.check([members]):
            return False
        *before, proof = bytes(self.store.get(members)).decode().split("\n")
        proof = proof.removeprefix("proof ")
        if not self.secret.on:
            return proof != NONE
        return not self.secret.proves(proof, Signed.MEMBERS, self.run_id, round_ - 1, "\n".join(before))

    def is_closed(self) -> bool:
        return bool(self.store.check([job_keys.CLOSED]))

    def set_closed(self) -> None:
        self.store.set(job_keys.CLOSED, "1")

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        """The job ends on this node: every node waiting to meet stops too."""
        self.set_closed()
        return True


def _member(text: str) -> tuple[int, str, str]:
    """A node as the rounds write it (``"RANK ADDRESS HOST"``, ``-`` for
    no rank, then its proof where it is a node's own entry):
    ``(rank or -1, address, host)``."""
    rank, address, host = [*text.split(" "), "", ""][:3]
    return (int(rank) if rank.isdigit() else -1), address, host


def _entry(text: str) -> str:
    """A node's entry without its proof."""
    return text.rpartition(" ")[0]


def _proof(text: str) -> str:
    """The proof at the end of a node's entry."""
    return text.rpartition(" ")[2]
