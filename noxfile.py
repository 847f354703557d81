"""Every way phalanx is checked, as nox sessions. ``nox`` runs the default
ones (lint, typecheck, tests, docs, slurm, mpi, multihost, ray, horovod, xla,
torchft, torch_range on the oldest and the newest supported torch,
torch_below_range);
``nox -s tests`` one of them.
``slurm`` and ``mpi`` install Debian packages with apt-get: they need root
on a Debian or Ubuntu machine (CI).

Packages are derived from the tree: ``core``, ``registry`` and every folder
under ``plugins/`` with a ``pyproject.toml``. torch is installed first, pinned
(``torch==2.13.0`` is a local CPU build here; any other version downloads
several GB), except in the sessions that test other torch releases.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
PACKAGES = [
    ROOT / "core",
    ROOT / "registry",
    *sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml")),
]
#: Packages whose tests run in a session of their own (their backend is not
#: installed in ``tests``).
OWN_SESSION = {"torchft"}
TEST_PATHS = [str(p / "tests") for p in PACKAGES if (p / "tests").is_dir() and p.name not in OWN_SESSION] + [
    "tests"
]
#: pytest-xdist: two workers, each test file on one worker (a file's tests
#: share module fixtures: clusters, stores). phalanx._xdist_main gives
#: a worker's main module pytest's own file, so that the launchers that
#: re-run the main script see what they see without xdist.
XDIST = ["pytest-xdist>=3.5"]
PARALLEL = ["-p", "phalanx._xdist_main", "-n", "2", "--dist", "loadfile"]
#: ``multihost`` runs two files at a time too: each test bed
#: is namespaces of its own, its bridge in a namespace too (two beds with the
#: same addresses never meet), and each test reaps the processes it tagged,
#: so two tests do not see each other. Most of their time is waiting (a lost
#: host's heartbeat, a rendezvous's patience), not the two cores: one file
#: at a time it took 13 of CI's 66 minutes, two at a time 8 here.

nox.options.sessions = [
    "lint",
    "typecheck",
    "tests",
    "docs",
    "slurm",
    "mpi",
    "multihost",
    "ray",
    "horovod",
    "xla",
    "torchft",
    "torch_range",
    "torch_below_range",
]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
#: uv makes the environments and installs into them where nox finds it
#: (``pip install 'nox[uv]'``, as .ci/run does); else virtualenv and pip.
#: uv takes a few seconds where pip took minutes: torch is unpacked once
#: into uv's cache and linked into each session (pip unpacked 0.8 GB per
#: session, and 4 GB for each CUDA build of the range's ends).
nox.options.default_venv_backend = "uv|virtualenv"

#: What a fresh home keeps of the real one: how pip reaches its package
#: indexes (the machine's set-up, not a test's state).
PIP_CONFIG = (".config/pip", ".pip")
#: The TorchFT phalanx-torchft is tested with (its ``torchft`` extra's range).
TORCHFT = "torchft>=0.2,<0.3"
#: pip's settings and the uv variables that say the same (uv reads no
#: pip.conf): where the packages are, the machine's constraints, the
#: certificates to trust. A list takes uv's separator.
PIP_TO_UV = {
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", " "),
    "default-timeout": ("UV_HTTP_TIMEOUT", " "),
}


@functools.cache
def uv_settings() -> dict[str, str]:
    """pip's configuration on this machine (its files and ``PIP_*``
    variables, as ``pip config list`` prints them, later ones winning) as
    uv's variables, so that uv installs what pip would: from the same
    indexes, under the same constraints, the best version found on any of
    them (``UV_INDEX_STRATEGY``; uv's default takes the first index that
    has a package at all), and with its bytecode compiled."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    # Bytecode compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE
    # is set (this machine), each process would otherwise compile torch's
    # sources again at every import (measured: the tests session 22 min
    # instead of 11).
    settings = {"UV_INDEX_STRATEGY": "unsafe-best-match", "UV_COMPILE_BYTECODE": "1"}
    for line in listing.splitlines():
        found = re.fullmatch(r"[^.]*\.([a-z-]+)='(.*)'", line.strip())
        if found and found[1] in PIP_TO_UV:
            variable, separator = PIP_TO_UV[found[1]]
            settings[variable] = separator.join(found[2].split())
    return settings


def session(function: Callable[..., None]) -> Callable[..., None]:
    """A nox session that runs with a home directory and a temporary
    directory of its own, made empty for it and removed after, so that
    nothing an earlier run left on the machine (``~/.ray``, ``/tmp/ray``, a
    cluster's address file, a token) can make a test pass or fail. pip's and
    uv's caches and pip's configuration are kept: the caches save downloads
    and unpacking, the configuration says where the package indexes are. The session's
    virtual environment is removed after it too, unless
    ``PHALANX_NOX_KEEP=1``."""

    @functools.wraps(function)
    def run(session: nox.Session, **parameters: str) -> None:
        real_home = Path(os.environ.get("HOME") or Path.home())
        cache = os.environ.get("PIP_CACHE_DIR") or str(real_home / ".cache" / "pip")
        # Short paths: Ray's sockets live under TMPDIR, and a Unix socket's
        # path has at most 107 bytes.
        home, tmp = Path(tempfile.mkdtemp(prefix="nox-home-")), Path(tempfile.mkdtemp(prefix="nox-"))
        # As /tmp is: daemons the tests start as other users (munged runs as
        # munge) reach their folders under it.
        tmp.chmod(0o1777)
        for relative in PIP_CONFIG:
            if (real_home / relative).is_dir():
                shutil.copytree(real_home / relative, home / relative)
        session.env.update(HOME=str(home), TMPDIR=str(tmp), PIP_CACHE_DIR=cache)
        if getattr(session.virtualenv, "venv_backend", None) == "uv":
            uv_cache = os.environ.get("UV_CACHE_DIR") or str(real_home / ".cache" / "uv")
            session.env.update(uv_settings(), UV_CACHE_DIR=uv_cache)
        # Every session's slowest tests in its log: where CI's time goes.
        session.env.setdefault("PYTEST_ADDOPTS", "--durations=15")
        session.log(f"HOME={home} TMPDIR={tmp} (fresh; removed after the session)")
        try:
            function(session, **parameters)
        finally:
            shutil.rmtree(home, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
            # A session's environment goes with it: a CUDA build of torch is
            # 5 to 7 GB, and thirteen environments filled CI's disk once.
            # PHALANX_NOX_KEEP=1 keeps them for quicker local re-runs.
            location = getattr(session.virtualenv, "location", None)
            if location and os.environ.get("PHALANX_NOX_KEEP") != "1":
                shutil.rmtree(location, ignore_errors=True)

    return nox.session(run)


def install_packages(session: nox.Session, torch: str = TORCH) -> None:
    """torch first, then every package of the tree, editable."""
    session.install(torch, "numpy")
    editable: list[str] = []
    for package in PACKAGES:
        editable += ["-e", str(package)]
    session.install(*editable)


@session
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@session
def typecheck(session: nox.Session) -> None:
    """mypy, strict on core/ and registry/ (see pyproject.toml)."""
    install_packages(session)
    session.install("mypy>=1.10", "pytest>=8", "hypothesis>=6.100")
    session.run("mypy")


@session
def tests(session: nox.Session) -> None:
    """pytest over every package's tests and the cross-package tests/."""
    install_packages(session)
    # pip: tests/test_author_guide.py builds and installs packages with it,
    # as their authors do (uv's environments come without it).
    session.install("pytest>=8", "hypothesis>=6.100", "pip", *XDIST)
    # The exit loops' stress belongs in a loop of its own (PHALANX_EXIT_LOOPS=100):
    # in every CI run, three of each.
    session.run("pytest", *PARALLEL, *(session.posargs or TEST_PATHS), env={"PHALANX_EXIT_LOOPS": "3"})


@session
def docs(session: nox.Session) -> None:
    """The documentation site, built in strict mode (warnings fail)."""
    editable: list[str] = []
    for package in PACKAGES:
        editable += ["-e", str(package)]
    session.install("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", *editable)
    session.run(
        "mkdocs", "build", "--strict", "--config-file", "docs/mkdocs.yml", env={"NO_MKDOCS_2_WARNING": "1"}
    )


def apt_install(session: nox.Session, *packages: str) -> None:
    """Debian packages, non-interactively; ``apt-get update`` only when the
    install fails without it (a fresh machine's package lists may be stale
    or missing)."""
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    command = ("apt-get", "install", "-y", "-q", *packages)
    try:
        session.run(*command, env=env, external=True)
    except CommandFailed:
        session.log("apt-get install failed; updating the package lists and trying again")
        session.run("apt-get", "update", "-q", env=env, external=True)
        session.run(*command, env=env, external=True)


def real_runs(
    session: nox.Session,
    name: str,
    *more: str,
    env: dict[str, str] | None = None,
    install: tuple[str, ...] = (),
) -> None:
    """pytest on tests/real/test_{name}.py (and the paths in ``more``), which
    their conftest collects only when PHALANX_REAL_RUNS names it (the
    ``tests`` session leaves them out); ``install``: more packages, after
    torch and the tree's."""
    install_packages(session)
    session.install("pytest>=8", *install)
    paths = session.posargs or [f"tests/real/test_{name}.py", *more]
    session.run("pytest", *paths, env={"PHALANX_REAL_RUNS": name, **(env or {})})


@session
def slurm(session: nox.Session) -> None:
    """Real runs under srun on a one-node Slurm cluster on loopback, and
    ``ddp_ft`` under srun (one phalanx run per node, a group killed).

    Installs Slurm and munge; the tests start munged, slurmctld and slurmd
    with tests/real/slurm/start.sh (free ports, state in a temporary folder)
    and stop them by pid file in the fixture's teardown, whether the tests
    pass or fail.
    """
    apt_install(session, "slurmd", "slurmctld", "slurm-client", "munge")
    real_runs(session, "slurm", install=(TORCHFT,))  # TorchFT: ddp_ft's groups under srun


@session
def mpi(session: nox.Session) -> None:
    """Real runs under OpenMPI's mpirun: the ``mpi`` environment (torch over
    gloo, ranks from mpirun's variables), and phalanx-mpi's tests with mpi4py
    (the ``mpi`` collective through the conformance suite, the ``mpirun``
    launcher, DDP and the manual example over MPI), and ``ddp_ft`` under
    mpirun (one phalanx run per node, a group killed). As root, OpenMPI needs
    its two allow-run-as-root variables."""
    apt_install(session, "openmpi-bin")
    session.install("mpi4py>=3.1")
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    # TorchFT: ddp_ft's groups under mpirun.
    real_runs(session, "mpi", "plugins/mpi/tests", env=root, install=(TORCHFT,))


@session
def multihost(session: nox.Session) -> None:
    """Jobs across several hosts made of network namespaces (tests/multihost,
    with :mod:`phalanx_core.testing.hosts`): ``phalanx run`` and ``torchrun``
    on two hosts, failures, plan mismatches and checkpoints across them,
    ``mpirun`` with an rsh agent that enters the namespaces, and a Slurm
    cluster with a slurmd per host; jobs that survive a lost host, with the
    rendezvous on node 0 and in an etcd cluster (a member per host);
    ``ddp_ft`` under ``srun`` and ``mpirun`` on two hosts (TorchFT). Needs
    root; installs iproute2, OpenMPI, Slurm and etcd (Debian's etcd-server
    3.4, run without its v2 API, as etcd 3.6 always is). The tests make and
    remove the namespaces themselves."""
    apt_install(
        session, "iproute2", "openmpi-bin", "slurmd", "slurmctld", "slurm-client", "munge", "etcd-server"
    )
    session.install("mpi4py>=3.1", TORCHFT)  # TorchFT: ddp_ft's groups under srun and mpirun on two hosts
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    install_packages(session)
    session.install("pytest>=8", *XDIST)
    env = {"PHALANX_REAL_RUNS": "multihost", **root}
    # Two files at a time (see PARALLEL).
    session.run("pytest", *PARALLEL, *(session.posargs or ["tests/multihost"]), env=env)


#: The ray phalanx-ray is tested with (its pyproject's ``ray`` extra pins it).
RAY = "ray[default]==2.60.0"


@session
def ray(session: nox.Session) -> None:
    """phalanx-ray against real Ray (``RAY``): the plugin's tests, which
    plugins/ray/tests/conftest.py collects only when PHALANX_REAL_RUNS names
    ray. The launcher conformance suite (each launch on a local Ray instance
    it starts and stops), ``ddp``, ``fsdp`` and ``manual`` to the weights of
    ``spawn``, warm ranks across launches, a raising rank, a killed actor and
    Ctrl-C; a Ray cluster started outside the tests (joined, and left
    running), and one of two Ray nodes on two hosts of the multi-host test
    bed (network namespaces: needs root and iproute2); ``ddp_ft``'s groups
    under launcher ``ray_replica_groups`` (TorchFT), on a local instance and
    on those two nodes. Installs OpenMPI and mpi4py too, for the refusal of
    the mpi collective with this launcher."""
    apt_install(session, "iproute2", "openmpi-bin")
    install_packages(session)
    # mpi4py: the mpi collective is then available, and refused with the
    # ray launcher for what it is (MPI talks among processes mpirun started).
    session.install(RAY, "mpi4py>=3.1", TORCHFT, "pytest>=8")
    session.run("pytest", "plugins/ray/tests", *session.posargs, env={"PHALANX_REAL_RUNS": "ray"})


@session
def horovod(session: nox.Session) -> None:
    """phalanx-horovod against real horovod 0.28.1 (gloo, CPU): built from its
    PyPI source by plugins/horovod/scripts/install-horovod.sh (torch first;
    pip caches the wheel, so only the first run compiles), then the plugin's
    tests, which plugins/horovod/tests/conftest.py collects only when
    PHALANX_REAL_RUNS names horovod: ranks under ``horovodrun --gloo -np 2``
    and through the ``horovod`` launcher, the collective conformance suite,
    and examples/train.py --strategy horovod on two processes."""
    install_packages(session)
    # pip: the script builds horovod with it, as horovod's docs do.
    session.install("pytest>=8", "pip")
    python = str(Path(session.bin) / "python")
    script = ROOT / "plugins" / "horovod" / "scripts" / "install-horovod.sh"
    session.run("sh", str(script), env={"PYTHON": python}, external=True)
    session.run("pytest", "plugins/horovod/tests", *session.posargs, env={"PHALANX_REAL_RUNS": "horovod"})


@session
def xla(session: nox.Session) -> None:
    """phalanx-xla against real torch_xla 2.9.0 on its CPU runtime
    (``PJRT_DEVICE=CPU``, two replicas: ``CPU_NUM_DEVICES=2``, run as two
    threads of one process). Its own environment: torch_xla 2.9.0 needs
    exactly torch 2.9.0 (its metadata does not say so), which has no CPU-only
    build on PyPI, so this installs about 4 GB. Then the plugin's tests,
    which plugins/xla/tests/conftest.py collects only when PHALANX_REAL_RUNS
    names xla: the collective conformance suite over 2 replicas, the
    launcher, environment and accelerator, and examples/train.py --strategy
    xla."""
    session.install("torch==2.9.0", "torch_xla==2.9.0", "numpy", "pytest>=8")
    editable: list[str] = []
    for package in PACKAGES:
        editable += ["-e", str(package)]
    session.install(*editable)
    env = {"PHALANX_REAL_RUNS": "xla", "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    session.run("pytest", "plugins/xla/tests", *session.posargs, env=env)


@session
def torchft(session: nox.Session) -> None:
    """phalanx-torchft on TorchFT 0.2 from PyPI (a 2.4 MB wheel with its Rust
    lighthouse; torch>=2.7, so the pinned torch stays): strategies ddp_ft and
    hsdp_ft and launcher replica_groups, replica groups of gloo ranks, one
    killed with SIGKILL while the job trains, the others going on, the
    killed one healing from a peer; a rank stopped with SIGSTOP, its group
    alone restarted after its collective timeout; then on three hosts made of network
    namespaces (root and iproute2, as ``multihost``): a host killed whole,
    one cut off the network, the lighthouse's host lost (and, with an etcd
    member a host, the elected lighthouse's host lost or cut off: another
    takes over), a host with another job secret refused; and on four, two
    groups of two hosts each: a rank killed, a host lost, a host cut off."""
    # etcd: the lighthouse elected among the hosts (--rendezvous etcd://), an etcd member a host.
    apt_install(session, "iproute2", "etcd-server")
    install_packages(session)
    session.install(TORCHFT, "pytest>=8", "py-spy", *XDIST)  # py-spy: the stacks of a job that stalls
    # Two files at a time, as ``multihost``: test_hosts.py's beds are namespaces of their own, and
    # most of its time is waiting (a lost host's heartbeat, a quorum's timeout). One file at a time
    # this session took 11 of CI's 68 minutes; two at a time 8 here, where one took 11 or more.
    session.run(
        "pytest",
        *PARALLEL,
        *(session.posargs or ["plugins/torchft/tests"]),
        env={"PHALANX_REAL_RUNS": "torchft"},
    )


#: The oldest and the newest torch of the range phalanx supports
#: (``torch>=2.9`` in every plugin's specs and ``torch`` extra): the oldest
#: is torch_xla 2.9's torch (the ``xla`` session installs the same wheel, so
#: pip's cache serves one download), the newest is the newest release this
#: machine's package index serves (its pip is capped at 2.14.1).
TORCH_RANGE = ["2.9.0", "2.14.1"]
#: What ``torch_range`` runs on each end: every test of the packages that
#: use torch, the command line's runs of examples/train.py (``phalanx run``,
#: ``ddp`` on two ranks and a spawn strategy), and one restart after a
#: killed rank, at one of its three kill points (fsdp's checkpoints, on any
#: world size, are the torch plugin's tests). Of phalanx-compose, which uses
#: no torch API of its own (it composes the torch plugin's collectives), the
#: contract and the resolving: its training runs (140 s of 600 on one
#: worker) test the composition, which does not change with torch;
#: ``tests`` runs them.
RANGE_TESTS = [
    "core/tests",
    "registry/tests",
    "plugins/torch/tests",
    "plugins/compose/tests/test_contract.py",
    "plugins/compose/tests/test_resolving.py",
    "tests/test_run.py",
    "tests/test_restarts.py::test_a_killed_rank_is_restarted_and_the_run_ends_as_if_nothing_happened[7]",
    # Kills a background save at 12 points twice (130 s of 390 on two
    # workers): the file system's and phalanx's, not torch's; ``tests`` runs it.
    "--deselect",
    "plugins/torch/tests/test_checkpoint_directory.py::"
    "test_a_background_save_killed_at_random_points_leaves_a_loadable_checkpoint",
    # Three phalanx runs, one a stranger (60 s of one worker): the job
    # secret's rule on the store, which test_counted_rounds.py tests on
    # torch's TCPStore in each end's run; ``tests`` runs it.
    "--deselect",
    "tests/test_run.py::test_a_stranger_asking_to_join_a_running_job_is_refused_and_the_job_trains_on",
]


@session
@nox.parametrize("torch", TORCH_RANGE)
def torch_range(session: nox.Session, torch: str) -> None:
    """The tests that differ between torch releases (``RANGE_TESTS``), on
    each end of the supported range (``TORCH_RANGE``); the ``tests``
    session runs everything on the pinned ``TORCH``. Neither end has a
    CPU-only build on PyPI: the first run downloads a few GB, which pip
    caches."""
    install_packages(session, f"torch=={torch}")
    session.install("pytest>=8", "hypothesis>=6.100", *XDIST)
    session.run("pytest", *PARALLEL, *(session.posargs or RANGE_TESTS))


#: A torch below the range: the registry must refuse it by its metadata,
#: before anything imports it.
TORCH_BELOW = "torch==2.5.1"


@session
def torch_below_range(session: nox.Session) -> None:
    """A torch older than the range (``TORCH_BELOW``) is refused in one line
    naming the range, by ``phalanx list``, ``explain``, ``run`` and
    ``resolve()``, before anything imports torch (tests/real/test_torch_below.py).
    torch is installed without its dependencies (the CUDA libraries), which
    the refusal never needs: only its metadata is read."""
    session.install("--no-deps", TORCH_BELOW)
    editable: list[str] = []
    for package in PACKAGES:
        editable += ["-e", str(package)]
    session.install(*editable, "pytest>=8")
    session.run(
        "pytest",
        *(session.posargs or ["tests/real/test_torch_below.py"]),
        env={"PHALANX_REAL_RUNS": "torch_below"},
    )
