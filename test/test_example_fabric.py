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
    def _run(self, *extra: str) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/ckpt"
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 str(EXAMPLE), "--cpu", "--output-dir", out, *extra],
                capture_output=True, text=True, timeout=600, check=False,
                # backport from this checkout, installed or not.
                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                    [str(EXAMPLE.parent.parent), os.environ.get("PYTHONPATH", "")]
                )},
            )
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        self.assertIn("\napplied: torch ", "\n" + proc.stdout)
        # Loss values depend on the torch build; what must hold does not.
        return "\n".join(
            re.sub(r"\d+\.\d+", "<loss>", line.replace(out, "<out>"))
            for line in proc.stdout.splitlines()
            if line.startswith("step")
        )

    def test_distributed_checkpoint(self) -> None:
        self.assertExpectedInline(self._run(), """\
step 2: eval loss <loss>, saved <out>/step_2
step 4: eval loss <loss>, saved <out>/step_4
step 3: resumed loss <loss> == original: True
step 4: resumed loss <loss> == original: True""")

    def test_full_checkpoint(self) -> None:
        self.assertExpectedInline(self._run("--full-checkpoint"), """\
step 2: eval loss <loss>, saved <out>/step_2
step 4: eval loss <loss>, saved <out>/step_4
step 3: resumed loss <loss> == original: True
step 4: resumed loss <loss> == original: True""")


if __name__ == "__main__":
    unittest.main()
