"""The job's store that outlives its rounds, on either place
(:mod:`.rendezvous_place`): node 0's ``TCPStore``, hosted by node 0's
launching process or reached from the others, or the job's keys in an
etcd cluster, whose members are checked first (and what is wrong with
them named); and the open-file limit that node 0's store needs. Imports
no torch at import time."""

from __future__ import annotations

import datetime
import logging
from typing import Any

from phalanx_core import UnavailableError
from phalanx_core.launching import hosted_store

from .rendezvous_place import ETCD_PASSWORD_VAR, RendezvousPlace

__all__ = ["allow_connections", "job_store"]

logger = logging.getLogger(__name__)


def job_store(place: RendezvousPlace, *, host: str | None, timeout: float) -> Any:
    """The job's store that outlives its rounds: node 0's ``TCPStore``
    (hosted here, listening on ``host``, where ``host`` is not None; a
    client elsewhere), or a store in the etcd cluster (:mod:`.etcd3`)."""
    import torch.distributed as dist

    if place.kind == "etcd":
        from . import etcd3

        _check_etcd(place, timeout)
        logger.debug("a client of the job's keys in %s", place.describe())
        return etcd3.job_store(place.endpoints, f"/phalanx/{place.name}/store", timeout, place.access)
    address, port = place.endpoints[0]
    wait = datetime.timedelta(seconds=timeout)
    logger.debug(
        "%s node 0's store at %s:%d", "hosting" if host is not None else "a client of", address, port
    )
    if host is not None:
        return hosted_store(host, port, timeout=wait)
    return dist.TCPStore(address, port, is_master=False, timeout=wait)  # type: ignore[attr-defined]


#: The longest a node waits at its start for a member of the etcd cluster
#: to answer (the members of a cluster started with the job elect a
#: leader first: a few seconds).
ETCD_START_WAIT = 30.0


def _check_etcd(place: RendezvousPlace, timeout: float) -> None:
    """Raise what to do unless a member of the etcd cluster answers a read
    on its v3 API within ``min(timeout, ETCD_START_WAIT)`` seconds."""
    from . import etcd3

    wait = min(timeout, ETCD_START_WAIT)
    access = place.access or etcd3.PLAIN
    try:
        etcd3.check_reachable(place.endpoints, wait, access)
    except etcd3.EtcdTLSError as exc:
        raise UnavailableError(f"rendezvous in etcd ({place.endpoint}): {exc}") from None
    except etcd3.EtcdRequestError as exc:
        if "CommonName of client" in str(exc):
            raise UnavailableError(
                f"rendezvous in etcd ({place.endpoint}): etcd refused the job's first read ({exc}): with "
                "authentication on, etcd's JSON gateway (the API phalanx speaks) refuses a client "
                "certificate that has a CommonName; give a client certificate without one (the user "
                "is then user=NAME's)"
            ) from None
        if exc.code is not None:  # etcd's own refusal: authentication
            what = (
                f"check user={access.user!r} and its password in {ETCD_PASSWORD_VAR}; the user needs a "
                "role that may read and write the keys under /phalanx/"
                if access.user
                else f"a cluster with authentication on needs ?user=NAME in --rendezvous and its password "
                f"in {ETCD_PASSWORD_VAR}"
            )
            raise UnavailableError(
                f"rendezvous in etcd ({place.endpoint}): etcd refused the job's first read ({exc}): {what}"
            ) from None
        answered = etcd3.versions(place.endpoints, access)
        found = ", ".join(f"etcd {version} at {member}" for member, version in answered.items())
        raise UnavailableError(
            f"rendezvous in etcd ({place.endpoint}): {found or 'a server'} answered, but not on etcd's "
            f"v3 API (its JSON gateway at /v3/, which etcd 3.4 and later serve): {exc}. Use etcd 3.4 "
            "or later, or meet on node 0's store instead (--rendezvous c10d)"
        ) from None
    except etcd3.EtcdUnavailable as exc:
        members = ", ".join(f"{host}:{port}" for host, port in place.endpoints)
        tls = [] if access.tls else etcd3.speaks_tls(place.endpoints)
        if tls:
            raise UnavailableError(
                f"rendezvous in etcd ({place.endpoint}): {', '.join(tls)} "
                f"speak{'s' if len(tls) == 1 else ''} TLS, and a plain-HTTP request is closed unanswered: "
                "reach the members with etcd+https://..., with ?cacert=PATH (and cert=PATH&key=PATH "
                "where they ask for a client certificate)"
            ) from None
        answered = etcd3.versions(place.endpoints, access)
        if answered:
            found = ", ".join(f"etcd {version} at {member}" for member, version in answered.items())
            raise UnavailableError(
                f"rendezvous in etcd ({place.endpoint}): {found} answered, but no read of the job's "
                f"keys succeeded within {wait:g} s ({exc}): a cluster without a leader (are most of "
                "its members down?). Bring a majority of its members up, or meet on node 0's store "
                "instead (--rendezvous c10d)"
            ) from None
        raise UnavailableError(
            f"rendezvous in etcd ({place.endpoint}): no member of the etcd cluster answered at "
            f"{members} within {wait:g} s ({exc}). Start etcd there (3.4 or later), check the "
            "addresses and ports in --rendezvous, or meet on node 0's store instead "
            "(--rendezvous c10d)"
        ) from None


def allow_connections(count: int) -> None:
    """Raise this process's open-file limit (the soft one, up to the hard
    one) so that the store it hosts can hold ``count`` connections: four
    per node (its rendezvous, its node watch's two and its heartbeat), which at 4,096 nodes
    is above the usual soft limit of 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 256  # and the process's own files
    if soft != resource.RLIM_INFINITY and soft < wanted:
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if top > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
