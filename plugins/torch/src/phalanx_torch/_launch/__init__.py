"""Running a job's ranks on a node with torch elastic's agent: the
launch itself, the agent's changes, the ranks' side, where sockets listen,
and the variables of the schedulers phalanx runs under."""
