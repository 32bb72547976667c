"""dcp.save / dcp.load after an evaluation forward: exact restore, identical training."""

import tempfile
import unittest

import expecttest
import pytest
import torch.distributed.checkpoint as dcp

import backport
from _fsdp_cases import (
    CASES,
    build,
    clone,
    count_tensors,
    describe_error,
    differences,
    evaluate,
    get_model_state_dict,
    get_optimizer_state_dict,
    outcomes,
    set_state_dict,
    side_by_side,
    train_step,
)
from _ranks import run_ranks


pytestmark = pytest.mark.ranks


STEPS_AFTER = 3


def _save(model, optims, options, path):
    # The optimizer first, as accelerate's save_fsdp_optimizer and an
    # optimizer-only checkpoint do: model.state_dict() would reshard first.
    osd = get_optimizer_state_dict(model, optims, options=options)
    msd = get_model_state_dict(model, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return clone(msd), clone(osd)


def _load(model, optims, options, path, case):
    # The state dicts that dcp.load fills in are taken at setup; the model is
    # evaluated before the load, as when resuming right after a validation.
    state = {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, optims, options=options),
    }
    evaluate(model, case)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optims, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=options,
    )


def _outcome(fn, *args):
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - the outcome is what we render
        return describe_error(err, first_line=True)
    return "ok"


def roundtrip_worker(case_name: str, ckpt_dir: str) -> list[str]:
    case = CASES[case_name]
    lines = []

    # Unpatched: saving after an evaluation fails, and so does loading into an
    # evaluated model a checkpoint taken before any evaluation.
    model, optims, options = build(case)
    train_step(model, optims, 0)
    evaluate(model, case)
    outcome = _outcome(_save, model, optims, options, f"{ckpt_dir}/a")
    lines.append(f"unpatched save after eval: {outcome}")
    model, optims, options = build(case)
    train_step(model, optims, 0)
    _save(model, optims, options, f"{ckpt_dir}/b")
    fresh, fresh_optims, _ = build(case, seed=1)
    outcome = _outcome(_load, fresh, fresh_optims, options, f"{ckpt_dir}/b", case)
    lines.append(f"unpatched load after eval: {outcome}")

    backport.apply()
    try:
        # Reference: the same schedule, never checkpointed.
        model, optims, options = build(case)
        ref_losses = [train_step(model, optims, 0)]
        evaluate(model, case)
        ref_losses += [train_step(model, optims, step) for step in range(1, 1 + STEPS_AFTER)]

        model, optims, options = build(case)
        losses = [train_step(model, optims, 0)]
        evaluate(model, case)
        saved_msd, saved_osd = _save(model, optims, options, f"{ckpt_dir}/c")
        losses += [train_step(model, optims, step) for step in range(1, 1 + STEPS_AFTER)]

        # A differently initialized model, evaluated before it loads.
        restored, restored_optims, _ = build(case, seed=1)
        _load(restored, restored_optims, options, f"{ckpt_dir}/c", case)
        optim_diffs = differences(
            get_optimizer_state_dict(restored, restored_optims, options=options), saved_osd
        )
        model_diffs = differences(get_model_state_dict(restored, options=options), saved_msd)
        restored_losses = losses[:1] + [
            train_step(restored, restored_optims, step) for step in range(1, 1 + STEPS_AFTER)
        ]
    finally:
        backport.revert()
    n_optim = count_tensors(saved_osd)
    n_model = count_tensors(saved_msd)
    lines += [
        f"patched optimizer state restored: {n_optim - len(optim_diffs)}/{n_optim} tensors equal",
        f"patched model state restored: {n_model - len(model_diffs)}/{n_model} tensors equal",
        f"losses with checkpoint == never checkpointed: {losses == ref_losses}",
        f"losses after load == losses of the saved run: {restored_losses == losses}",
    ]
    return lines


class CheckpointRoundtripTest(expecttest.TestCase):
    def _roundtrip(self, world_size: int, case_name: str) -> str:
        with tempfile.TemporaryDirectory() as ckpt_dir:
            results = run_ranks(world_size, roundtrip_worker, case_name, ckpt_dir)
        for rank, result in enumerate(results):
            self.assertEqual(result, results[0], f"rank {rank} disagrees with rank 0")
        return "\n".join(results[0])

    def test_roundtrip(self) -> None:
        """Save after an evaluation, load into a fresh model, train on: per case and world size."""
        columns = {
            f"{case_name}, {world_size} ranks": outcomes(self._roundtrip(world_size, case_name))
            for world_size, case_name in ((2, "root_none"), (2, "tied_weights"), (4, "hsdp"))
        }
        self.assertExpectedInline(side_by_side(columns), """\
                                             | root_none, 2 ranks  | tied_weights, 2 ranks | hsdp, 4 ranks
unpatched save after eval                    | KeyError: 0         | KeyError: 0           | KeyError: 0
unpatched load after eval                    | KeyError: <DTensor> | KeyError: <DTensor>   | KeyError: <DTensor>
patched optimizer state restored             | 36/36 tensors equal | 33/33 tensors equal   | 36/36 tensors equal
patched model state restored                 | 12/12 tensors equal | 12/12 tensors equal   | 12/12 tensors equal
losses with checkpoint == never checkpointed | True                | True                  | True
losses after load == losses of the saved run | True                | True                  | True""")


if __name__ == "__main__":
    unittest.main()
