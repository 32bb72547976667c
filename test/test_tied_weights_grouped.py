"""FSDP2 bug: tied weights grouped the way FSDP2's own error recommends crash a full state dict.

FSDP2 in 2.13 and 2.14 (not 2.10) rejects a parameter shared by two
``fully_shard`` calls and asks for one call over both modules
(``_validate_no_duplicate_params``). The first module of that list owns the shared weight,
and FSDP2 registers its state-dict pre-hook (which reshards) on the owner only
(upstream/fsdp2_issue/). With ``fully_shard([head, embedding])`` and a ``no_grad``
forward that leaves the group unsharded, ``model.state_dict()`` visits the
hook-less embedding first and keeps its unsharded weight, then the head's hook
reshards and frees that storage: ``0.weight`` is a plain tensor with no storage,
and ``get_model_state_dict(full_state_dict=True)`` reads it and segfaults on
every rank. ``backport.apply()`` reshards before the walk, so the full and the
sharded ``get_model_state_dict`` return the state taken before the evaluation;
``model.state_dict()`` itself is FSDP2's and stays as it is.
"""

from __future__ import annotations

import signal
import unittest
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import backport
from _fsdp_cases import StateDictOptions, clone, get_model_state_dict
from _ranks import RankError, run_ranks
from _versions import IS_TORCH_27


pytestmark = pytest.mark.ranks


FULL = StateDictOptions(full_state_dict=True)


def _grouped_tied_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # The head first: it owns the shared weight and gets the only hook.
    fully_shard([model[1], model[0]], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


def _evaluate(model: nn.Module) -> None:
    """A forward with no backward: the group stays unsharded."""
    with torch.no_grad():
        model(torch.arange(4))


def _describe(value: torch.Tensor) -> str:
    if isinstance(value, DTensor):
        # str(Shard(0)) differs between torch releases.
        placements = ", ".join(
            f"{type(p).__name__}({getattr(p, 'dim', '')})" for p in value.placements
        )
        return f"DTensor{list(value.shape)} ({placements})"
    # Only the size of the storage: reading a freed one's data crashes.
    return f"Tensor{list(value.shape)}, {value.untyped_storage().nbytes()} bytes of storage"


def _render(state_dict: dict[str, Any]) -> str:
    return "\n".join(f"{fqn}: {_describe(state_dict[fqn])}" for fqn in sorted(state_dict))


def _bitwise_differences(actual: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """FQNs whose tensors differ in type, placements, dtype, shape or any bit."""
    diffs = sorted(set(actual) ^ set(expected))
    for fqn in sorted(set(actual) & set(expected)):
        a, e = actual[fqn], expected[fqn]
        if type(a) is not type(e) or (
            isinstance(a, DTensor) and a.placements != e.placements
        ):
            diffs.append(fqn)
            continue
        a, e = (t.to_local() if isinstance(t, DTensor) else t for t in (a, e))
        if a.dtype != e.dtype or a.shape != e.shape or not torch.equal(
            a.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8)
        ):
            diffs.append(fqn)
    return diffs


def _differences_after_eval(options: StateDictOptions) -> list[str]:
    model = _grouped_tied_model()
    before = clone(get_model_state_dict(model, options=options))
    _evaluate(model)
    return _bitwise_differences(get_model_state_dict(model, options=options), before)


def grouped_tied_worker(apply_backport: bool) -> dict[str, Any]:
    """What a state dict after the evaluation holds; the full one crashes on stock."""
    result: dict[str, Any] = {}
    # Nothing below reads a freed storage's data, so these run on stock too.
    model = _grouped_tied_model()
    _evaluate(model)
    result["stock model.state_dict()"] = _render(model.state_dict())
    model = _grouped_tied_model()
    _evaluate(model)
    result["stock sharded get_model_state_dict"] = _render(get_model_state_dict(model))
    if apply_backport:
        backport.apply()
    try:
        result["full differences"] = _differences_after_eval(FULL)
        result["sharded differences"] = _differences_after_eval(StateDictOptions())
        model = _grouped_tied_model()
        _evaluate(model)
        result["model.state_dict() with the backport"] = _render(model.state_dict())
    finally:
        backport.revert()
    return result


@unittest.skipIf(IS_TORCH_27, "not measured on torch 2.7 (test_torch27.py covers 2.7)")
class GroupedTiedWeightsTest(expecttest.TestCase):
    def test_full_state_dict_after_eval_crashes_on_stock(self) -> None:
        """Stock torch: both ranks die of SIGSEGV in get_model_state_dict."""
        with self.assertRaises(RankError) as caught:
            run_ranks(2, grouped_tied_worker, False, timeout=180)
        segv = -signal.SIGSEGV
        self.assertEqual(
            str(caught.exception),
            "2 of 2 ranks failed:\n"
            f"rank 0: no result (exit code {segv})\n"
            f"rank 1: no result (exit code {segv})",
        )

    def test_state_dict_after_eval_with_backport(self) -> None:
        """With the backport, full and sharded state dicts equal the state before the eval."""
        for rank, result in enumerate(run_ranks(2, grouped_tied_worker, True, timeout=180)):
            with self.subTest(rank=rank):
                self.assertEqual(result["full differences"], [])
                self.assertEqual(result["sharded differences"], [])
                # FSDP2's own state_dict(): the embedding's weight was freed after
                # it was taken, by the head's hook.
                self.assertExpectedInline(result["stock model.state_dict()"], """\
0.weight: Tensor[16, 8], 0 bytes of storage
1.weight: DTensor[16, 8] (Shard(0))""")
                self.assertEqual(
                    result["stock sharded get_model_state_dict"],
                    result["stock model.state_dict()"],
                )
                # The backport changes DSD only.
                self.assertEqual(
                    result["model.state_dict() with the backport"],
                    result["stock model.state_dict()"],
                )


if __name__ == "__main__":
    unittest.main()
