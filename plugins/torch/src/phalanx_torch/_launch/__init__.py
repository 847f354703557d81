"""Running a job's ranks on a node: the ``subprocess`` launcher, its agent
loop on torch elastic's public process layer, what a node says of failed
ranks, the ranks' side, where sockets listen, and the variables of the
schedulers phalanx runs under."""
