"""What the nodes of a job share: where they meet (node 0's store or
etcd), the rounds they meet in, the launch's ledger, the heartbeat and the
node watch."""
