"""phalanx-horovod: Horovod parts for phalanx."""
