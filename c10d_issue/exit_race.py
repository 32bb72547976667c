"""A gloo rank that aborts at exit although it called destroy_process_group().

    for i in $(seq 10); do torchrun --nproc-per-node 2 c10d_issue/exit_race.py hold; done
    for i in $(seq 10); do torchrun --nproc-per-node 2 c10d_issue/exit_race.py release; done

``hold`` keeps a reference to the group, as FSDP2's mesh info does for the
lifetime of the model; ``release`` drops it and collects garbage before exit.
"""

import gc
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
held = dist.group.WORLD
outputs = [torch.empty(4096) for _ in range(dist.get_world_size())]
dist.all_gather(outputs, torch.ones(4096))
dist.destroy_process_group()
if sys.argv[1:] == ["release"]:
    del held
    gc.collect()
