"""An optimizer built while FSDP2 groups were unsharded gets a ValueError, whatever reshard() frees.

Built after an evaluation, an optimizer holds the unsharded parameters of the
groups the evaluation left unsharded; they never train. Stock torch maps them
while the groups stay unsharded and returns a state dict. With the fix, the
call's reshard unregisters them and the call raises before any ``step()``:
whether ``reshard()`` frees their storage (the default), keeps it
(``set_keep_unsharded_storage(True)``, torch 2.15 on) or leaves DTensors on the
post-forward mesh (an ``int`` ``reshard_after_forward``). Resharded before the
call (by a backward or ``reshard()``), the freed-storage check raises for a
never-stepped optimizer; with the storage kept, the call fails as on stock.
"""

import unittest

import expecttest
import pytest

from _fsdp_cases import (
    RAF_INT,
    Case,
    FSDPModule,
    optimizer_built_after_evaluation_worker,
    render_before_after,
    run_agreed,
)


pytestmark = pytest.mark.ranks

HAS_KEEP_UNSHARDED_STORAGE = hasattr(FSDPModule, "set_keep_unsharded_storage")


class OptimizerBuiltWhileUnshardedTest(expecttest.TestCase):
    def test_world_size_2(self) -> None:
        cases = {"no_grad": Case(), "unshard()": Case(unshard=True)}
        result = run_agreed(2, optimizer_built_after_evaluation_worker, cases)
        self.assertExpectedInline(render_before_after(result), """\
                                                                     | stock -> backport applied
no_grad, built before any forward, get                               | ok, state for 12 of 12 optimizer params
no_grad, built after an evaluation, get                              | ok, state for 12 of 12 optimizer params -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
no_grad, built after an evaluation, set                              | ok -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
no_grad, built after an evaluation, resharded before the call, get   | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
no_grad, built after an evaluation, resharded before the call, set   | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
unshard(), built before any forward, get                             | ok, state for 12 of 12 optimizer params
unshard(), built after an evaluation, get                            | ok, state for 12 of 12 optimizer params -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
unshard(), built after an evaluation, set                            | ok -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
unshard(), built after an evaluation, resharded before the call, get | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
unshard(), built after an evaluation, resharded before the call, set | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().""")

    @unittest.skipUnless(HAS_KEEP_UNSHARDED_STORAGE, "set_keep_unsharded_storage: torch 2.15 on")
    def test_storage_kept_world_size_2(self) -> None:
        cases = {"kept storage": Case(keep_unsharded_storage=True)}
        result = run_agreed(2, optimizer_built_after_evaluation_worker, cases)
        self.assertExpectedInline(render_before_after(result), """\
                                                                        | stock -> backport applied
kept storage, built before any forward, get                             | ok, state for 12 of 12 optimizer params
kept storage, built after an evaluation, get                            | ok, state for 12 of 12 optimizer params -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
kept storage, built after an evaluation, set                            | ok -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
kept storage, built after an evaluation, resharded before the call, get | KeyError: 0 -> ValueError: Adam holds a parameter that the model does not own: param_groups[0]['params'][0] (Parameter of shape (16, 8)). Pass the model that owns every parameter of the optimizer.
kept storage, built after an evaluation, resharded before the call, set | KeyError: <Parameter> -> OptimizerParamNotInModelError: Adam holds a parameter that the model does not own: param_groups[0]['params'][0] (Parameter of shape (16, 8)). Pass the model that owns every parameter of the optimizer.""")

    def test_int_reshard_after_forward_world_size_4(self) -> None:
        # reshard_after_forward=2 on 4 ranks: the evaluation leaves DTensors on
        # a 2-rank post-forward mesh, whose storage reshard() never frees.
        cases = {"reshard_after_forward=2": Case(root=RAF_INT, blocks=RAF_INT)}
        result = run_agreed(4, optimizer_built_after_evaluation_worker, cases)
        self.assertExpectedInline(render_before_after(result), """\
                                                                                   | stock -> backport applied
reshard_after_forward=2, built before any forward, get                             | ok, state for 12 of 12 optimizer params
reshard_after_forward=2, built after an evaluation, get                            | ok, state for 12 of 12 optimizer params -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
reshard_after_forward=2, built after an evaluation, set                            | ok -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
reshard_after_forward=2, built after an evaluation, resharded before the call, get | KeyError: 0 -> ValueError: Adam holds a parameter that the model does not own: param_groups[0]['params'][0] (DTensor of shape (16, 8)). Pass the model that owns every parameter of the optimizer.
reshard_after_forward=2, built after an evaluation, resharded before the call, set | KeyError: <DTensor> -> OptimizerParamNotInModelError: Adam holds a parameter that the model does not own: param_groups[0]['params'][0] (DTensor of shape (16, 8)). Pass the model that owns every parameter of the optimizer.""")


if __name__ == "__main__":
    unittest.main()
