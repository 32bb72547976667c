"""``python -m backport`` on the installed torch: affected, and fixed by apply()."""

import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import expecttest
import torch

import backport


class DiagnoseTest(expecttest.TestCase):
    def test_python_m_backport(self) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "backport"], capture_output=True, text=True, timeout=300
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        out = proc.stdout.replace(str(torch.__version__), "<torch>").replace(
            backport.__version__, "<version>"
        )
        self.assertExpectedInline(out, """\
backport <version>: running FSDP2 on 2 CPU processes (gloo)...
torch <torch>
step                                      | torch as installed                     | with backport.apply()
------------------------------------------|----------------------------------------|-----------------------
optimizer state saved after no_grad eval  | KeyError: 4                            | ok
optimizer state loaded after no_grad eval | KeyError: DTensor(...)                 | ok
affected: yes
fixed by backport.apply(): yes
backport: applied: torch <torch>, torch.distributed.checkpoint.state_dict._verify_options wrapped (backport <version>)
""")

    def test_no_torch_warnings_without_numpy(self) -> None:
        # A fresh install has no numpy, and torch warns about it at import.
        with tempfile.TemporaryDirectory() as shadow:
            (Path(shadow) / "numpy").mkdir()
            (Path(shadow) / "numpy" / "__init__.py").write_text(
                "raise ModuleNotFoundError(\"No module named 'numpy'\")\n"
            )
            path = os.pathsep.join(filter(None, [shadow, os.environ.get("PYTHONPATH")]))
            proc = subprocess.run(
                [sys.executable, "-m", "backport"],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PYTHONPATH": path},
            )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        # gloo's own connection log (torch 2.10) may remain; warnings may not.
        warnings = [line for line in proc.stderr.splitlines() if "Warning" in line]
        self.assertEqual(warnings, [])


if __name__ == "__main__":
    unittest.main()
