"""torchtitan's optimizer checkpoint after a validation forward, 2 ranks, per release line.

0.2.x (``TorchtitanTest``, run on 0.2.2): affected. torchtitan's own ``CheckpointManager``, ``ModelWrapper`` and ``OptimizersContainer`` (which calls
``get_optimizer_state_dict`` with ``flatten_optimizer_state_dict=True``) run unchanged. What CPU
needs: the device mesh is built with ``init_device_mesh("cpu", ...)`` and the model sharded with
plain ``fully_shard`` instead of torchtitan's ``parallelize`` functions (which expect GPUs); the
ranks come from ``_ranks.run_ranks`` (test/_ranks.py). ``import torchtitan`` needs ``triton`` installed.

0.3.x (``Torchtitan03Test``, run on 0.3.0): not affected. Its ``OptimizersContainer`` (now
``torchtitan.components.optimizer.optimizer``, built from a ``Config``) reads each optimizer's
state by the parameter names recorded at construction and never calls DSD, so ``dcp.save`` and
``dcp.load`` of it work on stock torch right after validation, while DSD's
``get_optimizer_state_dict`` on the same model still raises. No ``triton`` needed.

Each class runs only where its release line is installed and skips, naming the installed
version, elsewhere: the modules each imports exist in one line only.
"""

from __future__ import annotations

import tempfile
import unittest
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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

# None when torchtitan is not installed; the tests branch on the release line.
_TITAN = version("torchtitan") if find_spec("torchtitan") else None
_TITAN_LINE = ".".join(_TITAN.split(".")[:2]) if _TITAN else None


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


def _why_not_02() -> str | None:
    if _TITAN is None:
        return "needs torchtitan 0.2.x (the frameworks extra; nox: torch 2.13.0)"
    if _TITAN_LINE != "0.2":
        return (
            f"torchtitan {_TITAN} installed: the 0.2.x API this case drives (torchtitan.config."
            "Checkpoint, OptimizersContainer(model_parts, cls, kwargs)) is gone from 0.3; "
            "Torchtitan03Test covers 0.3.x"
        )
    if find_spec("triton") is None:
        return f"torchtitan {_TITAN} imports triton, which is not installed"
    return None


def _setup_03(folder: Path):
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    # The root keeps the default reshard_after_forward: unsharded after a forward.
    fully_shard(model, mesh=mesh)
    config = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    )
    optimizers = OptimizersContainer(config, model_parts=[model])
    tokens, targets = batch(0)
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    optimizers.step()
    optimizers.zero_grad()
    return model, optimizers


def titan03_worker(folder: str) -> str:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizers = _setup_03(Path(folder))
    saved = clone(optimizers.state_dict())
    # What CheckpointManager hands dcp for the optimizer: the container, a Stateful.
    state = {"optimizer": optimizers}
    evaluate(model)
    saved_outcome = outcome_of(lambda: dcp.save(state, checkpoint_id=folder))
    lines = [f"dcp.save after validation -> {saved_outcome}"]
    perturb(model, list(optimizers))
    evaluate(model)
    outcome = outcome_of(lambda: dcp.load(state, checkpoint_id=folder))
    if outcome == "ok":
        diffs = differences(optimizers.state_dict(), saved)
        outcome = "optimizer state restored " + (
            "exactly" if not diffs else f"differs at {diffs[:3]}"
        )
    lines.append(f"dcp.load after validation -> {outcome}")
    # The control, last (it fails halfway): the model is in the state that breaks DSD.
    lines.append(
        "DSD get_optimizer_state_dict, same moment -> "
        + outcome_of(lambda: get_optimizer_state_dict(model, list(optimizers)))
    )
    return "\n".join(lines)


@unittest.skipIf(_why_not_02(), _why_not_02() or "")
class TorchtitanTest(expecttest.TestCase):
    def test_save_and_load_after_validation(self) -> None:
        with tempfile.TemporaryDirectory() as folder:
            result = run_agreed(2, titan_worker, folder)
        self.assertExpectedInline(render_before_after(result, " -> "), """\
                      | stock -> backport applied
save after validation | KeyError: 0 -> ok
load after validation | KeyError: 0 -> optimizer state restored exactly""")


@unittest.skipUnless(
    _TITAN_LINE is not None and _TITAN_LINE != "0.2",
    f"needs torchtitan 0.3.x or later; installed: {_TITAN or 'none'}",
)
class Torchtitan03Test(expecttest.TestCase):
    def test_unaffected_on_stock_torch(self) -> None:
        """0.3.x's container bypasses DSD: stock torch saves and loads after validation."""
        with tempfile.TemporaryDirectory() as folder:
            result = run_agreed(2, titan03_worker, folder)
        self.assertExpectedInline(result, """\
dcp.save after validation -> ok
dcp.load after validation -> optimizer state restored exactly
DSD get_optimizer_state_dict, same moment -> KeyError: 0""")


if __name__ == "__main__":
    unittest.main()
