"""The state dicts returned after an evaluation have the FQNs and param groups of a sharded model."""

import unittest

import expecttest
import pytest

import backport
from _fsdp_cases import (
    CASES,
    build,
    evaluate,
    get_model_state_dict,
    get_optimizer_state_dict,
    render_model_state_dict,
    render_optim_state_dict,
    train_step,
)
from _ranks import run_ranks


pytestmark = pytest.mark.ranks


def structure_worker() -> dict[str, str]:
    backport.apply()
    try:
        rendered = {}
        # Two optimizers, three param groups, Adam and SGD state.
        case = CASES["multi_optim_groups"]
        model, optims, options = build(case)
        train_step(model, optims, 0)
        evaluate(model, case)
        rendered["multi_optim"] = render_optim_state_dict(
            get_optimizer_state_dict(model, optims, options=options)
        )
        # Tied weights: one FQN per parameter object in the optimizer state.
        case = CASES["tied_weights"]
        model, optims, options = build(case)
        train_step(model, optims, 0)
        evaluate(model, case)
        osd = get_optimizer_state_dict(model, optims, options=options)
        rendered["tied_optim"] = render_optim_state_dict(osd)
        rendered["tied_model"] = render_model_state_dict(
            get_model_state_dict(model, options=options)
        )
        return rendered
    finally:
        backport.revert()


class StateDictStructureTest(expecttest.TestCase):
    def test_structure_after_eval(self) -> None:
        results = run_ranks(2, structure_worker)
        self.assertEqual(results[0], results[1])
        self.assertExpectedInline(results[0]["multi_optim"], """\
state[blocks.0.lin1.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.0.lin1.weight]: exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.0.lin2.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.0.lin2.weight]: exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.1.lin1.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.1.lin1.weight]: exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.1.lin2.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.1.lin2.weight]: exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[embed.weight]: momentum_buffer=DTensor[16, 8] torch.float32 (S(0))
state[head.weight]: momentum_buffer=DTensor[16, 8] torch.float32 (S(0))
state[norm.bias]: momentum_buffer=DTensor[8] torch.float32 (S(0))
state[norm.weight]: momentum_buffer=DTensor[8] torch.float32 (S(0))
param_groups[0] lr=0.01: blocks.0.lin1.weight, blocks.0.lin1.bias, blocks.1.lin1.weight, blocks.1.lin1.bias
param_groups[1] lr=0.005: blocks.0.lin2.weight, blocks.0.lin2.bias, blocks.1.lin2.weight, blocks.1.lin2.bias
param_groups[2] lr=0.01: embed.weight, norm.weight, norm.bias, head.weight""")
        self.assertExpectedInline(results[0]["tied_optim"], """\
state[blocks.0.lin1.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.0.lin1.weight]: exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.0.lin2.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.0.lin2.weight]: exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.1.lin1.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.1.lin1.weight]: exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.1.lin2.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[blocks.1.lin2.weight]: exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[embed.weight]: exp_avg=DTensor[16, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[16, 8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[norm.bias]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
state[norm.weight]: exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32
param_groups[0] lr=0.01: embed.weight, blocks.0.lin1.weight, blocks.0.lin1.bias, blocks.0.lin2.weight, blocks.0.lin2.bias, blocks.1.lin1.weight, blocks.1.lin1.bias, blocks.1.lin2.weight, blocks.1.lin2.bias, norm.weight, norm.bias""")
        self.assertExpectedInline(results[0]["tied_model"], """\
blocks.0.lin1.bias: DTensor[8] torch.float32 (S(0))
blocks.0.lin1.weight: DTensor[8, 8] torch.float32 (S(0))
blocks.0.lin2.bias: DTensor[8] torch.float32 (S(0))
blocks.0.lin2.weight: DTensor[8, 8] torch.float32 (S(0))
blocks.1.lin1.bias: DTensor[8] torch.float32 (S(0))
blocks.1.lin1.weight: DTensor[8, 8] torch.float32 (S(0))
blocks.1.lin2.bias: DTensor[8] torch.float32 (S(0))
blocks.1.lin2.weight: DTensor[8, 8] torch.float32 (S(0))
embed.weight: DTensor[16, 8] torch.float32 (S(0))
head.weight: DTensor[16, 8] torch.float32 (S(0))
norm.bias: DTensor[8] torch.float32 (S(0))
norm.weight: DTensor[8] torch.float32 (S(0))""")


if __name__ == "__main__":
    unittest.main()
