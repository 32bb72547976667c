"""A gloo rank that aborts at exit although it called destroy_process_group().

    for i in $(seq 50); do torchrun --nproc-per-node 2 exit_race.py hold; done
    for i in $(seq 50); do torchrun --nproc-per-node 2 exit_race.py release; done

``hold`` keeps a reference to the group, as FSDP2's mesh info does for the
lifetime of the model; ``release`` drops it and collects garbage before exit.
An aborting run prints "terminate called without an active exception" (the
ranks' last lines may come before or after it), and torchrun reports exit code
-6 for that rank; the other rank may then show -15, stopped by torchrun.
"""

import gc
import sys

import torch
import torch.distributed as dist


dist.init_process_group("gloo")
rank = dist.get_rank()
held = dist.group.WORLD  # as FSDP2's mesh info holds its group
outputs = [torch.empty(4096) for _ in range(dist.get_world_size())]
dist.all_gather(outputs, torch.ones(4096))
dist.destroy_process_group()
if sys.argv[1:] == ["release"]:
    del held
    gc.collect()
print(f"rank {rank}: end of script", flush=True)
