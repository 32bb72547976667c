"""Lightning Fabric + FSDP2 training that evaluates, then checkpoints and resumes.

Needs Lightning Fabric besides torch and the backport (tested with the one in
pytorch-lightning 2.6.6: ``pip install pytorch-lightning==2.6.6``).

    fabric run --devices 2 examples/fabric_fsdp2_eval_checkpoint.py
    torchrun --nproc-per-node 2 examples/fabric_fsdp2_eval_checkpoint.py --cpu   # no GPU

Every ``--eval-every`` steps the model is evaluated under ``torch.no_grad()`` and
a checkpoint is saved right away with ``fabric.save(path, {"optimizer": ...,
"model": ...})``. Without the backport that raises ``KeyError`` because the root
FSDP group stays unsharded after the evaluation; with ``--full-checkpoint``
(``save_distributed_checkpoint=False``) loading it after an evaluation fails
with "mixed torch.Tensor and DTensor". At the end the script evaluates once more,
loads the first checkpoint into the same model and checks that training then
continues exactly as it did after that checkpoint was taken.

``--without-backport`` skips ``backport.apply()`` to show the bug: the first
``fabric.save`` raises ``KeyError`` and the script exits with status 1.
Checkpoints go to a new temporary folder, removed at the end (after a failure
too), unless ``--output-dir`` names one (kept).
"""

import argparse
import gc
import os
import shutil
import sys
import tempfile
import traceback

import torch
import torch.distributed
import torch.nn as nn
import torch.nn.functional as F
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

import backport


VOCAB, DIM = 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def parallelize(model: TinyLM, device_mesh) -> TinyLM:
    mesh = device_mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    # The root keeps the default reshard_after_forward, which leaves it
    # unsharded after a forward until the next backward.
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=gen)
    return tokens, torch.roll(tokens, 1, dims=1)


def train_step(fabric, model, optimizer, step: int) -> float:
    tokens, targets = batch(step)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


@torch.no_grad()
def evaluate(model) -> float:
    model.eval()
    tokens, targets = batch(-1)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).item()
    model.train()
    return loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", help="kept at the end (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--full-checkpoint", action="store_true",
                        help="one consolidated file instead of a distributed checkpoint")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (gloo)")
    parser.add_argument("--without-backport", action="store_true",
                        help="do not call backport.apply(): the first checkpoint fails")
    return parser.parse_args()


def run(args, fabric, output_dir: str) -> None:
    torch.manual_seed(0)
    model = fabric.setup(TinyLM())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))

    losses, first = {}, None
    for step in range(1, args.steps + 1):
        losses[step] = train_step(fabric, model, optimizer, step)
        if step % args.eval_every == 0:
            eval_loss = evaluate(model)
            path = f"{output_dir}/step_{step}"
            # Optimizer first: the order Fabric's docs leave to the user.
            try:
                fabric.save(path, {"optimizer": optimizer, "model": model, "step": step})
            except KeyError as err:
                if not args.without_backport:
                    raise
                traceback.print_exc()
                # One write: print() writes the newline apart, and the ranks share stderr.
                sys.stderr.write(f"rank {fabric.global_rank}: without the backport, fabric.save "
                                 f"after the evaluation raised KeyError: {err} "
                                 "(the bug backport.apply() fixes)\n")
                raise SystemExit(1) from err
            fabric.print(f"step {step}: eval loss {eval_loss:.4f}, saved {path}")
            first = first or path

    # Resume: evaluate (the root is unsharded again), load the first checkpoint
    # into the trained model and replay the steps that followed it.
    evaluate(model)
    state = {"optimizer": optimizer, "model": model, "step": 0}
    fabric.load(first, state)
    for step in range(state["step"] + 1, args.steps + 1):
        loss = train_step(fabric, model, optimizer, step)
        fabric.print(f"step {step}: resumed loss {loss:.4f} == original: {loss == losses[step]}")


def main() -> None:
    args = parse_args()
    if not args.without_backport:
        backport.apply()  # on every rank, before anything checkpoints
    # On CPU "auto" means one device; take the launcher's process count instead.
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if args.cpu else "auto"
    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize,
        data_parallel_size=devices,
        tensor_parallel_size=1,
        save_distributed_checkpoint=not args.full_checkpoint,
    )
    fabric = Fabric(accelerator="cpu" if args.cpu else "auto", devices=devices, strategy=strategy)
    fabric.launch()
    fabric.print(backport.status())
    # A new folder made on rank 0, whose name every rank gets.
    output_dir = args.output_dir or fabric.broadcast(
        tempfile.mkdtemp(prefix="fsdp2_eval_ckpt_") if fabric.global_rank == 0 else None
    )
    os.makedirs(output_dir, exist_ok=True)  # a full checkpoint is a file in it
    try:
        run(args, fabric, output_dir)
    finally:
        if args.output_dir is None:
            # Every rank gets here, on failure too. Rank 0 removes the folder once
            # no rank writes to it (the first barrier) and before any rank exits
            # (the second): the launcher stops them all once one exits with an
            # error. (A failure on one rank only would wait here until the timeout.)
            fabric.barrier()
            if fabric.global_rank == 0:
                shutil.rmtree(output_dir, ignore_errors=True)
            fabric.barrier()


if __name__ == "__main__":
    try:
        main()
    finally:
        # A gloo group's worker threads that outlive the script can abort the
        # process at exit (upstream/c10d_issue/ISSUE.md): end the group on every path,
        # then free what main() left holding it, which joins those threads.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        gc.collect()
