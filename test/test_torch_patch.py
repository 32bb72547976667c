"""torch_patch/prove.py on the installed torch: each stage of the series fails unpatched, passes patched."""

import os
import subprocess
import sys
import unittest
from pathlib import Path

import expecttest
import torch


PROVE = Path(__file__).parent.parent / "torch_patch" / "prove.py"


class TorchPatchTest(expecttest.TestCase):
    def _normalised(self, out: str) -> str:
        """prove.py's output with the torch version and 2.10's fuzz taken out."""
        out = out.replace(str(torch.__version__), "<torch>")
        # The stack applies with full context to 2.13 and newer; 2.10's
        # state_dict.py differs next to hunks of 0001 (fuzz 1).
        if torch.__version__ < (2, 13):
            self.assertEqual(out.count(": with -C1\n"), 2, out)
            out = out.replace(": with -C1\n", ": clean\n")
        return out

    def test_series_applies_to_installed_torch(self) -> None:
        proc = subprocess.run(
            [sys.executable, str(PROVE), "--apply-only"],
            capture_output=True, text=True, timeout=120,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertExpectedInline(self._normalised(proc.stdout), """\
torch <torch> + 0001:
  git apply 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: clean
torch <torch> + 0001 + 0002:
  git apply 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: clean
  git apply 0002-DSD-Raise-a-descriptive-error-for-optimizer-params-n.patch: clean
""")

    def test_prove_patch_on_installed_torch(self) -> None:
        # CI machines set CI, which changes how torch's run_tests() reports.
        proc = subprocess.run(
            [sys.executable, str(PROVE)],
            env={**os.environ, "CI": "true"},
            capture_output=True, text=True, timeout=1200,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertExpectedInline(self._normalised(proc.stdout), """\
torch <torch> + 0001:
  git apply 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: clean
  upstream test test/distributed/checkpoint/fsdp/test_fsdp_dsd.py:
    torch as installed: failed (3 tests, FAILED (errors=2))
    patched state_dict.py: passed (3 tests, OK)
  backport.status() on the patched torch: not needed: torch <torch> already contains the fix; remove the backport
torch <torch> + 0001 + 0002:
  git apply 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: clean
  git apply 0002-DSD-Raise-a-descriptive-error-for-optimizer-params-n.patch: clean
  upstream test test/distributed/checkpoint/fsdp/test_fsdp_dsd.py:
    torch as installed: failed (4 tests, FAILED (errors=3))
    patched state_dict.py: passed (4 tests, OK)
  backport.status() on the patched torch: not needed: torch <torch> already contains the fix; remove the backport
result: the series fixes torch <torch>
""")


if __name__ == "__main__":
    unittest.main()
