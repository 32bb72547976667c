"""The backport's price (review A1): a DSD call on a subset of ranks desynchronizes FSDP2.

``backport.apply()`` makes DSD call ``FSDPModule.reshard()``, which changes the
group's sharded state on the calling rank only, with no collective. The next
forward all-gathers a group only where it is sharded, so if one rank of two
calls DSD while a group is unsharded, the ranks issue different all-gathers.
The model here is the one where stock torch works: the root group holds only a
frozen embedding, and the optimizer covers the other groups, which are sharded
after the evaluation. Rank 0 alone calls ``get_optimizer_state_dict`` after an
evaluation, then both ranks train. Stock trains on with the losses of a run
that never evaluated; with the backport rank 0 dies of gloo's "collective
mismatch" abort at the next forward, and rank 1 sees its peer reset the
connection. ``get_model_state_dict`` on rank 0 alone does the same on stock,
through FSDP2's own state-dict hooks. Called on every rank, as DSD requires,
the backport returns what stock returns and training is unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import unittest
from datetime import timedelta
from typing import Any

import expecttest
import pytest
import torch.distributed as dist

import backport
from _fsdp_cases import (
    Case,
    build,
    clone,
    differences,
    evaluate,
    get_model_state_dict,
    get_optimizer_state_dict,
    reference_losses,
    train_step,
)
from _ranks import RankError, run_ranks
from _versions import IS_TORCH_27


pytestmark = pytest.mark.ranks


# The root group holds only the frozen embedding; [norm, head] is its own group.
FROZEN_ROOT = Case(frozen=True, tail=True)
# A desynchronized collective fails in seconds; a hang would end here, not in
# the 90 s of run_ranks' groups.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)
CALLS = {
    "get_optimizer_state_dict": lambda model, optims: get_optimizer_state_dict(
        model, optims
    ),
    "get_model_state_dict": lambda model, optims: get_model_state_dict(model),
}


def _log(message: str) -> None:
    # Written before each stage, so a rank that dies shows how far it got.
    print(message, file=sys.stderr, flush=True)


def rank_local_worker(apply_backport: bool, call_name: str, stderr_dir: str) -> list[float]:
    """After a training step and an evaluation, rank 0 alone calls DSD; both ranks train."""
    rank = dist.get_rank()
    # This rank's stderr (gloo's abort message, faulthandler) for the parent.
    stderr = os.open(
        os.path.join(stderr_dir, f"rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    )
    os.dup2(stderr, 2)
    dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)
    if apply_backport:
        backport.apply()
    model, optims, _ = build(FROZEN_ROOT)
    train_step(model, optims, 0)
    evaluate(model)
    if rank == 0:
        CALLS[call_name](model, optims)
        _log(f"{call_name} on rank 0 only: returned")
    losses = []
    for step in (1, 2):
        _log(f"train step {step}: started")
        losses.append(train_step(model, optims, step))
        _log(f"train step {step}: done")
    return losses


def both_ranks_worker() -> dict[str, Any]:
    """Where stock works: rank 0 alone, and every rank, calling DSD after an evaluation."""
    dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)
    expected_losses = reference_losses(FROZEN_ROOT)
    result: dict[str, Any] = {}

    def run(
        label: str, ranks: tuple[int, ...], call_names: tuple[str, ...]
    ) -> dict[str, Any]:
        model, optims, _ = build(FROZEN_ROOT)
        train_step(model, optims, 0)
        evaluate(model)
        state_dicts = {}
        if dist.get_rank() in ranks:
            state_dicts = {name: clone(CALLS[name](model, optims)) for name in call_names}
        result[f"{label}: losses as without evaluation"] = (
            [train_step(model, optims, step) for step in (1, 2)] == expected_losses
        )
        return state_dicts

    # Not get_model_state_dict: on rank 0 alone it aborts on stock too.
    run("stock, rank 0 alone", ranks=(0,), call_names=("get_optimizer_state_dict",))
    stock = run("stock, both ranks", ranks=(0, 1), call_names=tuple(CALLS))
    backport.apply()
    try:
        patched = run("backport, both ranks", ranks=(0, 1), call_names=tuple(CALLS))
    finally:
        backport.revert()
    for name in CALLS:
        result[f"backport, both ranks: {name} differences from stock"] = differences(
            patched[name], stock[name]
        )
    return result


@unittest.skipIf(
    IS_TORCH_27, "torch 2.7 rejects reshard_after_forward=None (test_torch27.py covers 2.7)"
)
class RankLocalCallTest(expecttest.TestCase):
    def _run_rank_local(self, apply_backport: bool, call_name: str) -> tuple[str, list[str]]:
        """The RankError text and each rank's stderr; the run must fail."""
        with tempfile.TemporaryDirectory() as stderr_dir:
            with self.assertRaises(RankError) as caught:
                run_ranks(
                    2, rank_local_worker, apply_backport, call_name, stderr_dir, timeout=180
                )
            stderrs = []
            for rank in range(2):
                with open(os.path.join(stderr_dir, f"rank{rank}.txt")) as stderr:
                    stderrs.append(stderr.read())
        return str(caught.exception), stderrs

    def _assert_collective_mismatch_abort(
        self, call_name: str, error: str, stderrs: list[str]
    ) -> None:
        # Both ranks fail in the first training step after the call.
        for stderr in stderrs:
            self.assertIn("train step 1: started\n", stderr)
            self.assertNotIn("train step 1: done", stderr)
        # Rank 0 returned from the call and aborted in the next forward's
        # all-gather: it gathers the resharded root group, rank 1 the first block's.
        self.assertTrue(
            error.startswith(
                "2 of 2 ranks failed:\n"
                f"rank 0: no result (exit code {-signal.SIGABRT})\n"
                "rank 1: Traceback"
            ),
            error,
        )
        self.assertIn(f"{call_name} on rank 0 only: returned\n", stderrs[0])
        self.assertIn(
            "terminate called after throwing an instance of 'gloo::EnforceNotMet'", stderrs[0]
        )
        self.assertIn(
            "Received data size doesn't match expected size. "
            "Is there a distributed collective mismatch in your code?",
            stderrs[0],
        )
        # Rank 1 raises when rank 0's end of the connection closes.
        rank1 = error.split("\nrank 1: ", 1)[1]
        self.assertIn("in train_step", rank1)
        self.assertRegex(
            rank1.rstrip().splitlines()[-1],
            r"^RuntimeError: .*gloo.* Read error .*: Connection (reset|closed) by peer",
        )

    def test_optimizer_state_dict_on_one_rank_with_backport(self) -> None:
        """With the backport, rank 0 alone calling get_optimizer_state_dict aborts training."""
        error, stderrs = self._run_rank_local(True, "get_optimizer_state_dict")
        self._assert_collective_mismatch_abort("get_optimizer_state_dict", error, stderrs)

    def test_model_state_dict_on_one_rank_on_stock(self) -> None:
        """Stock torch aborts the same way when rank 0 alone calls get_model_state_dict."""
        error, stderrs = self._run_rank_local(False, "get_model_state_dict")
        self._assert_collective_mismatch_abort("get_model_state_dict", error, stderrs)

    def test_calls_where_stock_works(self) -> None:
        """Stock survives rank 0 alone; on every rank the backport matches stock."""
        for rank, result in enumerate(run_ranks(2, both_ranks_worker, timeout=180)):
            with self.subTest(rank=rank):
                self.assertExpectedInline(
                    "\n".join(f"{key}: {value}" for key, value in result.items()), """\
stock, rank 0 alone: losses as without evaluation: True
stock, both ranks: losses as without evaluation: True
backport, both ranks: losses as without evaluation: True
backport, both ranks: get_optimizer_state_dict differences from stock: []
backport, both ranks: get_model_state_dict differences from stock: []""")


if __name__ == "__main__":
    unittest.main()
