"""Rank 0 saves a checkpoint alone (the torch habit ``if master_process:``)
while rank 1 goes on to its next collective call: the two wait in
different calls. Run under ``phalanx run --hang-report S``; the
collective's timeout (``-o timeout=T``) ends it."""

import torch

import phalanx

strategy = phalanx.resolve()
strategy.launch()
model = strategy.setup(torch.nn.Linear(2, 2))
if strategy.is_global_zero:
    strategy.save_checkpoint("ckpt.pt", {"model": model})
strategy.all_reduce(torch.ones(1))
