"""Specs: the plain data a plugin declares for each part it gives.

A spec names a part and says where its code lives (``target``, a
``"module:attr"`` string imported only when the name is used), what it needs
(import names, checked with :func:`importlib.util.find_spec`, which imports
nothing, each with the versions it supports: ``"torch>=2.9"``) and what to
install when those are missing. Specs are frozen: the
registry decides policy (duplicates, defaults, ``"auto"``); specs only carry
data.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "AcceleratorSpec",
    "CollectiveSpec",
    "EnvironmentSpec",
    "Kind",
    "LauncherSpec",
    "Need",
    "PrecisionSpec",
    "Spec",
    "StrategySpec",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_NEED_NAME = re.compile(r"^[A-Za-z_][\w.]*")
_CLAUSE = re.compile(r"^(>=|<=|==|!=|>|<)\s*([0-9]+(?:\.[0-9]+)*)$")
_RELEASE = re.compile(r"^\s*v?([0-9]+(?:\.[0-9]+)*)")
_COMPARE = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


def _release(version: str) -> tuple[int, ...] | None:
    """The release numbers a version starts with (``"2.13.0+cpu"`` ->
    ``(2, 13, 0)``; ``"2.10.0.dev20250801"`` -> ``(2, 10, 0)``), trailing
    zeros dropped so that ``2.9`` and ``2.9.0`` are equal; None when it
    starts with none."""
    match = _RELEASE.match(version)
    if not match:
        return None
    numbers = [int(n) for n in match.group(1).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


@dataclass(frozen=True)
class Need:
    """One entry of a spec's ``needs``: an import name and, optionally, the
    versions of its distribution (of the same name) that the part supports,
    as comma-separated clauses of ``>=, <=, >, <, ==, !=`` and release
    numbers: ``Need.parse("torch>=2.9,<3")``. Pre-release and local labels
    are not compared: ``2.9.0rc1`` and ``2.9.0+cpu`` count as ``2.9.0``."""

    name: str
    versions: str = ""

    @classmethod
    def parse(cls, text: str) -> Need:
        """Read ``"name"`` or ``"name>=X,<Y"``; :class:`ValueError` names
        what is wrong."""
        match = _NEED_NAME.match(text.strip())
        if not match:
            raise ValueError(f"need {text!r} does not start with an import name")
        name, rest = match.group(0), text.strip()[match.end() :].strip()
        clauses = ["".join(c.split()) for c in rest.split(",")] if rest else []
        for clause in clauses:
            if not _CLAUSE.match(clause):
                raise ValueError(
                    f"need {text!r}: {clause!r} is not a version clause; write the versions as "
                    "'>=2.9' or '>=2.9,<3' (operators >=, <=, >, <, ==, !=; release numbers only)"
                )
        return cls(name, ",".join(clauses))

    def admits(self, version: str) -> bool:
        """Whether ``version`` is one of the supported versions (a version
        that starts with no release number is admitted: nothing can be said
        of it)."""
        have = _release(version)
        if have is None:
            return True
        for clause in filter(None, self.versions.split(",")):
            match = _CLAUSE.match(clause)
            assert match is not None  # checked by parse
            wanted = _release(match.group(2))
            assert wanted is not None
            if not _COMPARE[match.group(1)](have, wanted):
                return False
        return True

    def __str__(self) -> str:
        return self.name + self.versions


class Kind(str, enum.Enum):
    """The six kinds of part."""

    ACCELERATOR = "accelerator"
    ENVIRONMENT = "environment"
    LAUNCHER = "launcher"
    COLLECTIVE = "collective"
    PRECISION = "precision"
    STRATEGY = "strategy"

    def __str__(self) -> str:
        return self.value


class _Frozen(dict):  # type: ignore[type-arg]
    """A spec's options: a dict that refuses changes and pickles (a
    strategy built from a plan crosses to spawned ranks with it; a
    ``MappingProxyType`` cannot be pickled)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a spec's options are read-only; make a new spec with other options")

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Frozen, (dict(self),))

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=repr)))


def _freeze(options: Mapping[str, Any]) -> Mapping[str, Any]:
    return _Frozen(options)


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What every spec has.

    Attributes:
        name: the name users type (``"ddp"``, ``"bf16-mixed"``). Letters,
            digits, ``_ . -``; no ``:``, which separates a distribution from a
            name in qualified names (``"phalanx-torch:ddp"``).
        target: ``"package.module:Class"``, imported only when the part is
            used.
        summary: one line for ``phalanx list``.
        needs: import names the part needs, each with the versions it
            supports where it matters (``("torch>=2.9",)``, see
            :class:`Need`); checked without importing anything.
        install: what to run when ``needs`` are missing
            (``"pip install 'phalanx-horovod[horovod]'"``).
        options: keyword arguments given to the target's constructor, unless
            the user gives the same one.
        priority: higher wins when ``"auto"`` chooses between parts, and
            decides the order of environment detection.
        aliases: other names that mean this part (``"bf16"`` for
            ``"bf16-mixed"``).
    """

    kind: ClassVar[Kind]

    name: str
    target: str
    summary: str = ""
    needs: tuple[str, ...] = ()
    install: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    priority: int = 0
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for label, value in (("name", self.name), *(("alias", a) for a in self.aliases)):
            if not isinstance(value, str) or not _NAME.match(value):
                raise ValueError(
                    f"{type(self).__name__} {label} {value!r} is not a valid name: use letters, "
                    "digits and '_', '.', '-' (no ':', which separates a distribution from a name)"
                )
        if not isinstance(self.target, str) or not _TARGET.match(self.target):
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: target {self.target!r} is not of the form "
                "'package.module:attribute'"
            )
        if isinstance(self.needs, str) or not all(isinstance(n, str) for n in self.needs):
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: needs must be a tuple of import names, "
                f"got {self.needs!r}"
            )
        for need in self.needs:
            try:
                Need.parse(need)
            except ValueError as exc:
                raise ValueError(f"{type(self).__name__} {self.name!r}: {exc}") from None
        if not isinstance(self.options, Mapping):
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: options must be a mapping, got "
                f"{type(self.options).__name__}"
            )
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: priority must be an int, got {self.priority!r}"
            )
        object.__setattr__(self, "needs", tuple(self.needs))
        object.__setattr__(self, "aliases", tuple(self.aliases))
        object.__setattr__(self, "options", _freeze(self.options))


@dataclass(frozen=True, kw_only=True)
class AcceleratorSpec(Spec):
    """An :class:`~phalanx_core.Accelerator`: the hardware."""

    kind: ClassVar[Kind] = Kind.ACCELERATOR


@dataclass(frozen=True, kw_only=True)
class EnvironmentSpec(Spec):
    """A :class:`~phalanx_core.ClusterEnvironment`: where ranks come from.

    Environments are detected in order of ``priority``, highest first; the
    first whose ``detect()`` is true is used. Give the default environment
    (one that always detects) the lowest priority.
    """

    kind: ClassVar[Kind] = Kind.ENVIRONMENT


@dataclass(frozen=True, kw_only=True)
class LauncherSpec(Spec):
    """A :class:`~phalanx_core.Launcher`: how processes come to exist.

    Attributes:
        interactive: the launcher works in a notebook or REPL (it does not
            re-run a script).
        creates_processes: the launcher makes processes. Launchers that do
            not (``in_process``) are the ones used where a cluster
            environment already made them (torchrun, srun, mpirun).
        environment: the environment its ranks run in, used instead of
            detection when this launcher is chosen and no environment is
            named (``ray``: the ranks are Ray actors, and the process that
            launches them is no rank of any scheduler). A scheduler detected
            here that already started the processes still wins (inside the
            ranks, that is this same environment).
    """

    kind: ClassVar[Kind] = Kind.LAUNCHER
    interactive: bool = False
    creates_processes: bool = True
    environment: str | None = None


@dataclass(frozen=True, kw_only=True)
class CollectiveSpec(Spec):
    """A :class:`~phalanx_core.Collective`: how ranks talk.

    Attributes:
        parts: for a collective made of other collectives, the option that
            names each and its default (``{"inner": "torch"}``): ``phalanx
            explain`` shows each part and its package, chosen as
            ``collective=`` would be, without importing anything.
        variants: names of what this collective speaks that users type as
            a collective (c10d's ``"gloo"``), mapped to the options that
            choose it (``{"backend": "gloo"}``). They do not resolve:
            asking for one is an error that names the call to make instead.
        fault_tolerance: what the collective can do when its peers come and
            go (``"liveness"``, ``"reconfigure"``, ``"shrink"``), as its
            class declares it (``Collective.fault_tolerance``): read when
            resolving, without importing it. A composed collective has what
            it declares and every one of its parts has.
    """

    kind: ClassVar[Kind] = Kind.COLLECTIVE
    parts: Mapping[str, str] = field(default_factory=dict)
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    fault_tolerance: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        _freeze_variants(self)
        _freeze_capabilities(self, "fault_tolerance")
        if not isinstance(self.parts, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.parts.items()
        ):
            raise ValueError(
                f"CollectiveSpec {self.name!r}: parts must map option names to collective names, "
                f"got {self.parts!r}"
            )
        object.__setattr__(self, "parts", _freeze(self.parts))


@dataclass(frozen=True, kw_only=True)
class PrecisionSpec(Spec):
    """A :class:`~phalanx_core.Precision`: numerics (``"bf16-mixed"``)."""

    kind: ClassVar[Kind] = Kind.PRECISION


@dataclass(frozen=True, kw_only=True)
class StrategySpec(Spec):
    """A :class:`~phalanx_core.Strategy`: the composition, and its default parts.

    Attributes:
        launcher: the launcher used when the user names none.
        collective: the collective used when the user names none.
        environment: an environment to use instead of detection, or ``None``
            to detect one.
        accelerators: the accelerators this strategy works with; empty means
            any. A user asking for another one gets an error.
        parallel: the strategy runs one process per device and can use more
            than one device; a strategy that is not parallel uses exactly one.
        traffic: where the strategy's training traffic goes, in one line per
            collective name, for ``phalanx explain``; the key ``"*"`` stands
            for any other collective, and ``{collective}`` in a line for the
            collective's name (``{"torch": "its own c10d group", "*": "the
            {collective!r} collective, as a ProcessGroup"}``), and
            ``{across}`` for the collective between replica groups (see
            ``collective_needs``). Empty: the strategy does not say.
        variants: names other libraries give this strategy with options
            (Fabric's ``"ddp_find_unused_parameters_true"``), mapped to the
            keywords of :func:`phalanx.resolve` they stand for
            (``{"find_unused_parameters": True}``). They do not resolve:
            asking for one is an error that names the call to make instead.
        collective_needs: the fault-tolerance capabilities its collective
            must have (``("liveness", "reconfigure")`` for a strategy whose
            replicas come and go): resolving refuses a collective that lacks
            one, naming it and the installed collectives that have it. Such
            a strategy gets a second collective of the same kind, never set
            up, to reconfigure (its ``across`` argument).
    """

    kind: ClassVar[Kind] = Kind.STRATEGY
    launcher: str = "in_process"
    collective: str = "single_device"
    environment: str | None = None
    accelerators: tuple[str, ...] = ()
    parallel: bool = False
    traffic: Mapping[str, str] = field(default_factory=dict)
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    collective_needs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        _freeze_variants(self)
        _freeze_capabilities(self, "collective_needs")
        object.__setattr__(self, "accelerators", tuple(self.accelerators))
        if not isinstance(self.traffic, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.traffic.items()
        ):
            raise ValueError(
                f"StrategySpec {self.name!r}: traffic must map collective names (or '*') to one line "
                f"of text each, got {self.traffic!r}"
            )
        object.__setattr__(self, "traffic", _freeze(self.traffic))

    def traffic_through(self, collective: str, *, across: str | None = None) -> str | None:
        """The ``traffic`` line for ``collective`` (a name), or ``None``.
        ``across``: the collective between replica groups, where the
        strategy has one (``{across}`` in a line; the line of
        ``collective`` is the one for both where it is the same, else
        ``"*"``'s)."""
        key = collective if across in (None, collective) else "*"
        line = self.traffic.get(key, self.traffic.get("*"))
        return None if line is None else line.format(collective=collective, across=across or collective)


SPEC_TYPES: dict[Kind, type[Spec]] = {
    Kind.ACCELERATOR: AcceleratorSpec,
    Kind.ENVIRONMENT: EnvironmentSpec,
    Kind.LAUNCHER: LauncherSpec,
    Kind.COLLECTIVE: CollectiveSpec,
    Kind.PRECISION: PrecisionSpec,
    Kind.STRATEGY: StrategySpec,
}


def _freeze_capabilities(spec: Any, name: str) -> None:
    """Check a spec's fault-tolerance capabilities and keep them as a
    sorted tuple."""
    from ._membership import check_capabilities

    try:
        found = check_capabilities(getattr(spec, name), where=f"{type(spec).__name__} {spec.name!r}: {name}")
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    object.__setattr__(spec, name, tuple(sorted(found)))


def _freeze_variants(spec: Any) -> None:
    """Check and freeze a spec's ``variants`` (name -> resolve() keywords)."""
    if not isinstance(spec.variants, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Mapping) for k, v in spec.variants.items()
    ):
        raise ValueError(
            f"{type(spec).__name__} {spec.name!r}: variants must map names to the resolve() keywords "
            f"they stand for, got {spec.variants!r}"
        )
    object.__setattr__(spec, "variants", _freeze({k: _freeze(v) for k, v in spec.variants.items()}))
