"""transformers Trainer 5.25.0 with FSDP2 (accelerate 1.16.0): evaluate, save, resume, 2 ranks.

The Trainer's own evaluation, checkpointing and ``resume_from_checkpoint`` run unchanged. What CPU
needs: ``use_cpu=True`` (gloo); accelerate turns FSDP on only for accelerator devices, so a
Trainer subclass sets the FSDP2 distributed state that accelerate would set on GPUs right after
the Trainer builds its Accelerator; the ranks come from ``_ranks.run_ranks`` (test/_ranks.py).
"""

from __future__ import annotations

import unittest
from importlib.util import find_spec
from pathlib import Path

import expecttest
import pytest

from _fsdp_cases import (
    clone,
    get_optimizer_state_dict,
    outcome_of,
    restored_by,
    run_agreed_before_after,
    unpatched_then_patched,
)


pytestmark = [pytest.mark.ranks, pytest.mark.torch27, pytest.mark.fresh_ranks, pytest.mark.frameworks]


VOCAB = 64


def _classes():
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainerCallback

    class CPUFSDPTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            # What accelerate sets on an accelerator device with this plugin.
            PartialState().distributed_type = DistributedType.FSDP
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
                **self.args.fsdp_plugin_args
            )
            self.is_fsdp_enabled = True

    class Probe(TrainerCallback):
        """What DCP sees right after each evaluation, and the optimizer at each save."""

        def __init__(self) -> None:
            self.trainer = None
            self.events: set[str] = set()
            self.saved_optim = None

        def _optim_state(self):
            return get_optimizer_state_dict(self.trainer.model_wrapped, self.trainer.optimizer)

        def on_evaluate(self, args, state, control, **kwargs) -> None:
            outcome = outcome_of(self._optim_state)
            self.events.add(f"get_optimizer_state_dict after evaluation -> {outcome}")

        def on_save(self, args, state, control, **kwargs) -> None:
            self.saved_optim = clone(self._optim_state())

    class Dataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, idx: int):
            ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(idx))
            return {"input_ids": ids, "labels": ids}

    return CPUFSDPTrainer, Probe, Dataset


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        )
    )


def _args(output_dir: Path, max_steps: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        learning_rate=1e-2,
        report_to=[],
        disable_tqdm=True,
        fsdp="full_shard",
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    )


def trainer_worker(output_dir: str) -> dict[str, str]:
    CPUFSDPTrainer, Probe, Dataset = _classes()

    def trainer(run_dir: Path, max_steps: int, probe):
        probe.trainer = CPUFSDPTrainer(
            model=_model(), args=_args(run_dir, max_steps), train_dataset=Dataset(),
            eval_dataset=Dataset(), callbacks=[probe],
        )
        return probe.trainer

    def run(label: str) -> str:
        run_dir = Path(output_dir) / label
        probe = Probe()
        first = trainer(run_dir, 2, probe)
        assert first.accelerator.is_fsdp2, "accelerate did not take the FSDP2 path"
        lines = [f"train with evaluation, then save -> {outcome_of(first.train)}"]
        lines += sorted(probe.events)
        resumed = Probe()
        restored = {}

        def _capture_after_load(*_args, **_kwargs):
            restored["optim"] = clone(resumed._optim_state())

        resumed.on_train_begin = _capture_after_load
        outcome = restored_by(
            lambda: trainer(run_dir, 3, resumed).train(
                resume_from_checkpoint=str(run_dir / "checkpoint-2")
            ),
            lambda: restored["optim"],
            probe.saved_optim,
            "optimizer state",
        )
        lines.append(f"resume_from_checkpoint -> {outcome}")
        return "\n".join(lines)

    return unpatched_then_patched(run)


@unittest.skipUnless(
    find_spec("transformers") and find_spec("accelerate"), "needs the test extra (transformers)"
)
class TransformersTrainerTest(expecttest.TestCase):
    def test_evaluate_save_resume(self) -> None:
        self.assertExpectedInline(run_agreed_before_after(trainer_worker), """\
                                          | stock -> backport applied
train with evaluation, then save          | ok
get_optimizer_state_dict after evaluation | KeyError: 15 -> ok
resume_from_checkpoint                    | optimizer state restored exactly""")


if __name__ == "__main__":
    unittest.main()
