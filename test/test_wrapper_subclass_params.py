"""FSDP2 parameters that are wrapper tensor subclasses: torchao's int8 and float8 training weights.

torchao's ``int8_mixed_precision_training`` makes each Linear weight an
``Int8MixedPrecisionTrainingLinearWeight``, which FSDP2 all-gathers through its
``fsdp_pre_all_gather`` extension. Sharded, the parameter is a DTensor around
such a tensor; unsharded, the tensor itself, holding its data in the inner
tensor ``_data``, a view of the all-gather output that ``reshard()`` frees.
Each case runs the six DCP calls as ``test_tensor_parallel.py`` does; a new
optimizer built after an evaluation must get PR A's ValueError from the
backport, which sees the freed storage through ``__tensor_flatten__``.

torchao's ``convert_to_float8_training`` with FSDP2's float8 all-gather
(``enable_fsdp_float8_all_gather``) makes each block Linear's weight a
``WeightWithDynamicFloat8CastTensor``; unsharded, it is a
``Float8TrainingTensor`` whose float8 data (``_data``) is a view of the
all-gather output. ``pad_inner_dim`` pads the model's dimension of 8 to the
16 that the float8 matmul needs; it runs on CPU. Not covered, as both fail
on stock torch before DSD is reached: an evaluation under ``inference_mode``
("Cannot set version_counter for inference tensor") and an optimizer built
after an evaluation (Adam's ``zeros_like`` on the unsharded
``Float8TrainingTensor``: "attempting to run aten.zeros_like.default, this is
not supported").
"""

import unittest
from importlib.util import find_spec

import expecttest
import pytest

import _fsdp_cases
from _fsdp_cases import (
    Case,
    cases_table,
    optimizer_built_after_evaluation_worker,
    render_before_after,
    run_agreed,
    side_by_side,
)


pytestmark = pytest.mark.ranks

# Blocks left unsharded by an evaluation hold the int8 weights unsharded;
# with the blocks resharded after forward only the root's plain parameters are.
CASES = {
    "blocks unsharded, no_grad": Case(int8_training=True, blocks=False),
    "blocks unsharded, inference_mode": Case(
        int8_training=True, blocks=False, inference_mode=True
    ),
    "unshard() on every module": Case(int8_training=True, unshard=True),
    "control: reshard_after_forward=True": Case(int8_training=True, root=True),
}


class Float8TinyLM(_fsdp_cases.TinyLM):
    """TinyLM with the blocks' Linears converted to torchao's float8 training."""

    def __init__(self, **kwargs) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        super().__init__(**kwargs)
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, pad_inner_dim=True)
        convert_to_float8_training(self.blocks, config=config)


def float8(worker):
    """``worker`` run with ``_fsdp_cases.build`` making Float8TinyLM models."""

    def run(*args):
        plain, _fsdp_cases.TinyLM = _fsdp_cases.TinyLM, Float8TinyLM
        try:
            return worker(*args)
        finally:
            _fsdp_cases.TinyLM = plain

    return run


def float8_cases_worker(cases):
    return float8(_fsdp_cases.cases_worker)(cases)


FLOAT8_CASES = {
    "blocks unsharded, no_grad": Case(blocks=False),
    "unshard() on every module": Case(unshard=True),
    "control: reshard_after_forward=True": Case(root=True),
}


@unittest.skipUnless(find_spec("torchao"), "needs the torchao extra (nox: torch 2.10 on)")
class Int8TrainingWeightTest(expecttest.TestCase):
    def test_state_dict_calls_after_an_evaluation(self) -> None:
        self.assertExpectedInline(
            cases_table(2, CASES),
            """\
case                                | stock                                                                 | backport applied
blocks unsharded, no_grad           | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
blocks unsharded, inference_mode    | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
unshard() on every module           | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
control: reshard_after_forward=True | all 6 calls ok                                                        | all 6 calls ok""",
        )

    def test_optimizer_built_after_an_evaluation(self) -> None:
        # The root group is resharded after forward and the blocks are not:
        # params[1] is the first block's int8 weight, params[2] its plain bias.
        cases = {"int8": Case(int8_training=True, root=True, blocks=False)}
        result = run_agreed(2, optimizer_built_after_evaluation_worker, cases)
        self.assertExpectedInline(render_before_after(result), """\
                                                                | stock -> backport applied
int8, built before any forward, get                             | ok, state for 12 of 12 optimizer params
int8, built after an evaluation, get                            | ok, state for 12 of 12 optimizer params -> ValueError: Adam param_groups[0]['params'][1] (shape (8, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
int8, built after an evaluation, set                            | ok -> ValueError: Adam param_groups[0]['params'][1] (shape (8, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
int8, built after an evaluation, resharded before the call, get | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][1] (shape (8, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
int8, built after an evaluation, resharded before the call, set | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][1] (shape (8, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().""")


@unittest.skipUnless(find_spec("torchao"), "needs the torchao extra (nox: torch 2.10 on)")
class Float8TrainingWeightTest(expecttest.TestCase):
    def test_state_dict_calls_after_an_evaluation(self) -> None:
        result = run_agreed(2, float8_cases_worker, FLOAT8_CASES)
        self.assertEqual(
            result["patched"]["control: reshard_after_forward=True"],
            result["unpatched"]["control: reshard_after_forward=True"],
        )
        self.assertExpectedInline(
            side_by_side(
                {"stock": result["unpatched"], "backport applied": result["patched"]}, "case"
            ),
            """\
case                                | stock                                                                 | backport applied
blocks unsharded, no_grad           | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
unshard() on every module           | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
control: reshard_after_forward=True | all 6 calls ok                                                        | all 6 calls ok""",
        )


if __name__ == "__main__":
    unittest.main()
