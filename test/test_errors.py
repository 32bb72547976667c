"""An optimizer param the model does not own: a clear error instead of a bare KeyError.

The single-process checks of the error types are in test/test_error_types.py."""

import unittest

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from _fsdp_cases import (
    CASES,
    StateDictOptions,
    build,
    clone,
    describe_error,
    evaluate,
    get_optimizer_state_dict,
    render_before_after,
    set_optimizer_state_dict,
    train_step,
    unpatched_then_patched,
)
from _ranks import run_ranks
from test_error_types import _get_optim_outcome, _kinds


pytestmark = pytest.mark.ranks


FLATTENED = StateDictOptions(flatten_optimizer_state_dict=True)


def _calls(model, optims, fsdp2: bool, module: str) -> dict[str, str]:
    """The three lookups that meet the param: get, FQN-keyed set, flattened set."""
    saved = clone(get_optimizer_state_dict(model, optims))
    saved_flat = clone(get_optimizer_state_dict(model, optims, options=FLATTENED))
    # A learnable loss temperature, optimized but not a parameter of the model.
    optims[0].add_param_group({"params": [nn.Parameter(torch.ones(()))]})
    if fsdp2:
        evaluate(model)
    outcomes = {}
    for name, call in (
        ("get_optimizer_state_dict", lambda: get_optimizer_state_dict(model, optims)),
        ("set_optimizer_state_dict", lambda: set_optimizer_state_dict(model, optims, saved)),
        (
            "set_optimizer_state_dict, flattened",
            lambda: set_optimizer_state_dict(model, optims, saved_flat, options=FLATTENED),
        ),
    ):
        try:
            call()
        except Exception as err:  # noqa: BLE001 - the message is what we pin
            outcomes[f"{module}: {name}"] = f"[{_kinds(err)}] {describe_error(err)}"
        else:
            outcomes[f"{module}: {name}"] = "ok"
    return outcomes


def foreign_param_worker() -> dict[str, dict[str, str]]:
    def run(_label: str) -> dict[str, str]:
        model, optims, _ = build(CASES["root_none"])
        train_step(model, optims, 0)
        torch.manual_seed(0)
        plain = nn.Linear(2, 2)
        plain_optims = [torch.optim.Adam(plain.parameters(), lr=0.1)]
        plain(torch.ones(2)).sum().backward()
        plain_optims[0].step()
        # A plain module without FSDP gets the error without the FSDP2 hint.
        return {
            **_calls(model, optims, fsdp2=True, module="FSDP2 model"),
            **_calls(plain, plain_optims, fsdp2=False, module="plain module"),
        }

    return unpatched_then_patched(run)


class ForeignOptimizerParamTest(expecttest.TestCase):
    def test_foreign_param_error(self) -> None:
        results = run_ranks(2, foreign_param_worker)
        self.assertEqual(results[0], results[1])
        # The root is unsharded after the evaluation: stock fails on the model's params.
        self.assertExpectedInline(render_before_after(results[0]), """\
                                                  | stock -> backport applied
FSDP2 model: get_optimizer_state_dict             | [KeyError] KeyError: 0 -> [KeyError/ValueError] OptimizerParamNotInModelError: AdamW holds a parameter that the model does not own: param_groups[1]['params'][0] (Parameter of shape ()). Pass the model that owns every parameter of the optimizer.
FSDP2 model: set_optimizer_state_dict             | [KeyError] KeyError: <DTensor> -> [KeyError/ValueError] OptimizerParamNotInModelError: AdamW holds a parameter that the model does not own: param_groups[1]['params'][0] (Parameter of shape ()). Pass the model that owns every parameter of the optimizer.
FSDP2 model: set_optimizer_state_dict, flattened  | [KeyError] KeyError: <DTensor> -> [KeyError/ValueError] OptimizerParamNotInModelError: AdamW holds a parameter that the model does not own: param_groups[1]['params'][0] (Parameter of shape ()). Pass the model that owns every parameter of the optimizer.
plain module: get_optimizer_state_dict            | [KeyError] KeyError: 2 -> [KeyError/ValueError] OptimizerParamNotInModelError: Adam holds a parameter that the model does not own: param_groups[1]['params'][0] (Parameter of shape ()). Pass the model that owns every parameter of the optimizer.
plain module: set_optimizer_state_dict            | [KeyError] KeyError: <Parameter> -> [KeyError/ValueError] OptimizerParamNotInModelError: Adam holds a parameter that the model does not own: param_groups[1]['params'][0] (Parameter of shape ()). Pass the model that owns every parameter of the optimizer.
plain module: set_optimizer_state_dict, flattened | [KeyError] KeyError: <Parameter> -> [KeyError/ValueError] OptimizerParamNotInModelError: Adam holds a parameter that the model does not own: param_groups[1]['params'][0] (Parameter of shape ()). Pass the model that owns every parameter of the optimizer.""")


def same_shape_head_worker() -> dict[str, str]:
    def run(label: str) -> str:
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        # A projection head outside the model, of the model's weight's shape
        head = nn.Linear(8, 8)
        optim = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=0.1)
        head(model(torch.ones(2, 8))).sum().backward()
        optim.step()
        return _get_optim_outcome(model, optim)

    return unpatched_then_patched(run)


class SameShapeParamOutsideTest(expecttest.TestCase):
    """A plain parameter outside an FSDP2 model, of a model parameter's shape."""

    def test_no_fsdp2_hint(self) -> None:
        # Its storage is live, so it is no unsharded FSDP2 parameter: the error
        # names no FSDP2 cause.
        results = run_ranks(2, same_shape_head_worker)
        self.assertEqual(results[0], results[1])
        self.assertExpectedInline(results[0]["unpatched"], """[KeyError] KeyError: 2""")
        self.assertExpectedInline(results[0]["patched"], """[KeyError/ValueError] OptimizerParamNotInModelError: Adam holds a parameter that the model does not own: param_groups[0]['params'][2] (Parameter of shape (8, 8)). Pass the model that owns every parameter of the optimizer.""")


def _raise(*_) -> None:
    raise RuntimeError("aborted")


def aborted_forward_worker() -> dict[str, list[str]]:
    def run(label: str) -> dict[str, list[str]]:
        model, optims, _ = build(CASES["root_none"])
        train_step(model, optims, 0)
        # An exception between the root's pre- and post-forward leaves the
        # root group unsharded and marked as in forward; reshard() skips it.
        handle = model.norm.register_forward_pre_hook(_raise)
        try:
            evaluate(model)
        except RuntimeError:
            pass
        handle.remove()
        lines = []
        for when in ("after the exception", "after reset_iter_state()"):
            try:
                get_optimizer_state_dict(model, optims)
            except Exception as err:  # noqa: BLE001 - the message is what we pin
                lines.append(f"{when}: [{_kinds(err)}] {describe_error(err)}")
            else:
                lines.append(f"{when}: ok")
            model.reset_iter_state()
        return {label: lines}

    runs = unpatched_then_patched(run)
    return {**runs["unpatched"], **runs["patched"]}


@unittest.skipUnless(
    hasattr(FSDPModule, "reset_iter_state"), "FSDPModule.reset_iter_state is new in 2.13"
)
class AbortedForwardTest(expecttest.TestCase):
    """The message names the unsharded group, and the way out the docstrings give works."""

    def test_aborted_forward(self) -> None:
        results = run_ranks(2, aborted_forward_worker)
        self.assertEqual(results[0], results[1])
        self.assertExpectedInline("\n".join(results[0]["unpatched"]), """\
after the exception: [KeyError] KeyError: 0
after reset_iter_state(): ok""")
        self.assertExpectedInline("\n".join(results[0]["patched"]), """\
after the exception: [KeyError/ValueError] OptimizerParamNotInModelError: AdamW holds a parameter that the model does not own: param_groups[0]['params'][0] (DTensor of shape (16, 8)). Pass the model that owns every parameter of the optimizer. The model holds a plain tensor of that shape instead ('embed.weight', 'head.weight'): if it uses fully_shard, the group that owns the parameter may be unsharded, e.g. after a forward without backward. Call reshard() on the model's FSDP modules on every rank (after an exception in forward, reset_iter_state() on the root first), or pass the root module.
after reset_iter_state(): ok""")


if __name__ == "__main__":
    unittest.main()
