"""An optimizer state dict of the module that shares a tied weight, after an evaluation.

The head's weight is the embedding's, in the root FSDP2 group, which stays
unsharded after a ``no_grad`` forward (``reshard_after_forward=False``, the
root's default). FSDP2 registers its resharding state-dict hook on the
embedding only, the weight's owner (upstream/fsdp2_issue/), so nothing reachable from
``model.head`` can reshard that group: ``get_optimizer_state_dict(model.head,
head_optim)`` cannot map the optimizer's DTensor to the head's unsharded
weight. Stock torch raises a bare ``KeyError: 0``; with the backport the error
names the unsharded FSDP2 group and the remedy: ``reshard()`` on the model's
FSDP modules, or pass the root module. Both remedies return the state taken
before the evaluation.
"""

from __future__ import annotations

import unittest
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from _fsdp_cases import (
    TinyLM,
    clone,
    differences,
    evaluate,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
    train_step,
    unpatched_then_patched,
)
from _ranks import run_ranks
from _versions import IS_TORCH_27


pytestmark = pytest.mark.ranks


def _build() -> tuple[TinyLM, torch.optim.Optimizer]:
    """Tied model, FSDP2 on blocks and root, one trained step of an optimizer over the head."""
    torch.manual_seed(0)
    model = TinyLM(tied=True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    head_optim = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    train_step(model, [head_optim], 0)
    return model, head_optim


def _error(call) -> dict[str, Any] | None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the error is what we check
        return {
            "type": type(err).__name__,
            "is ValueError": isinstance(err, ValueError),
            "is KeyError": isinstance(err, KeyError),
            "message": str(err),
        }
    return None


def _reshard_fsdp_modules(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def tied_secondary_worker() -> dict[str, dict[str, Any]]:
    def run(_label: str) -> dict[str, Any]:
        model, head_optim = _build()
        # Before the evaluation every group is sharded: the reference states.
        head_ref = clone(get_optimizer_state_dict(model.head, head_optim))
        root_ref = clone(get_optimizer_state_dict(model, head_optim))
        head_model_ref = clone(get_model_state_dict(model.head))
        evaluate(model)
        result: dict[str, Any] = {
            "head error": _error(lambda: get_optimizer_state_dict(model.head, head_optim)),
            "head state keys": sorted(head_ref["state"]),
            "root state keys": sorted(root_ref["state"]),
        }
        set_error = _error(
            lambda: set_state_dict(
                model.head, head_optim,
                model_state_dict=head_model_ref, optim_state_dict=head_ref,
            )
        )
        # Stock's KeyError is the DTensor's repr: the rank's values.
        if set_error["message"].startswith("DTensor("):
            set_error["message"] = "DTensor(...)"
        result["head set_state_dict error"] = set_error
        # A model call on the head sees the group as FSDP2 left it (a Limit).
        head_weight = get_model_state_dict(model.head)["weight"]
        result["head model weight"] = (type(head_weight).__name__, tuple(head_weight.shape))
        try:
            result["root differences"] = differences(
                get_optimizer_state_dict(model, head_optim), root_ref
            )
        except KeyError as err:
            result["root differences"] = f"KeyError: {err}"
        evaluate(model)
        _reshard_fsdp_modules(model)
        result["head differences after reshard()"] = differences(
            get_optimizer_state_dict(model.head, head_optim), head_ref
        )
        return result

    return unpatched_then_patched(run)


@unittest.skipIf(IS_TORCH_27, "not measured on torch 2.7 (test_torch27.py covers 2.7)")
class TiedSecondaryModuleTest(expecttest.TestCase):
    def test_optimizer_state_dict_of_tied_secondary_module(self) -> None:
        """A clear error naming the unsharded group and its remedies, which both work."""
        results = run_ranks(2, tied_secondary_worker, timeout=180)
        self.assertEqual(results[0], results[1])
        stock, patched = results[0]["unpatched"], results[0]["patched"]

        self.assertEqual(
            stock["head error"],
            {"type": "KeyError", "is ValueError": False, "is KeyError": True, "message": "0"},
        )
        self.assertEqual(stock["root differences"], "KeyError: 0")
        self.assertEqual(
            stock["head set_state_dict error"],
            {"type": "KeyError", "is ValueError": False, "is KeyError": True,
             "message": "DTensor(...)"},
        )
        # Resharding by hand is the workaround on stock too.
        self.assertEqual(stock["head differences after reshard()"], [])

        error = patched["head error"]
        self.assertIsNotNone(error, "get_optimizer_state_dict(model.head, ...) returned")
        # A KeyError still, so callers written for stock torch keep catching it.
        self.assertTrue(error["is ValueError"] and error["is KeyError"], error)
        # set_state_dict raises the same error.
        self.assertEqual(patched["head set_state_dict error"], error)
        self.assertEqual(patched["head model weight"], stock["head model weight"])
        self.assertEqual(patched["head model weight"], ("Tensor", (16, 8)))
        for phrase in (
            r"FSDP2",
            r"unsharded",
            r"tied",
            r"reshard\(\) on the model's FSDP modules",
            r"pass the root module",
        ):
            with self.subTest(phrase=phrase):
                self.assertRegex(error["message"], phrase)
        # The two remedies the message names.
        self.assertEqual(patched["root differences"], [])
        self.assertEqual(patched["head differences after reshard()"], [])
        self.assertEqual(patched["head state keys"], ["weight"])
        self.assertEqual(patched["root state keys"], ["embed.weight"])


if __name__ == "__main__":
    unittest.main()
