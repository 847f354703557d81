from __future__ import annotations

import pytest

from phalanx_core import MisconfigurationError, parse_device_indices


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("auto", [0, 1, 2, 3]),
        (-1, [0, 1, 2, 3]),
        ("-1", [0, 1, 2, 3]),
        (2, [0, 1]),
        ("2", [0, 1]),
        ([0, 3], [0, 3]),
        ("0,2", [0, 2]),
        ("1,", [1]),
    ],
)
def test_device_flags(flag, expected):
    assert parse_device_indices(flag, 4, accelerator="cuda") == expected


@pytest.mark.parametrize(
    ("flag", "match"),
    [
        (5, r"asks for cuda device\(s\) \[4\], but this machine has 4 cuda device\(s\)"),
        ([0, 0], "names a device more than once"),
        (0, "ask for at least 1 device"),
        ("x", "expected an int, a comma list"),
        (True, "expected an int"),
        (2.0, "expected an int"),
        ([], "selects no device"),
    ],
)
def test_bad_device_flags(flag, match):
    with pytest.raises(MisconfigurationError, match=match):
        parse_device_indices(flag, 4, accelerator="cuda")


def test_an_accelerator_says_its_device_type_or_its_name_stands_for_it():
    from phalanx_core import Accelerator, Availability

    class Named(Accelerator):
        name = "cuda"

        @classmethod
        def availability(cls) -> Availability:
            return Availability(True)

        @classmethod
        def device_count(cls) -> int:
            return 1

        def get_device(self, index: int) -> str:
            return f"cuda:{index}"

    class Renamed(Named):  # a third party's accelerator of the same devices
        name = "my_gpu"

    class Saying(Named):
        name = "custom_acc_name"
        device_type = "cpu"

    assert (Named.device_type, Renamed.device_type, Saying.device_type) == ("cuda", "cuda", "cpu")
    assert Saying().device_type == "cpu"
