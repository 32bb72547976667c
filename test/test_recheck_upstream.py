"""torch_patch/recheck_upstream.py on a stand-in pytorch checkout: one line per PR, conflicts named."""

import subprocess
import sys
import tempfile
from pathlib import Path

import expecttest
import pytest
import torch


RECHECK = Path(__file__).parent.parent / "torch_patch" / "recheck_upstream.py"
STATE_DICT = Path("torch/distributed/checkpoint/state_dict.py")

pytestmark = pytest.mark.tooling


class RecheckUpstreamTest(expecttest.TestCase):
    def _recheck(self, checkout: Path) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, str(RECHECK), str(checkout), "--no-tests",
             "--only", "pr-a", "--only", "pr-b", "--only", "pr-ab"],
            capture_output=True, text=True, timeout=120, check=False,
        )
        proc.stdout = proc.stdout.replace(str(torch.__version__), "<torch>")
        proc.stdout = proc.stdout.replace(sys.version.split()[0], "<python>")
        return proc

    def test_applies_and_conflicts(self) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            checkout = Path(scratch)
            subprocess.run(
                [sys.executable, str(RECHECK), "--make-fake-pytorch", str(checkout)], check=True
            )
            applies = self._recheck(checkout)
            # A context line of 0001's hunk in _verify_options, as main might rewrite it.
            path = checkout / STATE_DICT
            text = path.read_text()
            old = "    options = options or StateDictOptions()\n"
            self.assertEqual(text.count(old), 1)
            path.write_text(text.replace(old, "    options = options if options else StateDictOptions()\n"))
            conflicts = self._recheck(checkout)
        self.assertEqual(applies.returncode, 0, applies.stdout + applies.stderr)
        self.assertExpectedInline(applies.stdout, """\
torch <torch>, Python <python>
PR A (0001): applies, tests not run
PR B (0002): applies, tests not run
PR A+B: applies, tests not run
""")
        self.assertEqual(conflicts.returncode, 1, conflicts.stdout + conflicts.stderr)
        self.assertExpectedInline(conflicts.stdout, """\
torch <torch>, Python <python>
PR A (0001): CONFLICTS: 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: error: patch failed: torch/distributed/checkpoint/state_dict.py:297; hunk @@ -297,4 +374,5 @@ def _verify_options(
PR B (0002): applies, tests not run
PR A+B: CONFLICTS: 0001-DSD-Reshard-FSDP2-modules-before-mapping-optimizer-p.patch: error: patch failed: torch/distributed/checkpoint/state_dict.py:297; hunk @@ -297,4 +374,5 @@ def _verify_options(
""")


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
