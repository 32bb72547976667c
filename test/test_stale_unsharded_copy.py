"""An optimizer step while FSDP2 keeps a group unsharded: stock uses the stale copy, the fix reshards.

FSDP2 computes with the unsharded parameters of a group that is unsharded, a
copy all-gathered from the shards; the optimizer steps the shards (the
DTensors it holds), not that copy. When a group is still unsharded at
``optim.step()`` (an evaluation between ``backward()`` and ``step()``, which
leaves the root group, ``reshard_after_forward=False``, unsharded; or
``set_reshard_after_backward(False)`` on the root), the next forward finds it
unsharded, skips the all-gather and computes with the pre-step values.

A DSD call between that step and the next forward changes this:

- Stock torch: ``get_model_state_dict`` and ``get_state_dict`` already
  reshard (FSDP2's state-dict pre-hook), so the next forward all-gathers the
  stepped shards. ``get_optimizer_state_dict`` does not: with an optimizer
  that holds none of the unsharded group's parameters it returns and leaves
  the stale copy in place; with one that does it raises ``KeyError: 0``
  before changing anything. Either way the losses after it are those of a
  run without the call.
- With ``backport.apply()``: every DSD call first calls ``reshard()`` on
  each FSDP module, so the losses after it are exactly those of a run that
  calls ``reshard()`` by hand at that point, and every one of them differs
  from stock's. That is the result FSDP2 intends: the forward computes
  with the weights the optimizer produced, as it does after every
  ``backward()`` that reshards (torch 2.15's ``set_reshard_after_backward``
  docstring: "Call reshard on each FSDP module on every rank before updating
  its sharded parameters").

Each run trains step 0 in the sequence, makes the call (or none, or
``reshard()`` by hand), then trains steps 1 to 3; losses compare exactly.
"""

import unittest

import expecttest
import pytest
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from _fsdp_cases import (
    Case,
    batch,
    build,
    evaluate,
    losses_after,
    outcome_of,
    run_agreed,
    side_by_side,
    unpatched_then_patched,
)


pytestmark = pytest.mark.ranks

# The blocks' Adam (optims[0]) and the root group's SGD (optims[1]); the
# root group (embed, norm, head) is the one left unsharded.
CASE = Case(multi_optim=True)
STEPS = (1, 2, 3)


def _reshard_by_hand(model, optims) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# What is done between step 0's optim.step() and step 1's forward.
ACTIONS = {
    "no call": None,
    "reshard() by hand": _reshard_by_hand,
    "get_model_state_dict": lambda model, optims: get_model_state_dict(model),
    "get_state_dict, both optimizers": lambda model, optims: get_state_dict(model, optims),
    "get_optimizer_state_dict, blocks' optimizer": (
        lambda model, optims: get_optimizer_state_dict(model, optims[0])
    ),
    "get_optimizer_state_dict, both optimizers": (
        lambda model, optims: get_optimizer_state_dict(model, optims)
    ),
}


def _step_0(model, optims, sequence: str) -> None:
    if sequence == "reshard_after_backward":
        model.set_reshard_after_backward(False, recurse=False)
    tokens, targets = batch(0)
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    if sequence == "evaluation":
        evaluate(model)
    for optim in optims:
        optim.step()
        optim.zero_grad()


def _run(sequence: str, action) -> tuple[str, list[float]]:
    model, optims, _ = build(CASE)
    _step_0(model, optims, sequence)
    outcome = "-" if action is None else outcome_of(lambda: action(model, optims))
    return outcome, losses_after(model, optims, STEPS)


def stale_copy_worker(sequence: str) -> dict[str, dict[str, tuple[str, list[float]]]]:
    """{label: {action: (outcome, losses of steps 1-3)}}, stock then with the backport."""
    return unpatched_then_patched(
        lambda _label: {name: _run(sequence, action) for name, action in ACTIONS.items()}
    )


def _like(losses: list[float], stale: list[float], resharded: list[float]) -> str:
    if losses == stale:
        return "= no call"
    if losses == resharded:
        return "= reshard() by hand"
    return "neither"


def render(result: dict[str, dict[str, tuple[str, list[float]]]]) -> str:
    """A row per call: its outcome and which reference run its losses equal exactly."""
    stale = result["unpatched"]["no call"][1]
    resharded = result["unpatched"]["reshard() by hand"][1]
    for name in ("no call", "reshard() by hand"):
        # Runs without a DSD call are the fix's business in no way.
        assert result["patched"][name] == result["unpatched"][name], name
    n_differ = sum(a != b for a, b in zip(stale, resharded))
    columns = {
        label: {
            name: f"{outcome}, losses {_like(losses, stale, resharded)}"
            for name, (outcome, losses) in result[key].items()
            if name not in ("no call", "reshard() by hand")
        }
        for label, key in (("stock", "unpatched"), ("backport applied", "patched"))
    }
    return (
        f"losses of steps 1-3, no call vs reshard() by hand: {n_differ} of 3 differ\n"
        + side_by_side(columns, "call after step 0's optim.step()")
    )


class StaleUnshardedCopyTest(expecttest.TestCase):
    def test_evaluation_between_backward_and_step(self) -> None:
        self.assertExpectedInline(render(run_agreed(2, stale_copy_worker, "evaluation")), """\
losses of steps 1-3, no call vs reshard() by hand: 3 of 3 differ
call after step 0's optim.step()            | stock                          | backport applied
get_model_state_dict                        | ok, losses = reshard() by hand | ok, losses = reshard() by hand
get_state_dict, both optimizers             | ok, losses = reshard() by hand | ok, losses = reshard() by hand
get_optimizer_state_dict, blocks' optimizer | ok, losses = no call           | ok, losses = reshard() by hand
get_optimizer_state_dict, both optimizers   | KeyError: 0, losses = no call  | ok, losses = reshard() by hand""")

    @unittest.skipUnless(
        hasattr(FSDPModule, "set_reshard_after_backward"),
        "FSDPModule.set_reshard_after_backward is missing in this torch",
    )
    def test_set_reshard_after_backward_false(self) -> None:
        # The root group left unsharded at step() by set_reshard_after_backward(False)
        # instead of an evaluation: the same stale copy, the same table.
        self.assertEqual(
            render(run_agreed(2, stale_copy_worker, "reshard_after_backward")),
            render(run_agreed(2, stale_copy_worker, "evaluation")),
        )


if __name__ == "__main__":
    unittest.main()
