"""torch_patch/prove.py on the installed torch: the upstream test fails unpatched, passes patched."""

import os
import subprocess
import sys
import unittest
from pathlib import Path

import expecttest
import torch


PROVE = Path(__file__).parent.parent / "torch_patch" / "prove.py"
# Releases before 2.11 spell the untouched signature lines with Optional[...],
# so git apply needs one context line less there.
NEEDS_REDUCED_CONTEXT = torch.__version__ < "2.11"


class TorchPatchTest(expecttest.TestCase):
    def test_prove_patch_on_installed_torch(self) -> None:
        # CI machines set CI, which changes how torch's run_tests() reports.
        proc = subprocess.run(
            [sys.executable, str(PROVE)],
            env={**os.environ, "CI": "true"},
            capture_output=True, text=True, timeout=1200,
        )
        out = proc.stdout.replace(str(torch.__version__), "<torch>")
        self.assertEqual(proc.returncode, 0, out + proc.stderr)
        if NEEDS_REDUCED_CONTEXT:
            self.assertExpectedInline(out, """\
torch <torch>: 0001-DSD-Reshard-FSDP2-modules-that-an-eval-forward-left-unsharded.patch
git apply to the installed torch/distributed/checkpoint/state_dict.py: with -C2
upstream test test/distributed/checkpoint/test_state_dict_after_eval_forward.py:
  torch as installed: failed (4 tests, FAILED (errors=4))
  patched state_dict.py: passed (4 tests, OK)
backport.status() on the patched torch: not needed: torch <torch> already contains the fix; remove the backport
result: the patch fixes torch <torch>
""")
        else:
            self.assertExpectedInline(out, """\
torch <torch>: 0001-DSD-Reshard-FSDP2-modules-that-an-eval-forward-left-unsharded.patch
git apply to the installed torch/distributed/checkpoint/state_dict.py: clean
upstream test test/distributed/checkpoint/test_state_dict_after_eval_forward.py:
  torch as installed: failed (4 tests, FAILED (errors=4))
  patched state_dict.py: passed (4 tests, OK)
backport.status() on the patched torch: not needed: torch <torch> already contains the fix; remove the backport
result: the patch fixes torch <torch>
""")


if __name__ == "__main__":
    unittest.main()
