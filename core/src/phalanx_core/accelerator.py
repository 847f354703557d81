"""The Accelerator interface: the hardware a rank computes on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import MisconfigurationError, UnavailableError

__all__ = ["Accelerator", "Availability", "DevicesFlag", "parse_device_indices"]

#: What users may pass as ``devices``: a count, ``-1`` (all), ``"auto"``, a
#: list of indices, or a comma string of indices (``"0,2"``).
DevicesFlag = int | str | Sequence[int]


@dataclass(frozen=True)
class Availability:
    """Whether a part can be used here, and if not, why and what to do."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


def parse_device_indices(devices: DevicesFlag, count: int, *, accelerator: str) -> list[int]:
    """Turn a ``devices`` flag into a list of device indices, given ``count``
    devices of this kind here.

    ``"auto"`` and ``-1`` mean all ``count`` devices; an int ``n`` means the
    first ``n``; a list or ``"0,2"`` means those indices. Raises
    :class:`MisconfigurationError` for a flag that asks for devices that do
    not exist, naming how many do.
    """
    if isinstance(devices, bool):
        raise MisconfigurationError(
            f"devices={devices!r}: expected an int, a list of ints, a string like '0,2', or 'auto'"
        )
    if devices == "auto" or devices == -1 or devices == "-1":
        indices = list(range(count))
    elif isinstance(devices, int):
        if devices < 1:
            raise MisconfigurationError(
                f"devices={devices}: ask for at least 1 device, or -1 / 'auto' for all of them"
            )
        indices = list(range(devices))
    elif isinstance(devices, str):
        try:
            if "," in devices:
                indices = [int(part) for part in devices.split(",") if part.strip()]
            else:
                return parse_device_indices(int(devices), count, accelerator=accelerator)
        except ValueError:
            raise MisconfigurationError(
                f"devices={devices!r}: expected an int, a comma list of device indices like '0,2', or 'auto'"
            ) from None
    elif isinstance(devices, Sequence) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in devices
    ):
        indices = [int(i) for i in devices]
    else:
        raise MisconfigurationError(
            f"devices={devices!r}: expected an int, a list of ints, a string like '0,2', or 'auto'"
        )
    if not indices:
        raise MisconfigurationError(f"devices={devices!r} selects no device; ask for at least one")
    if len(set(indices)) != len(indices):
        raise MisconfigurationError(f"devices={devices!r} names a device more than once")
    bad = [i for i in indices if i < 0 or i >= count]
    if bad:
        raise MisconfigurationError(
            f"devices={devices!r} asks for {accelerator} device(s) {bad}, but this machine has "
            f"{count} {accelerator} device(s) (indices 0..{count - 1}); ask for fewer"
        )
    return indices


class Accelerator(ABC):
    """The hardware: which devices exist, and how to use one.

    Constructed by the registry with the spec's options as keyword arguments.
    An accelerator is stateless apart from its options; the strategy calls
    :meth:`setup_device` once in each rank.

    Attributes:
        name: the accelerator's name in the registry (``"cpu"``,
            ``"cuda"``).
        device_type: torch's type of its devices (``torch.device(...).type``:
            ``"cpu"``, ``"cuda"``), which collectives and precisions go by;
            the ``name`` where a class does not say (a third party's
            ``"my_gpu"`` accelerator of ``"cuda"`` devices sets it).
        collective_backend: the default backend for a collective on this
            device, in torch.distributed's terms (``"gloo"`` for cpu,
            ``"nccl"`` for cuda); ``None`` where the device has its own.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    collective_backend: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The first class that names itself, and says no device type, has
        # devices of its name's type; its subclasses inherit that type.
        if not hasattr(cls, "device_type") and isinstance(cls.__dict__.get("name"), str):
            cls.device_type = cls.__dict__["name"]

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Say whether this accelerator can be used here, and if not why.

        Must not raise: a missing backend is ``Availability(False, "torch is
        not installed: pip install torch")``.
        """

    @classmethod
    def is_available(cls) -> bool:
        """``bool(cls.availability())``."""
        return cls.availability().available

    @classmethod
    def check_available(cls) -> None:
        """Raise :class:`~phalanx_core.UnavailableError` with the reason
        when this accelerator cannot be used here. A hardware accelerator
        calls it in its constructor, so that naming it where it is missing
        fails when the strategy is built, never later."""
        availability = cls.availability()
        if not availability:
            raise UnavailableError(f"accelerator {cls.name!r} cannot be used here: {availability.reason}")

    @classmethod
    @abstractmethod
    def device_count(cls) -> int:
        """Return how many devices of this kind this machine has (what
        ``devices="auto"`` uses)."""

    def parallel_devices(self, devices: DevicesFlag) -> list[Any]:
        """Return the devices to use, one per local rank, for a ``devices``
        flag (``2``, ``[0, 3]``, ``"0,3"``, ``-1``, ``"auto"``).

        Raises :class:`MisconfigurationError` for a flag that asks for
        devices this machine does not have. The default parses indices with
        :func:`parse_device_indices` against :meth:`device_count` and maps
        them with :meth:`get_device`.
        """
        indices = parse_device_indices(devices, self.device_count(), accelerator=self.name)
        return [self.get_device(i) for i in indices]

    @abstractmethod
    def get_device(self, index: int) -> Any:
        """Return the device object for index ``index`` (``torch.device("cuda", 1)``)."""

    def setup_device(self, device: Any) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Make ``device`` this process's current device. Called once per
        rank, before the collective is set up."""

    def teardown(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Release what :meth:`setup_device` took."""
