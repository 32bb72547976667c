"""lightning_patch/ applied to the installed Lightning 2.6.6, on torch as installed (no backport).

Fabric's load of a full checkpoint (``save_distributed_checkpoint=False``) after an
evaluation fails in ``_load_raw_module_state`` on stock Lightning and restores
exactly with the patch; without an evaluation both restore exactly. The patched
``lightning_fabric/strategies/model_parallel.py`` is a copy of the installed one
with the patch applied by ``git apply``, served under its real module name in the
ranks; the installed package is never modified.
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

from backport._launch import run_ranks


PATCHES = sorted((Path(__file__).parent.parent / "lightning_patch").glob("0*.patch"))
MODULE = "lightning_fabric.strategies.model_parallel"


class _PatchedModuleFinder(importlib.abc.MetaPathFinder):
    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path)


def _patched_copy(scratch: Path) -> Path:
    """The installed module with the patches applied, in ``scratch``."""
    installed = Path(find_spec(MODULE).origin)
    target = scratch / "lightning_fabric" / "strategies" / "model_parallel.py"
    target.parent.mkdir(parents=True)
    target.write_bytes(installed.read_bytes())
    for patch in PATCHES:
        # Upstream's src/lightning/fabric/ is the lightning_fabric package.
        subprocess.run(
            ["git", "apply", "-p4", "--directory=lightning_fabric", str(patch)],
            cwd=scratch, check=True, capture_output=True, text=True,
        )
    return target


def full_load_worker(patched_module: str | None, checkpoint_dir: str) -> str:
    if patched_module is not None:
        sys.meta_path.insert(0, _PatchedModuleFinder(patched_module))
    from test_lightning_fabric import _setup, _states, perturb_then_load
    import lightning_fabric.strategies.model_parallel as model_parallel

    assert (model_parallel.__file__ == patched_module) == (patched_module is not None)
    lines = []
    for evaluated in (False, True):
        fabric, model, optimizer = _setup(save_distributed_checkpoint=False)
        saved = _states(model, optimizer)
        path = Path(checkpoint_dir) / f"{patched_module is not None}-{evaluated}.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        outcome = perturb_then_load(fabric, path, model, optimizer, saved, evaluated)
        lines.append(f"{'after an evaluation' if evaluated else 'no evaluation'}: {outcome}")
    return "\n".join(lines)


@unittest.skipUnless(
    find_spec("lightning_fabric"), "needs the frameworks extra (nox: torch 2.13.0)"
)
class LightningPatchTest(expecttest.TestCase):
    def test_full_checkpoint_load_after_evaluation(self) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            patched = str(_patched_copy(Path(scratch) / "tree"))
            results = {
                label: run_ranks(2, full_load_worker, module, scratch)
                for label, module in (("stock", None), ("patched", patched))
            }
        for label, by_rank in results.items():
            self.assertEqual(by_rank[0], by_rank[1], label)
        self.assertExpectedInline(results["stock"][0], """\
no evaluation: restored exactly
after an evaluation: RuntimeError: Error(s) in loading state_dict for Embedding:""")
        self.assertExpectedInline(results["patched"][0], """\
no evaluation: restored exactly
after an evaluation: restored exactly""")


if __name__ == "__main__":
    unittest.main()
