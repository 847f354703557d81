"""A ready precision meets its strategy's accelerator: made for another one,
it is refused; made without one, it is bound to the strategy's and checked
as the registry's own would be."""

from __future__ import annotations

import pytest

from phalanx_core import MisconfigurationError, Precision


class Acc:
    def __init__(self, name: str) -> None:
        self.name = name


class NoHalfOnCPU(Precision):
    name = "16-mixed"

    def validate(self) -> None:
        if self.accelerator.name == "cpu":
            raise MisconfigurationError("precision '16-mixed' on accelerator 'cpu': use 'bf16-mixed'")


def test_made_for_another_accelerator_is_refused():
    with pytest.raises(
        MisconfigurationError, match=r"made for accelerator 'cuda', and the strategy runs on 'cpu'"
    ):
        NoHalfOnCPU(accelerator=Acc("cuda")).check_accelerator(Acc("cpu"))


def test_made_without_one_is_bound_and_validated():
    cuda = Acc("cuda")
    precision = NoHalfOnCPU()
    precision.check_accelerator(cuda)
    assert precision.accelerator is cuda
    with pytest.raises(MisconfigurationError, match="on accelerator 'cpu'"):
        NoHalfOnCPU().check_accelerator(Acc("cpu"))


def test_the_constructor_validates_when_given_an_accelerator():
    with pytest.raises(MisconfigurationError, match="on accelerator 'cpu'"):
        NoHalfOnCPU(accelerator=Acc("cpu"))
    same = Acc("cuda")
    NoHalfOnCPU(accelerator=same).check_accelerator(Acc("cuda"))  # another object, the same accelerator
