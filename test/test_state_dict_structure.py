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
    model_state_dict_rows,
    optim_state_dict_rows,
    side_by_side,
    train_step,
)
from _ranks import run_ranks


pytestmark = pytest.mark.ranks


def structure_worker() -> dict[str, dict[str, str]]:
    backport.apply()
    try:
        columns = {}
        # Two optimizers, three param groups, Adam and SGD state; and tied
        # weights: one FQN per parameter object in the optimizer state.
        for name in ("multi_optim_groups", "tied_weights"):
            case = CASES[name]
            model, optims, options = build(case)
            train_step(model, optims, 0)
            evaluate(model, case)
            columns[f"{name} optimizer"] = optim_state_dict_rows(
                get_optimizer_state_dict(model, optims, options=options)
            )
        columns["tied_weights model"] = model_state_dict_rows(
            get_model_state_dict(model, options=options)
        )
        return columns
    finally:
        backport.revert()


class StateDictStructureTest(expecttest.TestCase):
    def test_structure_after_eval(self) -> None:
        results = run_ranks(2, structure_worker)
        self.assertEqual(results[0], results[1])
        self.assertExpectedInline(side_by_side(results[0]), """\
                         | multi_optim_groups optimizer                                                                                           | tied_weights optimizer                                                                                                                                                                                       | tied_weights model
blocks.0.lin1.bias       | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32       | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                             | DTensor[8] torch.float32 (S(0))
blocks.0.lin1.weight     | exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32 | exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                       | DTensor[8, 8] torch.float32 (S(0))
blocks.0.lin2.bias       | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32       | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                             | DTensor[8] torch.float32 (S(0))
blocks.0.lin2.weight     | exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32 | exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                       | DTensor[8, 8] torch.float32 (S(0))
blocks.1.lin1.bias       | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32       | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                             | DTensor[8] torch.float32 (S(0))
blocks.1.lin1.weight     | exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32 | exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                       | DTensor[8, 8] torch.float32 (S(0))
blocks.1.lin2.bias       | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32       | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                             | DTensor[8] torch.float32 (S(0))
blocks.1.lin2.weight     | exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32 | exp_avg=DTensor[8, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[8, 8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                       | DTensor[8, 8] torch.float32 (S(0))
embed.weight             | momentum_buffer=DTensor[16, 8] torch.float32 (S(0))                                                                    | exp_avg=DTensor[16, 8] torch.float32 (S(0)), exp_avg_sq=DTensor[16, 8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                     | DTensor[16, 8] torch.float32 (S(0))
head.weight              | momentum_buffer=DTensor[16, 8] torch.float32 (S(0))                                                                    | -                                                                                                                                                                                                            | DTensor[16, 8] torch.float32 (S(0))
norm.bias                | momentum_buffer=DTensor[8] torch.float32 (S(0))                                                                        | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                             | DTensor[8] torch.float32 (S(0))
norm.weight              | momentum_buffer=DTensor[8] torch.float32 (S(0))                                                                        | exp_avg=DTensor[8] torch.float32 (S(0)), exp_avg_sq=DTensor[8] torch.float32 (S(0)), step=Tensor[] torch.float32                                                                                             | DTensor[8] torch.float32 (S(0))
param_groups[0] lr=0.01  | blocks.0.lin1.weight, blocks.0.lin1.bias, blocks.1.lin1.weight, blocks.1.lin1.bias                                     | embed.weight, blocks.0.lin1.weight, blocks.0.lin1.bias, blocks.0.lin2.weight, blocks.0.lin2.bias, blocks.1.lin1.weight, blocks.1.lin1.bias, blocks.1.lin2.weight, blocks.1.lin2.bias, norm.weight, norm.bias | -
param_groups[1] lr=0.005 | blocks.0.lin2.weight, blocks.0.lin2.bias, blocks.1.lin2.weight, blocks.1.lin2.bias                                     | -                                                                                                                                                                                                            | -
param_groups[2] lr=0.01  | embed.weight, norm.weight, norm.bias, head.weight                                                                      | -                                                                                                                                                                                                            | -""")


if __name__ == "__main__":
    unittest.main()
