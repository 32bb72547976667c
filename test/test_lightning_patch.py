"""upstream/lightning_patch/ applied to the installed Lightning 2.6.6, on torch as installed (no backport).

An evaluation (a forward under ``no_grad``) leaves FSDP2 groups with
``reshard_after_forward=False``, the root default, unsharded. Fabric then fails on
stock Lightning in four ways, each restored exactly with the patch:

- blocks sharded, embedding and head in the root's group ("mixed"): the full
  load mixes Tensors and DTensors in one module;
- every module with parameters its own FSDP2 root ("rootless", the layout of
  Lightning's own ``_parallelize_feed_forward_fsdp2``), or ``fully_shard`` on the
  root only: no DTensor parameter is left, so Fabric finds no distributed model,
  on save and on load, for both checkpoint kinds;
- ``fabric.save`` with the optimizer listed before the model: DSD's KeyError.

The last scenario works on stock Lightning and must work the same when patched.
This project's backport (the DSD fix) run on stock Lightning fixes the mixed
model's failures but not the rootless and root-only ones, which Lightning rejects
before it calls DSD.
The patched ``lightning_fabric/strategies/model_parallel.py`` is a copy of the
installed one with the patch applied by ``git apply``, served under its real
module name in the ranks; the installed package is never modified.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import subprocess
import sys
import tempfile
import unittest
from importlib.util import find_spec
from pathlib import Path

import expecttest
import pytest
from torch.distributed.fsdp import fully_shard

import backport
from _fsdp_cases import evaluate, outcome_of, side_by_side
from _ranks import run_ranks
from test_lightning_fabric import _parallelize as _parallelize_mixed
from test_lightning_fabric import _setup, _states, perturb_then_load


pytestmark = [pytest.mark.ranks, pytest.mark.fresh_ranks, pytest.mark.frameworks]


PATCH = Path(__file__).parent.parent / "upstream/lightning_patch/modelparallel-reshard-fsdp2.patch"
MODULE = "lightning_fabric.strategies.model_parallel"


class _PatchedModuleFinder(importlib.abc.MetaPathFinder):
    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path)


def _patched_copy(scratch: Path) -> Path:
    """The installed module with the patch applied, in ``scratch``."""
    installed = Path(find_spec(MODULE).origin)
    target = scratch / "lightning_fabric" / "strategies" / "model_parallel.py"
    target.parent.mkdir(parents=True)
    target.write_bytes(installed.read_bytes())
    # Upstream's src/lightning/fabric/ is the lightning_fabric package; the
    # CHANGELOG and test hunks are for Lightning's tree and are left out. The
    # patch is made against Lightning's master, whose path handling differs
    # three lines above the first change: two lines of context must match.
    subprocess.run(
        [
            "git", "apply", "-C2", "-p4", "--directory=lightning_fabric",
            "--include=lightning_fabric/strategies/model_parallel.py", str(PATCH),
        ],
        cwd=scratch, check=True, capture_output=True, text=True,
    )
    return target


def _parallelize_rootless(model, device_mesh):
    # Each becomes its own FSDP2 root and keeps the root default: unsharded after a forward.
    mesh = device_mesh["data_parallel"]
    for module in (model.embed, *model.blocks, model.norm, model.head):
        fully_shard(module, mesh=mesh)
    return model


def _parallelize_root_only(model, device_mesh):
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _save_and_load_after_evaluation(
    directory: Path, parallelize_fn, sharded: bool, optimizer_first: bool
) -> dict[str, str]:
    """Train a step and save; evaluate, save again; perturb, evaluate, load each save."""
    fabric, model, optimizer = _setup(sharded, parallelize_fn)
    saved = _states(model, optimizer)
    state = {"optimizer": optimizer, "model": model} if optimizer_first else {
        "model": model, "optimizer": optimizer
    }
    directory.mkdir(parents=True, exist_ok=True)
    # Right after a backward every group is sharded: stock Lightning saves this.
    fabric.save(directory / "before-eval", state)
    evaluate(model)
    saved_after_eval = outcome_of(lambda: fabric.save(directory / "after-eval", state))

    def load(name: str) -> str:
        return perturb_then_load(fabric, directory / name, model, optimizer, saved, True)

    outcomes = {
        "save after eval": saved_after_eval,
        "load after eval": load("before-eval"),
    }
    # The outcome, shared by every rank, decides; files a failed save left do not.
    outcomes["load of the save after eval"] = load("after-eval") if saved_after_eval == "ok" else "-"
    # Lightning's "Could not find a distributed model ..." goes on for three sentences.
    return {step: outcome.split(". ")[0] for step, outcome in outcomes.items()}


def scenarios_worker(
    patched_module: str | None, with_backport: bool, checkpoint_dir: str
) -> dict[str, dict[str, str]]:
    """Every scenario on Lightning as installed or patched, with or without the backport."""
    if patched_module is not None:
        sys.meta_path.insert(0, _PatchedModuleFinder(patched_module))
    from lightning_fabric.strategies import model_parallel

    assert (model_parallel.__file__ == patched_module) == (patched_module is not None)
    if with_backport:
        backport.apply()
    expected_status = "applied" if with_backport else "not applied"
    assert backport.status().startswith(expected_status), backport.status()
    scenarios = {
        "mixed, full": (_parallelize_mixed, False, False),
        "rootless, full": (_parallelize_rootless, False, False),
        "rootless, distributed": (_parallelize_rootless, True, False),
        "root only, full": (_parallelize_root_only, False, False),
        "root only, distributed": (_parallelize_root_only, True, False),
        "mixed, full, optimizer first": (_parallelize_mixed, False, True),
        "mixed, distributed, optimizer first": (_parallelize_mixed, True, True),
        "mixed, distributed": (_parallelize_mixed, True, False),
    }
    directory = Path(checkpoint_dir) / f"{patched_module is not None}-{with_backport}"
    return {
        label: _save_and_load_after_evaluation(directory / str(index), *scenario)
        for index, (label, scenario) in enumerate(scenarios.items())
    }


def _column(scenarios: dict[str, dict[str, str]]) -> dict[str, str]:
    """{"scenario: step": outcome}, a column of the table."""
    return {
        f"{label}: {step}": outcome
        for label, steps in scenarios.items()
        for step, outcome in steps.items()
    }


@unittest.skipUnless(
    find_spec("lightning_fabric"), "needs the frameworks extra (nox: torch 2.13.0)"
)
class LightningPatchTest(expecttest.TestCase):
    def test_save_and_load_after_evaluation(self) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            patched = str(_patched_copy(Path(scratch) / "tree"))
            results = {
                world: run_ranks(2, scenarios_worker, module, with_backport, scratch)
                for world, module, with_backport in (
                    ("stock", None, False),
                    ("patched", patched, False),
                    # The DSD fix alone: Lightning rejects the models it never passes to DSD.
                    ("stock, backport applied", None, True),
                )
            }
        for world, by_rank in results.items():
            self.assertEqual(by_rank[0], by_rank[1], world)
        table = side_by_side({world: _column(by_rank[0]) for world, by_rank in results.items()})
        self.assertExpectedInline(table, """\
                                                                 | stock                                                                           | patched          | stock, backport applied
mixed, full: save after eval                                     | ok                                                                              | ok               | ok
mixed, full: load after eval                                     | RuntimeError: Error(s) in loading state_dict for Embedding:                     | restored exactly | restored exactly
mixed, full: load of the save after eval                         | RuntimeError: Error(s) in loading state_dict for Embedding:                     | restored exactly | restored exactly
rootless, full: save after eval                                  | ValueError: Could not find a distributed model in the provided checkpoint state | ok               | ValueError: Could not find a distributed model in the provided checkpoint state
rootless, full: load after eval                                  | ValueError: Could not find a distributed model in the provided checkpoint state | restored exactly | ValueError: Could not find a distributed model in the provided checkpoint state
rootless, full: load of the save after eval                      | -                                                                               | restored exactly | -
rootless, distributed: save after eval                           | ValueError: Could not find a distributed model in the provided checkpoint state | ok               | ValueError: Could not find a distributed model in the provided checkpoint state
rootless, distributed: load after eval                           | ValueError: Could not find a distributed model in the provided checkpoint state | restored exactly | ValueError: Could not find a distributed model in the provided checkpoint state
rootless, distributed: load of the save after eval               | -                                                                               | restored exactly | -
root only, full: save after eval                                 | ValueError: Could not find a distributed model in the provided checkpoint state | ok               | ValueError: Could not find a distributed model in the provided checkpoint state
root only, full: load after eval                                 | ValueError: Could not find a distributed model in the provided checkpoint state | restored exactly | ValueError: Could not find a distributed model in the provided checkpoint state
root only, full: load of the save after eval                     | -                                                                               | restored exactly | -
root only, distributed: save after eval                          | ValueError: Could not find a distributed model in the provided checkpoint state | ok               | ValueError: Could not find a distributed model in the provided checkpoint state
root only, distributed: load after eval                          | ValueError: Could not find a distributed model in the provided checkpoint state | restored exactly | ValueError: Could not find a distributed model in the provided checkpoint state
root only, distributed: load of the save after eval              | -                                                                               | restored exactly | -
mixed, full, optimizer first: save after eval                    | KeyError: 0                                                                     | ok               | ok
mixed, full, optimizer first: load after eval                    | RuntimeError: Error(s) in loading state_dict for Embedding:                     | restored exactly | restored exactly
mixed, full, optimizer first: load of the save after eval        | -                                                                               | restored exactly | restored exactly
mixed, distributed, optimizer first: save after eval             | KeyError: 0                                                                     | ok               | ok
mixed, distributed, optimizer first: load after eval             | restored exactly                                                                | restored exactly | restored exactly
mixed, distributed, optimizer first: load of the save after eval | -                                                                               | restored exactly | restored exactly
mixed, distributed: save after eval                              | ok                                                                              | ok               | ok
mixed, distributed: load after eval                              | restored exactly                                                                | restored exactly | restored exactly
mixed, distributed: load of the save after eval                  | restored exactly                                                                | restored exactly | restored exactly""")


if __name__ == "__main__":
    unittest.main()
