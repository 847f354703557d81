"""The collective: phalanx-torch's, with every operation counted."""

from collections import Counter

from phalanx_core import OPERATIONS
from phalanx_torch.collectives import TorchCollective


class CountingCollective(TorchCollective):
    """Every operation of the contract, as the ``torch`` collective does it;
    ``calls`` counts them by name and ``tensor_bytes`` adds up the bytes of
    the tensors given to them. Options are the ``torch`` collective's
    (``timeout``, ``backend``)."""

    name = "counting"

    def __init__(self, **options):
        super().__init__(**options)
        self.calls = Counter()
        self.tensor_bytes = Counter()


def _counted(operation):
    inherited = getattr(TorchCollective, operation)

    def call(self, *args, **kwargs):
        self.calls[operation] += 1
        for arg in args:
            for tensor in arg if isinstance(arg, (list, tuple)) else [arg]:
                if hasattr(tensor, "element_size"):
                    self.tensor_bytes[operation] += tensor.element_size() * tensor.numel()
        return inherited(self, *args, **kwargs)

    call.__name__ = call.__qualname__ = operation
    call.__doc__ = inherited.__doc__
    return call


for _operation in OPERATIONS:
    setattr(CountingCollective, _operation, _counted(_operation))
