"""FSDP2 composed with tensor parallelism: bug cases and controls on 2-D and 3-D meshes.

With TP, FSDP2's unsharded parameters are DTensors on the TP mesh, not plain
tensors. Each case runs the six DCP calls after an evaluation (or unshard())
on torch as installed and again after ``backport.apply()``, and compares with
the state before the evaluation exactly (``_fsdp_cases.run_case``); the next
two training steps must give the losses of a run that never evaluated.
"""

import unittest

import expecttest
import pytest

from _fsdp_cases import (
    Case,
    cases_table,
    optimizer_built_after_evaluation_worker,
    render_before_after,
    run_agreed,
    tp_mesh_shape,
)


pytestmark = pytest.mark.ranks


def _mesh(world_size: int, case: Case) -> str:
    shape, names = tp_mesh_shape(case, world_size)
    return f"({', '.join(names)})={shape}"


def tp_cases(world_size: int) -> dict[str, Case]:
    """Each TP degree that fits ``world_size``: three evaluations, SP, HSDP, two controls.

    At 4 ranks (CI time) no_grad is the only evaluation and TP without FSDP2
    is not run: 2 ranks run inference_mode, unshard() and that control on both
    2-D meshes; 4 ranks add meshes, not evaluations.
    """
    degrees = (1, world_size) if world_size == 2 else (world_size // 2,)
    cases = {}
    for tp in degrees:
        mesh = _mesh(world_size, Case(tp=tp))
        cases[f"{mesh} no_grad"] = Case(tp=tp)
        if world_size == 2:
            cases[f"{mesh} inference_mode"] = Case(tp=tp, inference_mode=True)
            cases[f"{mesh} unshard"] = Case(tp=tp, unshard=True)
        cases[f"{mesh} SP"] = Case(tp=tp, sequence_parallel=True)
        cases[f"{_mesh(world_size, Case(tp=tp, hsdp=True))} no_grad"] = Case(tp=tp, hsdp=True)
        # Controls: every group resharded after forward; TP without FSDP2.
        cases[f"{mesh} control: reshard_after_forward=True"] = Case(tp=tp, root=True)
        if world_size == 2:
            cases[f"{mesh} control: TP only"] = Case(tp=tp, fsdp=False)
    return cases


class TensorParallelTest(expecttest.TestCase):
    def test_world_size_2(self) -> None:
        self.assertExpectedInline(
            cases_table(2, tp_cases(2)),
            """\
case                                                | stock                                                                 | backport applied
(dp, tp)=(2, 1) no_grad                             | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(2, 1) inference_mode                      | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(2, 1) unshard                             | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(2, 1) SP                                  | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(replicate, shard, tp)=(2, 1, 1) no_grad            | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(2, 1) control: reshard_after_forward=True | all 6 calls ok                                                        | all 6 calls ok
(dp, tp)=(2, 1) control: TP only                    | all 6 calls ok                                                        | all 6 calls ok
(dp, tp)=(1, 2) no_grad                             | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(1, 2) inference_mode                      | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(1, 2) unshard                             | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(1, 2) SP                                  | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(replicate, shard, tp)=(1, 1, 2) no_grad            | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(1, 2) control: reshard_after_forward=True | all 6 calls ok                                                        | all 6 calls ok
(dp, tp)=(1, 2) control: TP only                    | all 6 calls ok                                                        | all 6 calls ok""",
        )

    def test_world_size_4(self) -> None:
        self.assertExpectedInline(
            cases_table(4, tp_cases(4)),
            """\
case                                                | stock                                                                 | backport applied
(dp, tp)=(2, 2) no_grad                             | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(2, 2) SP                                  | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(replicate, shard, tp)=(2, 1, 2) no_grad            | get_optim -> KeyError: 0; set_optim, set_state -> KeyError: <DTensor> | all 6 calls ok
(dp, tp)=(2, 2) control: reshard_after_forward=True | all 6 calls ok                                                        | all 6 calls ok""",
        )

    def test_optimizer_built_after_an_evaluation(self) -> None:
        # With SP every parameter is tensor parallel: the unsharded ones are TP DTensors.
        cases = {f"tp={tp}": Case(tp=tp, sequence_parallel=True) for tp in (1, 2)}
        result = run_agreed(2, optimizer_built_after_evaluation_worker, cases)
        self.assertExpectedInline(
            render_before_after(result),
            """\
                                                                | stock -> backport applied
tp=1, built before any forward, get                             | ok, state for 12 of 12 optimizer params
tp=1, built after an evaluation, get                            | ok, state for 12 of 12 optimizer params -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
tp=1, built after an evaluation, set                            | ok -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
tp=1, built after an evaluation, resharded before the call, get | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
tp=1, built after an evaluation, resharded before the call, set | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
tp=2, built before any forward, get                             | ok, state for 12 of 12 optimizer params
tp=2, built after an evaluation, get                            | ok, state for 12 of 12 optimizer params -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
tp=2, built after an evaluation, set                            | ok -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
tp=2, built after an evaluation, resharded before the call, get | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
tp=2, built after an evaluation, resharded before the call, set | not run (step() on freed storage) -> ValueError: Adam param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().""",
        )


if __name__ == "__main__":
    unittest.main()
