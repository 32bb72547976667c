"""torch_patch/prove.py on the installed torch: each stage of the series fails unpatched, passes patched."""

import os
import re
import subprocess
import sys
import unittest
from pathlib import Path

import expecttest
import pytest
import torch


pytestmark = pytest.mark.ranks


PROVE = Path(__file__).parent.parent / "torch_patch" / "prove.py"


def normalised(out: str) -> str:
    """prove.py's output with the torch version and the run times taken out."""
    # The stack applies with full context to every release measured
    # (2.10.0, 2.13.0 and 2.15.0 in CI, 2.14.1 too): no "with -C1" to take out.
    out = out.replace(str(torch.__version__), "<torch>")
    return re.sub(r"\) in \d+ s$", ") in <n> s", out, flags=re.MULTILINE)


class TorchPatchAppliesTest(expecttest.TestCase):
    def test_series_applies_to_installed_torch(self) -> None:
        proc = subprocess.run(
            [sys.executable, str(PROVE), "--apply-only"],
            capture_output=True, text=True, timeout=120, check=False,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertExpectedInline(normalised(proc.stdout), """\
torch <torch> + 0001:
  git apply 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: clean
torch <torch> + 0002:
  git apply 0002-DSD-Raise-a-descriptive-error-for-optimizer-params-n.patch: clean
torch <torch> + 0001 + 0002:
  git apply 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: clean
  git apply 0002-DSD-Raise-a-descriptive-error-for-optimizer-params-n.patch: clean
""")


# A minute or more a run. The PRs target PyTorch's main branch, but CI proves
# the stack on 2.13.0: the CPU build, whose processes start in half the time
# of a CUDA build's (docs/testing.md). Each PR alone is proven by hand
# (prove.py without --stage).
@pytest.mark.proof
class TorchPatchProofTest(expecttest.TestCase):
    def test_prove_patch_on_installed_torch(self) -> None:
        # CI machines set CI, which changes how torch's run_tests() reports.
        proc = subprocess.run(
            [sys.executable, str(PROVE), "--stage", "0001+0002"],
            env={**os.environ, "CI": "true"},
            capture_output=True, text=True, timeout=1200, check=False,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertExpectedInline(normalised(proc.stdout), """\
torch <torch> + 0001 + 0002:
  git apply 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: clean
  git apply 0002-DSD-Raise-a-descriptive-error-for-optimizer-params-n.patch: clean
  upstream test test/distributed/checkpoint/fsdp/test_fsdp_dsd.py:
    torch as installed: failed (3 tests, FAILED (errors=3)) in <n> s
    patched state_dict.py: passed (3 tests, OK) in <n> s
  upstream test test/distributed/checkpoint/test_state_dict.py:
    torch as installed: failed (4 tests, FAILED (errors=3)) in <n> s
    patched state_dict.py: passed (4 tests, OK) in <n> s
  backport.status() on the patched torch: not needed: torch <torch> already contains the fix; remove the backport
result: stage 0001+0002 proven on torch <torch>
""")


if __name__ == "__main__":
    unittest.main()
