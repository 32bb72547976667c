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
    def test_example_on_cpu(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/ckpt"
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 str(EXAMPLE), "--cpu-fsdp", "--steps", "3", "--output-dir", out],
                capture_output=True, text=True, timeout=600, check=False,
                # backport from this checkout, installed or not.
                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                    [str(EXAMPLE.parent.parent), os.environ.get("PYTHONPATH", "")]
                )},
            )
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        self.assertIn("\napplied: torch ", "\n" + proc.stdout)
        # Loss values depend on the torch build; what must hold does not.
        lines = [
            re.sub(r"\d+\.\d+", "<loss>", line.replace(out, "<out>"))
            for line in proc.stdout.splitlines()
            if line.startswith("step")
        ]
        self.assertExpectedInline("\n".join(lines), """\
step 2: eval loss <loss>, saved <out>/step_2
step 3: resumed loss <loss> == original: True
step 4: resumed loss <loss> == original: True""")

if __name__ == "__main__":
    unittest.main()
