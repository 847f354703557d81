"""A DDP training script as it is usually written (an epoch loop with
``set_epoch``, a DataLoader with workers), that runs unchanged under
``ddp`` and under ``ddp_ft`` (see docs/content/torchft.md):

    phalanx run --strategy ddp --devices 2 --accelerator cpu examples/train_ft.py
    phalanx run --strategy ddp_ft --replica-groups 3 --devices 1 --accelerator cpu examples/train_ft.py

Under ``ddp_ft`` a group that is lost is dropped at the next step while the
others train on, and started again: it copies the weights, the optimizer
and the loader's place (its epoch too) from a peer, and its script's epoch
loop goes on from the job's epoch.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx

strategy = phalanx.resolve()  # the flags of phalanx run
strategy.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
inputs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(0))
data = TensorDataset(inputs, inputs.sum(1, keepdim=True))
loader = strategy.setup_dataloader(DataLoader(data, batch_size=32, shuffle=True, num_workers=2))

for epoch in range(3):
    loader.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
    strategy.print(f"epoch {epoch}: loss {loss.item():.4f}")
