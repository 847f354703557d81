"""Every key a job of several nodes keeps in its store (node 0's
``TCPStore``, or the job's prefix in etcd), in one place: who writes each
and who reads it is in architecture.md's table "Fault tolerance across
nodes". The parts (the rounds, the rank loop, the heartbeat, the node
watch, the arrivals of a job that meets once) take their names from here
and from nowhere else. Imports nothing.

Keys of the job's store are absolute; those said to be "in the round's
store" are under :func:`round_store` (the prefix the rounds' handler gives
the round's nodes), and those "in the watch's store" under :data:`FAILURES`.
"""

from __future__ import annotations

# -- the rounds (counted_rounds, rounds) -------------------------------------------

#: The counted rounds' keys.
RDZV = "phalanx/rdzv"
#: The round a new node starts at.
OPEN = f"{RDZV}/open"
#: The job is over: no node joins any round.
CLOSED = f"{RDZV}/closed"
#: The job's restarts (a counter).
RESTARTS = "phalanx/restarts"
#: The nodes whose wait for a round timed out (a counter).
TIMED_OUT = "phalanx/timed-out"


def round_key(round_: int, name: str) -> str:
    """Key ``name`` of round ``round_`` (one of those below)."""
    return f"{RDZV}/{round_}/{name}"


def joined(round_: int) -> str:
    """The nodes that entered round ``round_`` (a counter, or etcd's entrants)."""
    return round_key(round_, "joined")


def node(round_: int, place: int) -> str:
    """The node in place ``place`` of round ``round_``: its entry and proof."""
    return round_key(round_, f"node/{place}")


def least(round_: int) -> str:
    """Round ``round_`` has its least number of nodes (the last call runs)."""
    return round_key(round_, "min")


def closed(round_: int) -> str:
    """Round ``round_`` is closed: its members' count (one compare-and-set)."""
    return round_key(round_, "closed")


def rank(round_: int, giver: int, place: int) -> str:
    """The rank the node in place ``giver`` gave the node in place ``place``."""
    return round_key(round_, f"rank/{giver}/{place}")


def left(round_: int, giver: int) -> str:
    """The nodes of the round before that the giver found gone, with its proof."""
    return round_key(round_, f"left/{giver}")


def members(round_: int) -> str:
    """Round ``round_``'s members, proven (the next round's giver reads them)."""
    return round_key(round_, "members")


def refused(round_: int, place: int | None = None) -> str:
    """The nodes of round ``round_`` whose entry did not prove the job's
    secret (a counter), or whether the one in place ``place`` was."""
    return round_key(round_, "refused" if place is None else f"refused/{place}")


def round_store(round_: int, giver: int = 1) -> str:
    """The prefix of round ``round_``'s own keys (the rendezvous store the
    round's nodes get), given by the node in place ``giver``."""
    return f"{RDZV}/{round_}/store/{giver}"


# -- in the round's store ----------------------------------------------------------

#: The round failed: the first node to see it counts it for the job (a counter).
ROUND_FAILED = "phalanx/round-failed"
#: The job's restarts once that node counted the round's failure.
RESTARTS_COUNTED = "phalanx/restarts-counted"
#: Where the round's ranks meet: the address and port of the store the
#: round's node 0 hosts for them.
RANKS_STORE = "phalanx/ranks-store"


def local_ranks(node: int) -> str:
    """How many ranks node ``node`` of the round runs."""
    return f"phalanx/local-ranks/{node}"


def first_rank(node: int) -> str:
    """Node ``node``'s first global rank and the world's size (node 0 writes them)."""
    return f"phalanx/first-rank/{node}"


#: The exit barrier of a round whose ranks ended well: the nodes ended so
#: far (a counter), and the key the last of them sets.
ENDED_COUNT = "phalanx/ended/count"
ENDED_ALL = "phalanx/ended/all"


# -- the heartbeat -----------------------------------------------------------------


def beat(round_: int, node: int, what: str) -> str:
    """Node ``node``'s ``beats`` (a counter that moves) or ``host`` (its
    host's name) in round ``round_`` (0 in a job of fixed nodes)."""
    return f"phalanx/beat/{round_}/{node}/{what}"


# -- the node watch ----------------------------------------------------------------

#: The prefix of the node watch's keys (those below, in the watch's store):
#: the failures the nodes post.
FAILURES = "phalanx/failures"
#: The nodes that left the watch's store (a counter), and those that said
#: they were done.
WATCH_LEFT = "left"
WATCH_DONE = "done"


def posted(kind: str, index: int | None = None) -> str:
    """The ``kind`` (``post``: a failure seen; ``cause``: one settled)
    numbered ``index``, or how many there are (a counter)."""
    return f"{kind}s" if index is None else f"{kind}/{index}"


# -- a job that meets once (arrivals) ---------------------------------------------


def arrived(node: int) -> str:
    """Node ``node`` arrived (its host's name)."""
    return f"phalanx/arrived/{node}"


#: Node 0's word for the nodes that never came; how many nodes read it.
MISSING = "phalanx/missing"
MISSING_READ = "phalanx/missing-read"
#: Every node arrived.
MET = "phalanx/met"
