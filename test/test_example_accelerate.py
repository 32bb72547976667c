"""examples/accelerate_fsdp2_eval_checkpoint.py runs on 2 CPU ranks and resumes identically."""

import os
import re
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import expecttest
import pytest


pytestmark = pytest.mark.ranks


EXAMPLE = Path(__file__).parent.parent / "examples" / "accelerate_fsdp2_eval_checkpoint.py"

try:
    import accelerate
    import transformers  # noqa: F401
except ImportError:  # the suite's test extra installs them
    accelerate = None


@unittest.skipIf(accelerate is None, "needs accelerate and transformers")
class AccelerateExampleTest(expecttest.TestCase):
    def _run(self, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        """The example with its default output folder, under a TMPDIR of its own.

        Returns the run and what it left in that TMPDIR that it made itself.
        """
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 str(EXAMPLE), "--cpu-fsdp", "--steps", "3", *extra],
                capture_output=True, text=True, timeout=600, check=False,
                # backport from this checkout, installed or not.
                env={**os.environ, "TMPDIR": tmp, "PYTHONPATH": os.pathsep.join(
                    [str(EXAMPLE.parent.parent), os.environ.get("PYTHONPATH", "")]
                )},
            )
            left = [name for name in os.listdir(tmp) if name.startswith("fsdp2_eval_ckpt_")]
        return proc, left

    def test_example_on_cpu(self) -> None:
        proc, left = self._run()
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        self.assertIn("\napplied: torch ", "\n" + proc.stdout)
        self.assertEqual(left, [], "the default output folder is removed at the end")
        # Loss values and the folder's name vary; what must hold does not.
        lines = [
            re.sub(r"\d+\.\d+", "<loss>", re.sub(r"saved \S+/", "saved <out>/", line))
            for line in proc.stdout.splitlines()
            if line.startswith("step")
        ]
        self.assertExpectedInline("\n".join(lines), """\
step 2: eval loss <loss>, saved <out>/step_2
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
rank 0: without the backport, saving the optimizer after the evaluation raised KeyError: <index> (the bug backport.apply() fixes)
rank 1: without the backport, saving the optimizer after the evaluation raised KeyError: <index> (the bug backport.apply() fixes)""")


if __name__ == "__main__":
    unittest.main()
