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

import unittest
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from _fsdp_cases import (
    TinyLM,
    clone,
    evaluate,
    outcome_of,
    perturb,
    restored_by,
    run_agreed_before_after,
    run_agreed_in_temp_dir,
    shard_blocks_then_root,
    train_step,
    unpatched_then_patched,
)


pytestmark = [pytest.mark.ranks, pytest.mark.fresh_ranks, pytest.mark.frameworks]

# None when torchtitan is not installed; the tests branch on the release line.
_TITAN = version("torchtitan") if find_spec("torchtitan") else None
_TITAN_LINE = ".".join(_TITAN.split(".")[:2]) if _TITAN else None


def _sharded_model() -> TinyLM:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return shard_blocks_then_root(TinyLM(), mesh)


def _load_after_validation(model, optimizers, load, saved) -> str:
    """Perturb, validate (the root is unsharded again), ``load()``: how the optimizer came back."""
    perturb(model, list(optimizers))
    evaluate(model)
    return restored_by(load, optimizers.state_dict, saved, "optimizer state")


def _setup(folder: Path):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config import Checkpoint

    model = _sharded_model()
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2})
    lr_schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0)
    train_step(model, [optimizers], 0)
    lr_schedulers.step()
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
        outcome = _load_after_validation(model, optimizers, lambda: manager.load(step=1), saved)
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

    model = _sharded_model()
    config = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    )
    optimizers = OptimizersContainer(config, model_parts=[model])
    train_step(model, [optimizers], 0)
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
    outcome = _load_after_validation(
        model, optimizers, lambda: dcp.load(state, checkpoint_id=folder), saved
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
        self.assertExpectedInline(run_agreed_before_after(titan_worker), """\
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
        result = run_agreed_in_temp_dir(2, titan03_worker)
        self.assertExpectedInline(result, """\
dcp.save after validation -> ok
dcp.load after validation -> optimizer state restored exactly
DSD get_optimizer_state_dict, same moment -> KeyError: 0""")


if __name__ == "__main__":
    unittest.main()
