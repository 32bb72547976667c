"""accelerate + FSDP2 training that evaluates, then checkpoints and resumes.

Needs accelerate and transformers besides torch and the backport (tested with
accelerate 1.16.0 and transformers 5.25.0: ``pip install accelerate==1.16.0
transformers==5.25.0``).

    accelerate launch --use_fsdp --fsdp_version 2 \\
        examples/accelerate_fsdp2_eval_checkpoint.py

On a machine without GPUs, accelerate does not turn FSDP on; ``--cpu-fsdp``
sets its distributed state to FSDP2 by hand so the same script runs on CPU:

    torchrun --nproc-per-node 2 examples/accelerate_fsdp2_eval_checkpoint.py --cpu-fsdp

``--without-backport`` skips ``backport.apply()`` to show the bug: the first
checkpoint raises ``KeyError`` and the script exits with status 1. Checkpoints
go to a new temporary folder, removed at the end (after a failure too), unless
``--output-dir`` names one (kept).

The model is a tiny Llama built from a config (no download). Every
``--eval-every`` steps it evaluates under ``torch.no_grad()`` and then saves the
optimizer state with accelerate's ``save_fsdp_optimizer``: without the backport
that call raises ``KeyError`` because the root and the [norm, lm_head] group
stay unsharded after the evaluation. At the end it resumes from the last
checkpoint into a fresh model and checks that training continues identically.
"""

import argparse
import gc
import shutil
import sys
import tempfile
import traceback

import torch
import torch.distributed
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import (
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from transformers import LlamaConfig, LlamaForCausalLM

import backport


VOCAB = 128


def build(args, seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=args.tied,
    )
    model = LlamaForCausalLM(config)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(cpu=args.cpu_fsdp, fsdp_plugin=None if args.cpu_fsdp else plugin)
    if args.cpu_fsdp:
        # What accelerate sets on GPUs; on CPU it leaves FSDP off.
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    plugin = accelerator.state.fsdp_plugin
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optim = accelerator.prepare(model, optim)
    return accelerator, plugin, model, optim


def batch(step: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (4, 16), generator=gen).to(device)


def train_step(accelerator, model, optim, step: int) -> float:
    ids = batch(step, accelerator.device)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optim.step()
    optim.zero_grad()
    return loss.item()


def evaluate(accelerator, model) -> float:
    model.eval()
    with torch.no_grad():
        ids = batch(-1, accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss.item()
    model.train()
    return loss


def checkpoint(accelerator, plugin, model, optim, path: str) -> None:
    # The optimizer first: model.state_dict() would reshard the model and hide the bug.
    save_fsdp_optimizer(plugin, accelerator, optim, model, path)
    save_fsdp_model(plugin, accelerator, model, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--output-dir", help="kept at the end (default: a temporary folder)")
    parser.add_argument("--tied", action="store_true", help="tie embeddings and lm_head")
    parser.add_argument("--cpu-fsdp", action="store_true", help="run FSDP2 on CPU (gloo)")
    parser.add_argument("--without-backport", action="store_true",
                        help="do not call backport.apply(): the first checkpoint fails")
    return parser.parse_args()


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def shared_temp_dir() -> str:
    """A new temporary folder, made on rank 0, whose name every rank gets."""
    name = [tempfile.mkdtemp(prefix="fsdp2_eval_ckpt_") if rank() == 0 else None]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def remove_shared_temp_dir(path: str) -> None:
    """Rank 0 removes shared_temp_dir()'s folder; every rank calls this, on failure too.

    The first barrier waits until no rank writes to the folder: without the
    backport every rank fails at the same checkpoint, but a slower one may still
    be making its folder in it. The second keeps every rank from exiting before
    the removal: the launcher stops them all once one exits with an error. (A
    failure on one rank only would wait here until the process group's timeout.)
    """
    barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()


def run(args, accelerator, plugin, model, optim, output_dir: str) -> None:
    losses, last_ckpt = {}, None
    for step in range(args.steps):
        losses[step] = train_step(accelerator, model, optim, step)
        if (step + 1) % args.eval_every == 0:
            eval_loss = evaluate(accelerator, model)
            last_ckpt = (step, f"{output_dir}/step_{step}")
            try:
                checkpoint(accelerator, plugin, model, optim, last_ckpt[1])
            except KeyError as err:
                if not args.without_backport:
                    raise
                traceback.print_exc()
                # One write: print() writes the newline apart, and the ranks share stderr.
                sys.stderr.write(f"rank {rank()}: without the backport, "
                                 f"saving the optimizer after the evaluation raised KeyError: "
                                 f"{err} (the bug backport.apply() fixes)\n")
                raise SystemExit(1) from err
            accelerator.print(f"step {step}: eval loss {eval_loss:.4f}, saved {last_ckpt[1]}")
    accelerator.print("losses:", [round(loss, 6) for loss in losses.values()])
    if last_ckpt is None:
        return

    # Resume into a differently initialized model, evaluated before it loads.
    step, path = last_ckpt
    accelerator, plugin, resumed, resumed_optim = build(args, seed=1)
    evaluate(accelerator, resumed)
    load_fsdp_model(plugin, accelerator, resumed, path)
    load_fsdp_optimizer(plugin, accelerator, resumed_optim, resumed, path)
    for extra in range(args.steps, args.steps + 2):
        losses[extra] = train_step(accelerator, model, optim, extra)
    for replay in range(step + 1, args.steps + 2):
        resumed_loss = train_step(accelerator, resumed, resumed_optim, replay)
        same = resumed_loss == losses[replay]
        accelerator.print(f"step {replay}: resumed loss {resumed_loss:.6f} == original: {same}")
        if not same:
            raise SystemExit("resumed training diverged from the original run")


def main() -> None:
    args = parse_args()
    if not args.without_backport:
        backport.apply()  # on every rank, before anything checkpoints
    accelerator, plugin, model, optim = build(args, seed=0)
    accelerator.print(backport.status())
    output_dir = args.output_dir or shared_temp_dir()
    try:
        run(args, accelerator, plugin, model, optim, output_dir)
    finally:
        if args.output_dir is None:
            remove_shared_temp_dir(output_dir)


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
