"""phalanx-torch: torch accelerators, collectives, precisions, launchers,
environments and strategies for phalanx.

The package's entry module (:mod:`phalanx_torch.plugin`) imports no torch;
the modules that hold the parts import it when a part is used.
"""

__version__ = "0.1.0"
