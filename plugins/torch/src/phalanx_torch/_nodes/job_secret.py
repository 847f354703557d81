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

import hashlib
import hmac
import os

__all__ = ["SECRET_VAR", "JobSecret", "SecretRefused"]

#: The environment variable that holds the job's secret.
SECRET_VAR = "PHALANX_JOB_SECRET"
#: The proof a node without a secret writes.
NONE = "-"


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

    def sign(self, *parts: object) -> str:
        """The proof of ``parts`` (what is written, and where)."""
        if not self._key:
            return NONE
        message = "\x1f".join(str(part) for part in parts).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def proves(self, proof: str, *parts: object) -> bool:
        """Whether ``proof`` is this secret's proof of ``parts`` (always,
        without a secret)."""
        if not self._key:
            return True
        return hmac.compare_digest(proof, self.sign(*parts))
