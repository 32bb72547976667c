# Minimal CPU repro for the upstream issue:
#   torchrun --nproc-per-node 2 torch_patch/repro.py
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
fully_shard(model[0], mesh=mesh)
fully_shard(model, mesh=mesh)  # root: reshard_after_forward defaults to False
optim = torch.optim.Adam(model.parameters())

model(torch.randn(2, 8)).sum().backward()
optim.step()
get_optimizer_state_dict(model, optim)  # works: backward resharded every group

with torch.no_grad():
    model(torch.randn(2, 8))  # evaluation: the root stays unsharded
get_optimizer_state_dict(model, optim)  # KeyError: 2 (the id of the root's first param)
dist.destroy_process_group()
