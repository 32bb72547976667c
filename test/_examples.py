"""What the tests of examples/ check of every example: a run, a failure without the backport.

Each example trains on 2 CPU ranks (torchrun) with its default output folder, a
temporary one that it must remove at the end, after a failure too.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import expecttest


class ExampleTestCase(expecttest.TestCase):
    """Runs ``EXAMPLE`` with ``ARGS`` (its CPU flags) and whatever a test adds."""

    EXAMPLE: Path
    ARGS: tuple[str, ...] = ()

    def _run(self, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        """The example with its default output folder, under a TMPDIR of its own.

        Returns the run and what it left in that TMPDIR that it made itself.
        """
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 str(self.EXAMPLE), *self.ARGS, *extra],
                capture_output=True, text=True, timeout=600, check=False,
                # backport from this checkout, installed or not.
                env={**os.environ, "TMPDIR": tmp, "PYTHONPATH": os.pathsep.join(
                    [str(self.EXAMPLE.parent.parent), os.environ.get("PYTHONPATH", "")]
                )},
            )
            left = [name for name in os.listdir(tmp) if name.startswith("fsdp2_eval_ckpt_")]
        return proc, left

    def steps(self, *extra: str) -> str:
        """The run's "step ..." lines; it must succeed with the backport and clean up."""
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

    def without_backport(self) -> str:
        """Each rank's line about the bug, sorted, from a run with ``--without-backport``.

        The run must fail, say the backport is not applied, and clean up.
        """
        proc, left = self._run("--without-backport")
        self.assertNotEqual(proc.returncode, 0, proc.stdout[-4000:])
        self.assertIn("\nnot applied: torch ", "\n" + proc.stdout)
        self.assertEqual(left, [], "the default output folder is removed on failure too")
        # Found, not split by line: another rank's traceback may share a line with it.
        found = re.findall(r"rank \d+: without the backport.*?\(the bug backport\.apply\(\) fixes\)",
                           proc.stderr)
        return "\n".join(sorted(re.sub(r"KeyError: \d+", "KeyError: <index>", line) for line in found))
