"""Lightning Trainer 2.6.6 (ModelParallelStrategy, FSDP2): fit with validation and ModelCheckpoint, then resume.

The Trainer's own checkpointing runs unchanged. What CPU needs: ``accelerator="cpu"`` (gloo), and
the ranks come from ``_ranks.run_ranks`` (test/_ranks.py) with torchrun's environment, so the Trainer
joins that process group instead of spawning processes.
"""

from __future__ import annotations

import unittest
from importlib.util import find_spec
from pathlib import Path

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions

from _fsdp_cases import (
    TinyLM,
    batch,
    clone,
    get_optimizer_state_dict,
    outcome_of,
    restored_by,
    run_agreed_before_after,
    shard_blocks_then_root,
    unpatched_then_patched,
)


pytestmark = [pytest.mark.ranks, pytest.mark.fresh_ranks, pytest.mark.frameworks]


# What ModelParallelStrategy.optimizer_state asks DCP for with distributed checkpoints.
SAVE_OPTIONS = StateDictOptions(cpu_offload=True)


def _lightning_classes():
    import pytorch_lightning as pl

    class LitTinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyLM()

        def configure_model(self) -> None:
            shard_blocks_then_root(self.model, self.device_mesh["data_parallel"])

        def _loss(self, tokens, targets):
            return F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())

        def training_step(self, batch_, batch_idx):
            return self._loss(*batch_)

        def validation_step(self, batch_, batch_idx):
            self._loss(*batch_)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Probe(pl.Callback):
        """Records what DCP sees right after validation, before ModelCheckpoint saves."""

        def __init__(self) -> None:
            self.events: list[str] = []
            self.saved_optim = None
            self.resumed_optim = None

        def _optim_state(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            return get_optimizer_state_dict(pl_module, optimizer, options=SAVE_OPTIONS)

        def on_validation_end(self, trainer, pl_module) -> None:
            outcome = outcome_of(lambda: self._optim_state(trainer, pl_module))
            self.events.append(f"get_optimizer_state_dict after validation -> {outcome}")

        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            self.saved_optim = clone(checkpoint["optimizer_states"][0])

        def on_train_start(self, trainer, pl_module) -> None:
            if trainer.ckpt_path:
                self.resumed_optim = clone(self._optim_state(trainer, pl_module))

    return pl, LitTinyLM, Probe


def _trainer(pl, checkpoint_dir: Path, max_steps: int, callbacks):
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import ModelParallelStrategy

    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=checkpoint_dir, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=checkpoint_dir,
    )


def _loader():
    # The same batches on every rank, as in the other tests.
    return torch.utils.data.DataLoader([batch(step) for step in range(4)], batch_size=None)


def trainer_worker(checkpoint_dir: str) -> dict[str, str]:
    pl, LitTinyLM, Probe = _lightning_classes()
    def run(label: str) -> str:
        run_dir = Path(checkpoint_dir) / label
        probe = Probe()
        fit = outcome_of(
            lambda: _trainer(pl, run_dir, 2, [probe]).fit(LitTinyLM(), _loader(), _loader())
        )
        lines = [f"fit with validation and ModelCheckpoint -> {fit}", *sorted(set(probe.events))]
        resume = Probe()
        outcome = restored_by(
            lambda: _trainer(pl, run_dir, 3, [resume]).fit(
                LitTinyLM(), _loader(), _loader(), ckpt_path=str(run_dir / "last.ckpt")
            ),
            lambda: resume.resumed_optim,
            probe.saved_optim,
            "optimizer state",
        )
        lines.append(f"resume from last.ckpt -> {outcome}")
        return "\n".join(lines)

    return unpatched_then_patched(run)


@unittest.skipUnless(
    find_spec("pytorch_lightning"), "needs the frameworks extra (nox: torch 2.13.0)"
)
class LightningTrainerTest(expecttest.TestCase):
    def test_fit_validate_checkpoint_resume(self) -> None:
        # The Trainer saves the model state first, whose state_dict() hooks
        # reshard; a bare optimizer state dict at the same moment fails.
        self.assertExpectedInline(run_agreed_before_after(trainer_worker), """\
                                          | stock -> backport applied
fit with validation and ModelCheckpoint   | ok
get_optimizer_state_dict after validation | KeyError: 0 -> ok
resume from last.ckpt                     | optimizer state restored exactly""")


if __name__ == "__main__":
    unittest.main()
