"""accelerate (FSDP2 plugin) + transformers + peft: checkpointing after an evaluation.

accelerate turns FSDP on only for accelerator devices, so each rank sets its
distributed state to FSDP itself before ``prepare``; nothing else of accelerate
is changed. Each operation runs after one training step and a ``no_grad``
evaluation: first on torch as installed, then after ``backport.apply()``.
"""

import importlib.util
import tempfile
import unittest

import expecttest
import pytest

from _fsdp_cases import (
    before_after,
    clone,
    differences,
    outcome_of,
    perturb,
    restored,
    side_by_side,
    unpatched_then_patched,
)
from _ranks import run_ranks


pytestmark = [pytest.mark.ranks, pytest.mark.torch27, pytest.mark.fresh_ranks, pytest.mark.frameworks]


HAS_HF_STACK = all(
    importlib.util.find_spec(name) for name in ("accelerate", "transformers", "peft")
)

VOCAB = 64


def _prepare(variant: str):
    """A fresh Accelerator, FSDP2 plugin and tiny Llama, trained for one step."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=variant == "tied",
    )
    model = LlamaForCausalLM(config)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=2, target_modules=["q_proj", "v_proj", "lm_head"])
        )
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(cpu=True)
    # What accelerate would set on an accelerator device with this plugin.
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optim = accelerator.prepare(model, optim)
    assert accelerator.is_fsdp2, "accelerate did not take the FSDP2 path"
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optim.step()
    optim.zero_grad()
    return accelerator, plugin, model, optim, ids


def _evaluate(model, ids) -> None:
    import torch

    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()


def _restored(model, optim, ref) -> str:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return restored(get_optimizer_state_dict(model, optim), ref)


def _fsdp_optimizer_files(variant: str, tmp: str) -> list[str]:
    from accelerate.utils.fsdp_utils import load_fsdp_optimizer, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    accelerator, plugin, model, optim, ids = _prepare(variant)
    ref = clone(get_optimizer_state_dict(model, optim))
    save_fsdp_optimizer(plugin, accelerator, optim, model, f"{tmp}/before_eval")
    _evaluate(model, ids)
    saved = outcome_of(lambda: save_fsdp_optimizer(plugin, accelerator, optim, model, f"{tmp}/after_eval"))
    perturb(model, [optim])
    _evaluate(model, ids)
    loaded = outcome_of(
        lambda: load_fsdp_optimizer(plugin, accelerator, optim, model, f"{tmp}/before_eval")
    )
    lines = [f"save_fsdp_optimizer: {saved}", f"load_fsdp_optimizer: {loaded}"]
    if loaded == "ok":
        lines[-1] += f", {_restored(model, optim, ref)}"
    return lines


def _dsd_with_accelerate_options(variant: str) -> list[str]:
    from accelerate.utils.fsdp_utils import _prepare_sd_options
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    _accelerator, plugin, model, optim, ids = _prepare(variant)
    options = _prepare_sd_options(plugin)
    ref = clone(get_optimizer_state_dict(model, optim, options=options))
    _evaluate(model, ids)
    got = {}
    outcome = outcome_of(lambda: got.setdefault("osd", get_optimizer_state_dict(model, optim, options=options)))
    if outcome == "ok":
        outcome = "equal to the state before eval" if not differences(got["osd"], ref) else "DIFFERS"
    perturb(model, [optim])
    _evaluate(model, ids)
    loaded = outcome_of(lambda: set_optimizer_state_dict(model, optim, clone(ref), options=options))
    lines = [f"get_optimizer_state_dict: {outcome}", f"set_optimizer_state_dict: {loaded}"]
    if loaded == "ok":
        lines[-1] += f", {_restored(model, optim, ref)}"
    return lines


def _accelerator_state(variant: str, tmp: str) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    accelerator, _plugin, model, optim, ids = _prepare(variant)
    ref = clone(get_optimizer_state_dict(model, optim))
    accelerator.save_state(f"{tmp}/state_before_eval")
    _evaluate(model, ids)
    saved = outcome_of(lambda: accelerator.save_state(f"{tmp}/state_after_eval"))
    perturb(model, [optim])
    _evaluate(model, ids)
    loaded = outcome_of(lambda: accelerator.load_state(f"{tmp}/state_before_eval"))
    lines = [f"Accelerator.save_state: {saved}", f"Accelerator.load_state: {loaded}"]
    if loaded == "ok":
        lines[-1] += f", {_restored(model, optim, ref)}"
    return lines


def accelerate_worker(variant: str, tmp: str) -> dict[str, str]:
    def run(label: str) -> str:
        where = f"{tmp}/{label}"
        lines = (
            _fsdp_optimizer_files(variant, where)
            + _dsd_with_accelerate_options(variant)
            + _accelerator_state(variant, where)
        )
        return "\n".join(lines)

    return unpatched_then_patched(run)


@unittest.skipUnless(HAS_HF_STACK, "needs accelerate, transformers and peft")
class AccelerateCheckpointAfterEvalTest(expecttest.TestCase):
    def _run(self, variant: str) -> dict[str, str]:
        with tempfile.TemporaryDirectory() as tmp:
            results = run_ranks(2, accelerate_worker, variant, tmp)
        self.assertEqual(results[0], results[1])
        return results[0]

    def test_calls_after_eval(self) -> None:
        """Each accelerate and DSD call right after an evaluation, per model."""
        columns = {}
        for variant in ("untied", "tied", "lora"):
            result = self._run(variant)
            columns[variant] = before_after(result["unpatched"], result["patched"])
        self.assertExpectedInline(side_by_side(columns, "stock -> backport applied"), """\
stock -> backport applied | untied                                         | tied                                          | lora
save_fsdp_optimizer       | KeyError: 19 -> ok                             | KeyError: 0 -> ok                             | KeyError: 8 -> ok
load_fsdp_optimizer       | KeyError: 19 -> ok, restored exactly           | KeyError: 0 -> ok, restored exactly           | KeyError: 8 -> ok, restored exactly
get_optimizer_state_dict  | KeyError: 19 -> equal to the state before eval | KeyError: 0 -> equal to the state before eval | KeyError: 8 -> equal to the state before eval
set_optimizer_state_dict  | KeyError: <DTensor> -> ok, restored exactly    | KeyError: <DTensor> -> ok, restored exactly   | KeyError: <DTensor> -> ok, restored exactly
Accelerator.save_state    | ok                                             | ok                                            | ok
Accelerator.load_state    | ok, restored exactly                           | ok, restored exactly                          | ok, restored exactly""")


if __name__ == "__main__":
    unittest.main()
