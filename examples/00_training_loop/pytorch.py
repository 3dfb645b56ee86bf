# The training loop of loopback.cpp in PyTorch, one rank per process under torchrun:
# each rank fits y = sum(x) + rank on its own data, and the ranks gossip over UCX.
# Run from the repository root: UCX_NET_DEVICES=lo PYTHONPATH=build/python \
#        /usr/bin/python3 -m torch.distributed.run --nproc_per_node 4 --redirects 2 --tee 2 examples/00_training_loop/pytorch.py
import os

import torch

import gossip

rank = int(os.environ["RANK"])
torch.manual_seed(0)  # the same initial model on every rank
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
# The model's tensors, used in place; SGD's momentum buffers are registered ([engine] momentum).
# config: a TOML file ("run.toml") or the same sections as a dict.
eng = gossip.Engine(model.named_parameters(), optimizer=opt, config={"policy": {"name": "consensus"}})

data = torch.Generator().manual_seed(rank)
for step in range(400):
    x = torch.randn(32, 16, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) + rank)
    opt.zero_grad()
    loss.backward()
    opt.step()
    eng.step(lr=0.02, loss=loss.item())  # merge what peers sent, measure drift, decide, send
eng.finish()  # final exchange rounds (over UCX they bring the ranks closer, not to the exact average)

b = model.bias.item()
stats = eng.stats()  # the engine's report as a dict
# The ranks' average model is sum(w * x) / sum(w) over their push-sum weights w.
print(f"rank {rank}: b = {b:.2f} (its data alone: {rank}, all data: {(eng.world - 1) / 2}), w = {eng.weight:.3f}, "
      f"{stats['sends']} sends of {stats['steps']} steps, {stats['bytes_sent']} bytes sent")
