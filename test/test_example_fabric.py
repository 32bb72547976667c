"""examples/fabric_fsdp2_eval_checkpoint.py runs on 2 CPU ranks and resumes identically."""

import os
import re
import subprocess
import sys
import tempfile
import unittest
from importlib.util import find_spec
from pathlib import Path

import expecttest
import pytest


pytestmark = pytest.mark.ranks


EXAMPLE = Path(__file__).parent.parent / "examples" / "fabric_fsdp2_eval_checkpoint.py"


@unittest.skipUnless(
    find_spec("lightning_fabric"), "needs the frameworks extra (nox: torch 2.13.0)"
)
class FabricExampleTest(expecttest.TestCase):
    def _run(self, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        """The example with its default output folder, under a TMPDIR of its own.

        Returns the run and what it left in that TMPDIR that it made itself.
        """
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 str(EXAMPLE), "--cpu", *extra],
                capture_output=True, text=True, timeout=600, check=False,
                # backport from this checkout, installed or not.
                env={**os.environ, "TMPDIR": tmp, "PYTHONPATH": os.pathsep.join(
                    [str(EXAMPLE.parent.parent), os.environ.get("PYTHONPATH", "")]
                )},
            )
            left = [name for name in os.listdir(tmp) if name.startswith("fsdp2_eval_ckpt_")]
        return proc, left

    def _steps(self, *extra: str) -> str:
        proc, left = self._run(*extra)
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        self.assertIn("\napplied: torch ", "\n" + proc.stdout)
        self.assertEqual(left, [], "the default output folder is removed at the end")
        # Loss values and the folder's name vary; what must hold does not.
        return "\n".join(
            re.sub(r"\d+\.\d+", "<loss>", re.sub(r"saved \S+/", "saved <out>/", line))
            for line in proc.stdout.splitlines()
            if line.startswith("step")
        )

    def test_distributed_checkpoint(self) -> None:
        self.assertExpectedInline(self._steps(), """\
step 2: eval loss <loss>, saved <out>/step_2
step 4: eval loss <loss>, saved <out>/step_4
step 3: resumed loss <loss> == original: True
step 4: resumed loss <loss> == original: True""")

    def test_full_checkpoint(self) -> None:
        self.assertExpectedInline(self._steps("--full-checkpoint"), """\
step 2: eval loss <loss>, saved <out>/step_2
step 4: eval loss <loss>, saved <out>/step_4
step 3: resumed loss <loss> == original: True
step 4: resumed loss <loss> == original: True""")

    def test_without_backport_shows_the_bug(self) -> None:
        proc, left = self._run("--without-backport")
        self.assertNotEqual(proc.returncode, 0, proc.stdout[-4000:])
        self.assertIn("\nnot applied: torch ", "\n" + proc.stdout)
        self.assertEqual(left, [], "the default output folder is removed on failure too")
        lines = sorted(
            re.sub(r"KeyError: \d+", "KeyError: <index>", line)
            for line in proc.stderr.splitlines()
            if "without the backport" in line
        )
        self.assertExpectedInline("\n".join(lines), """\
rank 0: without the backport, fabric.save after the evaluation raised KeyError: <index> (the bug backport.apply() fixes)
rank 1: without the backport, fabric.save after the evaluation raised KeyError: <index> (the bug backport.apply() fixes)""")


if __name__ == "__main__":
    unittest.main()
