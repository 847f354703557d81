"""What launchers of other plugins build on, from this plugin's own nodes:
the job's secret (``PHALANX_JOB_SECRET``, an HMAC over what a node writes
or says) and the etcd cluster an ``etcd://`` rendezvous names (a client of
its v3 API, a ``torch.distributed.Store`` on it). Imports no torch at
import time."""

from __future__ import annotations

from ._nodes.etcd3 import Etcd3, EtcdRequestError, EtcdUnavailable, job_store
from ._nodes.job_secret import SECRET_VAR, JobSecret, Signed
from ._nodes.rendezvous_place import RendezvousPlace, parse_rendezvous

__all__ = [
    "SECRET_VAR",
    "Etcd3",
    "EtcdRequestError",
    "EtcdUnavailable",
    "JobSecret",
    "RendezvousPlace",
    "Signed",
    "etcd_client",
    "job_store",
    "parse_rendezvous",
]


def etcd_client(place: RendezvousPlace, *, patience: float | None = None) -> Etcd3:
    """A client of the members of an etcd rendezvous (``place.kind ==
    "etcd"``); ``patience``: how long a request is tried again, member after
    member (etcd3's default where not given)."""
    options = {} if patience is None else {"patience": patience}
    from ._nodes.etcd3 import PLAIN

    return Etcd3(place.endpoints, access=place.access or PLAIN, **options)
