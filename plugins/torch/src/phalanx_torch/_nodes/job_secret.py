"""The job's secret: what each node's launching process proves, with an
HMAC (SHA-256) of what it writes, where it joins a round, gives a round's
ranks, says where a round's ranks meet, or posts a failure; a write without
the proof is refused and its writer named. Horovod signs its control
messages the same way; c10d's store and gloo authenticate nothing.

The secret is read from ``PHALANX_JOB_SECRET`` in each node's environment
(never from the command line, which every user of a host can read in
``ps``); give every node the same one. Without it nothing is signed or
checked (and a node that has one refuses a round given by a node that has
none). What it does not cover is on the security page. Imports nothing of
torch."""

from __future__ import annotations

import enum
import hashlib
import hmac
import os

__all__ = ["SECRET_VAR", "JobSecret", "SecretRefused", "Signed"]

#: The environment variable that holds the job's secret.
SECRET_VAR = "PHALANX_JOB_SECRET"
#: The proof a node without a secret writes.
NONE = "-"


class Signed(enum.Enum):
    """Every message a node proves with the job's secret; the fields each
    proof covers, in order, are in :data:`FIELDS`. A proof covers where the
    message is (its round, its place) as well as what it says, so that a
    proof copied to another key proves nothing there."""

    #: A node's entry in a round (its address, host, the rank it would like).
    NODE = "node"
    #: The rank a round's giver gave a node.
    RANK = "rank"
    #: The nodes of the round before that the giver found gone.
    LEFT = "left"
    #: A round's members, for the next round's giver.
    MEMBERS = "members"
    #: Where a round's ranks meet (the store the round's node 0 hosts).
    RANKS_STORE = "ranks-store"
    #: A failure a node posts (seen, or settled as the job's cause).
    POST = "post"
    CAUSE = "cause"
    #: A word of phalanx-torchft's end of a job (a group's end, its starts).
    END = "end"
    #: A side of phalanx-torchft's lighthouse handshake.
    LIGHTHOUSE = "lighthouse"


#: What each proof covers, in order (the message's tag first).
FIELDS: dict[Signed, tuple[str, ...]] = {
    Signed.NODE: ("run id", "round", "place", "entry"),
    Signed.RANK: ("run id", "round", "place", "rank"),
    Signed.LEFT: ("run id", "round", "nodes gone"),
    Signed.MEMBERS: ("run id", "round", "members"),
    Signed.RANKS_STORE: ("round", "address and port"),
    Signed.POST: ("index", "node and text"),
    Signed.CAUSE: ("index", "node and text"),
    Signed.END: ("key", "value"),
    Signed.LIGHTHOUSE: ("role", "nonce", "nonce"),
}


class SecretRefused(Exception):
    """This node's proof was refused (its secret is not the job's)."""


class JobSecret:
    """Signs and checks what the nodes write, with the job's secret (or,
    without one, signs nothing and takes everything)."""

    def __init__(self, secret: str | bytes | None) -> None:
        self._key = secret.encode() if isinstance(secret, str) else secret

    @classmethod
    def from_environment(cls) -> JobSecret:
        return cls(os.environ.get(SECRET_VAR) or None)

    @property
    def on(self) -> bool:
        return bool(self._key)

    def sign(self, message: Signed, *fields: object) -> str:
        """The proof of ``message`` with its ``fields`` (:data:`FIELDS`)."""
        _checked(message, fields)
        if not self._key:
            return NONE
        parts = "\x1f".join(str(part) for part in (message.value, *fields)).encode()
        return hmac.new(self._key, parts, hashlib.sha256).hexdigest()

    def proves(self, proof: str, message: Signed, *fields: object) -> bool:
        """Whether ``proof`` is this secret's proof of ``message`` with its
        ``fields`` (always, without a secret)."""
        if not self._key:
            _checked(message, fields)
            return True
        return hmac.compare_digest(proof, self.sign(message, *fields))


def _checked(message: Signed, fields: tuple[object, ...]) -> tuple[object, ...]:
    names = FIELDS[message]
    if len(fields) != len(names):
        raise TypeError(f"a proof of {message.name} covers {', '.join(names)}; given {len(fields)} fields")
    return fields
