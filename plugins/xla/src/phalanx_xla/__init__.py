"""phalanx-xla: torch_xla parts for phalanx (see ``phalanx_xla.plugin``)."""

__version__ = "0.1.0"
