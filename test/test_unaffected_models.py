"""Models without FSDP2 (plain, DDP, FSDP1) give the same state dicts with and without apply()."""

import unittest

import expecttest
import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

import backport
from _fsdp_cases import (
    TinyLM,
    clone,
    describe_error,
    differences,
    get_state_dict,
    set_state_dict,
    train_step,
)
from _ranks import run_ranks


pytestmark = [pytest.mark.ranks, pytest.mark.torch27]


def _wrap(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = TinyLM()
    if kind == "ddp":
        return DDP(model)
    if kind == "fsdp1":
        return FSDP(model, device_id=torch.device("cpu"))
    if kind == "fsdp1_use_orig_params":
        return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    return model


def _state_after_eval(kind: str):
    """get_state_dict after a training step and an evaluation, then a set_state_dict."""
    model = _wrap(kind)
    optims = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    train_step(model, optims, 0)
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long))
    try:
        msd, osd = get_state_dict(model, optims)
        saved = clone((msd, osd))
        set_state_dict(model, optims, model_state_dict=msd, optim_state_dict=osd)
        return "ok", saved
    except Exception as err:  # noqa: BLE001 - compared between the two runs
        return describe_error(err, first_line=True), None


def unaffected_worker() -> list[str]:
    lines = []
    for kind in ("plain", "ddp", "fsdp1", "fsdp1_use_orig_params"):
        before, before_state = _state_after_eval(kind)
        backport.apply()
        try:
            after, after_state = _state_after_eval(kind)
        finally:
            backport.revert()
        same = before == after and (
            before_state is None or not differences(after_state, before_state)
        )
        lines.append(f"{kind}: unpatched {before}, patched {after}, identical: {same}")
    return lines


class UnaffectedModelsTest(expecttest.TestCase):
    def test_non_fsdp2_models_unchanged(self) -> None:
        results = run_ranks(2, unaffected_worker)
        self.assertEqual(results[0], results[1])
        self.assertExpectedInline("\n".join(results[0]), """\
plain: unpatched ok, patched ok, identical: True
ddp: unpatched ok, patched ok, identical: True
fsdp1: unpatched ok, patched ok, identical: True
fsdp1_use_orig_params: unpatched ok, patched ok, identical: True""")


if __name__ == "__main__":
    unittest.main()
