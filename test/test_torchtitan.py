"""torchtitan 0.2.2 CheckpointManager: save and load after a validation forward, 2 ranks.

torchtitan's own ``CheckpointManager``, ``ModelWrapper`` and ``OptimizersContainer`` (which calls
``get_optimizer_state_dict`` with ``flatten_optimizer_state_dict=True``) run unchanged. What CPU
needs: the device mesh is built with ``init_device_mesh("cpu", ...)`` and the model sharded with
plain ``fully_shard`` instead of torchtitan's ``parallelize`` functions (which expect GPUs); the
ranks come from ``_ranks.run_ranks`` (test/_ranks.py). ``import torchtitan`` needs ``triton`` installed.
"""

from __future__ import annotations

import tempfile
import unittest
from importlib.util import find_spec
from pathlib import Path

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from _fsdp_cases import (
    TinyLM,
    batch,
    clone,
    differences,
    evaluate,
    outcome_of,
    perturb,
    render_before_after,
    run_agreed,
    unpatched_then_patched,
)


pytestmark = [pytest.mark.ranks, pytest.mark.fresh_ranks]


def _setup(folder: Path):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config import Checkpoint

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    # The root keeps the default reshard_after_forward: unsharded after a forward.
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2})
    lr_schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0)
    tokens, targets = batch(0)
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    optimizers.step()
    lr_schedulers.step()
    optimizers.zero_grad()
    manager = CheckpointManager(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={},
        checkpoint_config=Checkpoint(enable=True, folder="checkpoint", interval=1),
        sd_adapter=None,
        base_folder=str(folder),
    )
    return model, optimizers, manager


def titan_worker(folder: str) -> dict[str, str]:
    def run(label: str) -> str:
        run_dir = Path(folder) / label
        model, optimizers, manager = _setup(run_dir)
        saved = clone(optimizers.state_dict())
        evaluate(model)
        saved_outcome = outcome_of(lambda: manager.save(curr_step=1))
        lines = [f"save after validation -> {saved_outcome}"]
        # Decided by the outcome, which every rank shares, not by the files a
        # failed save may have left: the ranks must run the same collectives.
        if saved_outcome != "ok":
            # Reshard through FSDP2's state_dict hooks and save again, so the
            # load below still has a checkpoint to read.
            model.state_dict()
            manager.save(curr_step=1)
        perturb(model, list(optimizers))
        evaluate(model)
        outcome = outcome_of(lambda: manager.load(step=1))
        if outcome == "ok":
            diffs = differences(optimizers.state_dict(), saved)
            outcome = "optimizer state restored " + (
                "exactly" if not diffs else f"differs at {diffs[:3]}"
            )
        lines.append(f"load after validation -> {outcome}")
        manager.close()
        return "\n".join(lines)

    return unpatched_then_patched(run)


@unittest.skipUnless(
    find_spec("torchtitan") and find_spec("triton"),
    "needs the frameworks extra (nox: torch 2.13.0)",
)
class TorchtitanTest(expecttest.TestCase):
    def test_save_and_load_after_validation(self) -> None:
        with tempfile.TemporaryDirectory() as folder:
            result = run_agreed(2, titan_worker, folder)
        self.assertExpectedInline(render_before_after(result, " -> "), """\
                      | stock -> backport applied
save after validation | KeyError: 0 -> ok
load after validation | KeyError: 0 -> optimizer state restored exactly""")


if __name__ == "__main__":
    unittest.main()
