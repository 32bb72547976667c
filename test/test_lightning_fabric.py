"""Lightning Fabric 2.6.6 (ModelParallelStrategy, FSDP2): save and load after an evaluation, 2 ranks.

Fabric's own ``fabric.save`` / ``fabric.load`` run unchanged. What CPU needs: ``accelerator="cpu"``
(Fabric then picks gloo), and the ranks come from ``_ranks.run_ranks`` (test/_ranks.py) with torchrun's
environment, so ``fabric.launch()`` joins that process group instead of spawning processes.
"""

from __future__ import annotations

import unittest
from importlib.util import find_spec
from pathlib import Path

import expecttest
import pytest
import torch
import torch.nn.functional as F

from _fsdp_cases import (
    TinyLM,
    batch,
    clone,
    evaluate,
    get_model_state_dict,
    get_optimizer_state_dict,
    outcome_of,
    perturb,
    restored_by,
    run_agreed_before_after,
    shard_blocks_then_root,
    unpatched_then_patched,
)


pytestmark = [pytest.mark.ranks, pytest.mark.fresh_ranks, pytest.mark.frameworks]


def _parallelize(model, device_mesh):
    return shard_blocks_then_root(model, device_mesh["data_parallel"])


def _setup(save_distributed_checkpoint: bool, parallelize_fn=_parallelize):
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize_fn,
        data_parallel_size=2,
        tensor_parallel_size=1,
        save_distributed_checkpoint=save_distributed_checkpoint,
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(TinyLM())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens, targets = batch(0)
    fabric.backward(F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
    optimizer.step()
    optimizer.zero_grad()
    return fabric, model, optimizer


def _states(model, optimizer) -> dict:
    # Fabric wraps both; DCP's view of the unwrapped objects is what Fabric saves.
    return {
        "model": clone(get_model_state_dict(model.module)),
        "optim": clone(get_optimizer_state_dict(model.module, optimizer.optimizer)),
    }


def _save_then_load(path: Path, sharded: bool, optimizer_first: bool) -> list[str]:
    """Train a step, evaluate, fabric.save; then perturb, evaluate, fabric.load."""
    fabric, model, optimizer = _setup(save_distributed_checkpoint=sharded)
    saved = _states(model, optimizer)
    evaluate(model)
    state = {"optimizer": optimizer, "model": model} if optimizer_first else {
        "model": model, "optimizer": optimizer
    }
    kind = "sharded" if sharded else "full"
    order = "{optimizer, model}" if optimizer_first else "{model, optimizer}"
    saved_outcome = outcome_of(lambda: fabric.save(path, state))
    lines = [f"{kind} {order}: save after eval -> {saved_outcome}"]
    # The outcome, shared by every rank, decides; files a failed save left do not.
    if saved_outcome != "ok":
        return lines
    outcome = perturb_then_load(fabric, path, model, optimizer, saved, evaluated=True)
    lines.append(f"{kind} {order}: load after eval -> {outcome}")
    return lines


def perturb_then_load(fabric, path: Path, model, optimizer, saved: dict, evaluated: bool) -> str:
    """Perturb the states, evaluate if asked, fabric.load; how well ``saved`` came back."""
    perturb(model.module, [optimizer.optimizer])
    if evaluated:
        evaluate(model)
    return restored_by(
        lambda: fabric.load(path, {"model": model, "optimizer": optimizer}),
        lambda: _states(model, optimizer),
        saved,
    )


def fabric_worker(checkpoint_dir: str) -> dict[str, str]:
    def run(label: str) -> str:
        lines = []
        for sharded in (True, False):
            for optimizer_first in (True, False):
                path = Path(checkpoint_dir) / f"{label}-{sharded}-{optimizer_first}"
                lines += _save_then_load(path, sharded, optimizer_first)
        return "\n".join(lines)

    return unpatched_then_patched(run)


@unittest.skipUnless(
    find_spec("lightning_fabric"), "needs the frameworks extra (nox: torch 2.13.0)"
)
class LightningFabricTest(expecttest.TestCase):
    def test_save_and_load_after_evaluation(self) -> None:
        self.assertExpectedInline(run_agreed_before_after(fabric_worker), """\
                                            | stock -> backport applied
sharded {optimizer, model}: save after eval | KeyError: 0 -> ok
sharded {model, optimizer}: save after eval | ok
sharded {model, optimizer}: load after eval | restored exactly
full {optimizer, model}: save after eval    | KeyError: 0 -> ok
full {model, optimizer}: save after eval    | ok
full {model, optimizer}: load after eval    | RuntimeError: Error(s) in loading state_dict for Embedding: -> restored exactly
sharded {optimizer, model}: load after eval | - -> restored exactly
full {optimizer, model}: load after eval    | - -> restored exactly""")


if __name__ == "__main__":
    unittest.main()
