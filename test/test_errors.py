"""An optimizer param the model does not own: a clear error instead of a bare KeyError."""

import unittest

import expecttest
import torch
import torch.nn as nn

from _fsdp_cases import (
    CASES,
    build,
    describe_error,
    evaluate,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
    train_step,
    unpatched_then_patched,
)
from backport._launch import run_ranks


def _calls(model, optims, options) -> list[str]:
    # Any state dict with FQN keys: the call fails while mapping the optimizer.
    first_fqn = next(iter(dict(model.named_parameters())))
    osd = {
        "state": {first_fqn: {"momentum_buffer": torch.zeros(1)}},
        "param_groups": [{"params": [first_fqn], "lr": 0.1}],
    }
    lines = []
    for name, call in (
        ("get_optimizer_state_dict", lambda: get_optimizer_state_dict(model, optims)),
        ("set_optimizer_state_dict", lambda: set_optimizer_state_dict(model, optims, osd)),
    ):
        try:
            call()
        except Exception as err:  # noqa: BLE001 - the message is what we pin
            lines.append(f"{name}: {describe_error(err)}")
        else:
            lines.append(f"{name}: ok")
    return lines


def foreign_param_worker() -> dict[str, list[str]]:
    """The second optimizer also holds a param that no module of the model has."""
    def run(label: str) -> dict[str, list[str]]:
        model, optims, options = build(CASES["root_none"])
        stray = nn.Parameter(torch.zeros(3, 5))
        optims.append(torch.optim.SGD([{"params": [stray]}], lr=0.1))
        optims[1].add_param_group({"params": [nn.Parameter(torch.ones(2))]})
        train_step(model, optims, 0)
        evaluate(model, CASES["root_none"])
        # A plain module without FSDP gets the same error.
        plain = nn.Linear(2, 2)
        plain_optims = [torch.optim.SGD([*plain.parameters(), stray], lr=0.1)]
        return {
            label: _calls(model, optims, options),
            f"plain {label}": _calls(plain, plain_optims, options),
        }

    runs = unpatched_then_patched(run)
    return {**runs["unpatched"], **runs["patched"]}


class ForeignOptimizerParamTest(expecttest.TestCase):
    def test_foreign_param_error(self) -> None:
        results = run_ranks(2, foreign_param_worker)
        self.assertEqual(results[0], results[1])
        result = results[0]
        self.assertExpectedInline("\n".join(result["unpatched"]), """\
get_optimizer_state_dict: KeyError: 0
set_optimizer_state_dict: KeyError: <DTensor>""")
        self.assertExpectedInline("\n".join(result["patched"]), """\
get_optimizer_state_dict: ValueError: SGD holds a parameter that the model does not own: param_groups[0]['params'][0], Parameter of shape (3, 5). Likely causes: the optimizer was built while FSDP2 modules were unsharded (after a forward without backward, or FSDPModule.unshard()), so it holds parameters that FSDP2 has replaced since; or the parameter belongs to another module. Build the optimizer from model.parameters() right after fully_shard(), and pass the model that owns all of its parameters.
set_optimizer_state_dict: RuntimeError: Missing optimizer state for parameter 'blocks.0.lin1.weight' in checkpoint. The parameter requires gradients but has no saved optimizer state. To load anyway, use StateDictOptions(strict=False).""")
        self.assertExpectedInline("\n".join(result["plain unpatched"]), """\
get_optimizer_state_dict: KeyError: 2
set_optimizer_state_dict: RuntimeError: Missing optimizer state for parameter 'bias' in checkpoint. The parameter requires gradients but has no saved optimizer state. To load anyway, use StateDictOptions(strict=False).""")
        self.assertExpectedInline("\n".join(result["plain patched"]), """\
get_optimizer_state_dict: ValueError: SGD holds a parameter that the model does not own: param_groups[0]['params'][2], Parameter of shape (3, 5). Likely causes: the optimizer was built while FSDP2 modules were unsharded (after a forward without backward, or FSDPModule.unshard()), so it holds parameters that FSDP2 has replaced since; or the parameter belongs to another module. Build the optimizer from model.parameters() right after fully_shard(), and pass the model that owns all of its parameters.
set_optimizer_state_dict: RuntimeError: Missing optimizer state for parameter 'bias' in checkpoint. The parameter requires gradients but has no saved optimizer state. To load anyway, use StateDictOptions(strict=False).""")


if __name__ == "__main__":
    unittest.main()
