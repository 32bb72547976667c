"""``python -m backport``: its report, its exit status and its command line."""

import os
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import expecttest
import pytest
import torch

import backport
from backport import _diagnose
from fake_torch_version import faked_env


pytestmark = [pytest.mark.ranks, pytest.mark.torch27]


# The report's verdict and advice for a torch that has the bug and that apply()
# fixes: the installed torch's and a newer one's alike. The tests pin the rest.
AFFECTED_AND_FIXED = """\
Affected: yes. After the evaluation forward, DSD could not map the optimizer's
parameters to the model's: the model still holds FSDP2's unsharded parameters,
the optimizer the sharded ones. Each KeyError is the optimizer parameter DSD
looked for, by its index (KeyError: <n>) or itself (KeyError: DTensor(...)).

Fixed by backport.apply(): yes (right column). This check applied it in its
own 2 processes only: your torch is not patched.

Next step: on every rank, before the first checkpoint (e.g. at the top of the
training script), add

    import backport; backport.apply()

or vendor the backport: copy this one file into your code base under any name
and call its apply() the same way:
    <backport/__init__.py>
"""


def _with_affected_and_fixed(report: str) -> str:
    """``report`` with AFFECTED_AND_FIXED in it shown by name, where it is."""
    return report.replace(AFFECTED_AND_FIXED, "<AFFECTED_AND_FIXED>\n")


def _render(text: str) -> str:
    return (
        text.replace(os.path.abspath(backport.__file__), "<backport/__init__.py>")
        .replace(os.path.dirname(torch.__file__), "<torch_dir>")
        .replace(str(torch.__version__), "<torch>")
        .replace(backport.__version__, "<version>")
    )


def _python_m_backport(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **kwargs,
    )


def _imported(importtime_log: str) -> set[str]:
    # -X importtime's lines end with "| <module name>", indented by depth.
    return {line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines()}


class DiagnoseTest(expecttest.TestCase):
    def test_python_m_backport(self) -> None:
        """The installed torch is affected and apply() fixes it: the report says what to do."""
        proc = _python_m_backport("-m", "backport")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertExpectedInline(_with_affected_and_fixed(_render(proc.stdout)), """\
torch <torch> (<torch_dir>)
step                                      | torch as installed                     | with backport.apply()
------------------------------------------|----------------------------------------|-----------------------
optimizer state saved after no_grad eval  | KeyError: 4                            | ok
optimizer state loaded after no_grad eval | KeyError: DTensor(...)                 | ok

<AFFECTED_AND_FIXED>
""")
        # One line per stage while it runs; gloo's own log (torch 2.10) is not one.
        progress = [line for line in proc.stderr.splitlines() if line.startswith("backport:")]
        self.assertExpectedInline(_render("\n".join(progress)), """\
backport: starting 2 CPU processes (gloo) for the check (backport <version>), under a minute...
backport: checking torch <torch> as installed...
backport: checking again with backport.apply() in these processes...""")

    def _faked(self, version: str, **fake) -> tuple[int, str]:
        """``python -m backport`` on the installed torch faked by test/fake_torch_version.py."""
        with faked_env(version, **fake) as env:
            proc = _python_m_backport("-m", "backport", env=env)
        self.assertNotIn("Traceback", proc.stderr)
        return proc.returncode, _render(proc.stdout.replace(version, "<fake>"))

    @pytest.mark.tooling
    def test_newer_torch_affected_and_fixed(self) -> None:
        """An untested torch (faked 2.16.0) with the bug: apply() fixes it, exit status 0."""
        status, text = self._faked("2.16.0")
        self.assertEqual(status, 0, text)
        self.assertExpectedInline(_with_affected_and_fixed(text), """\
torch <fake> (<torch_dir>)
step                                      | torch as installed                     | with backport.apply()
------------------------------------------|----------------------------------------|-----------------------
optimizer state saved after no_grad eval  | KeyError: 4                            | ok
optimizer state loaded after no_grad eval | KeyError: DTensor(...)                 | ok

Untested: torch <fake> is newer than the releases this backport supports
(2.7 to 2.15); the table above is what it does here.

<AFFECTED_AND_FIXED>

On torch <fake> apply() warns UntestedTorchWarning once when it patches.
""")

    @pytest.mark.tooling
    def test_fixed_torch_the_backport_refuses(self) -> None:
        """A newer torch fixed under another name, whose _verify_options changed: exit status 0.

        apply() refuses it (changed shape) and cannot see the fix; the check
        shows the bug absent, so the report says to remove apply().
        """
        status, text = self._faked("2.17.0", fix="undetected", changed_shape=True)
        self.assertEqual(status, 0, text)
        self.assertExpectedInline(text, """\
torch <fake> (<torch_dir>)
step                                      | torch as installed                     | with backport.apply()
------------------------------------------|----------------------------------------|-----------------------
optimizer state saved after no_grad eval  | ok                                     | -
optimizer state loaded after no_grad eval | ok                                     | -

Untested: torch <fake> is newer than the releases this backport supports
(2.7 to 2.15); the table above is what it does here.

Affected: no. torch <fake> saved and loaded the optimizer state after
the evaluation forward: you do not need backport.apply().

Next step: remove backport.apply() from your code; it refuses this torch:
torch <fake> changed torch.distributed.checkpoint.state_dict._verify_options
(expected parameters ('model', 'optims', 'optim_only', 'submodules', 'options'),
found ('model', 'optims', 'optim_only', 'submodules', 'options', 'strict')), so
this backport cannot patch it safely.
""")

    @pytest.mark.tooling
    def test_affected_torch_the_backport_refuses(self) -> None:
        """A torch older than the supported releases (faked 2.6.0) with the bug: exit status 1."""
        status, text = self._faked("2.6.0")
        self.assertEqual(status, 1, text)
        self.assertExpectedInline(text[text.index("\n\n") + 2:], """\
Affected: yes. After the evaluation forward, DSD could not map the optimizer's
parameters to the model's: the model still holds FSDP2's unsharded parameters,
the optimizer the sharded ones. Each KeyError is the optimizer parameter DSD
looked for, by its index (KeyError: <n>) or itself (KeyError: DTensor(...)).

Fixed by backport.apply(): no, it refused this torch (right column: not run):
torch <fake> is older than the releases this backport supports (2.7 to 2.15), so
this backport cannot patch it safely.

Next step: install a supported torch (2.7 to 2.15), e.g.

    pip install "torch>=2.7,<2.16"

or apply torch_patch/ (from the backport's project) to your torch.
""")

    @pytest.mark.tooling
    def test_no_torch_warnings_without_numpy(self) -> None:
        """torch's warning about a missing numpy does not reach the user: the check needs none."""
        with tempfile.TemporaryDirectory() as shadow:
            (Path(shadow) / "numpy").mkdir()
            (Path(shadow) / "numpy" / "__init__.py").write_text(
                "raise ModuleNotFoundError(\"No module named 'numpy'\")\n"
            )
            path = os.pathsep.join(filter(None, [shadow, os.environ.get("PYTHONPATH")]))
            proc = _python_m_backport(
                "-m", "backport", env={**os.environ, "PYTHONPATH": path}
            )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        # gloo's own connection log (torch 2.10) may remain; warnings may not.
        warnings = [line for line in proc.stderr.splitlines() if "Warning" in line]
        self.assertEqual(warnings, [])

    @pytest.mark.tooling
    def test_help_answers_at_once(self) -> None:
        """--help and -h print the usage and exit status without importing torch."""
        for flag in ("--help", "-h"):
            start = time.monotonic()
            # -X importtime lists every module imported, on stderr.
            proc = _python_m_backport("-X", "importtime", "-m", "backport", flag)
            elapsed = time.monotonic() - start
            self.assertEqual(proc.returncode, 0, proc.stderr)
            self.assertFalse("torch" in _imported(proc.stderr), f"{flag} imported torch")
            # No torch, so no ranks; importing torch alone takes over 1 s here.
            self.assertLess(elapsed, 5.0)
        # The description and the exit statuses are backport/_diagnose.py's docstring.
        description, _, exit_status = _diagnose.__doc__.partition("\nExit status:\n")
        self.assertExpectedInline(
            proc.stdout.replace(description, "<docstring>").replace(
                exit_status, "<docstring's exit statuses>"
            ),
            """\
usage: python -m backport [-h]

<docstring>
options:
  -h, --help  show this help message and exit

exit status:
<docstring's exit statuses>""",
        )

    @pytest.mark.tooling
    def test_a_check_that_cannot_run(self) -> None:
        """A rank that fails (here gloo, on a network interface that does not exist): exit status 3."""
        proc = _python_m_backport(
            "-m", "backport", env={**os.environ, "GLOO_SOCKET_IFNAME": "nonexistent0"}
        )
        self.assertEqual(proc.returncode, 3)
        self.assertEqual(proc.stdout, "")
        self.assertIn("\nbackport: the check could not run:\n", proc.stderr)
        # The launcher's report names the rank's error.
        self.assertIn("Unable to find address for: nonexistent0", proc.stderr)

    @pytest.mark.tooling
    def test_without_torch(self) -> None:
        """A Python without torch gets one line saying what to install, and exit status 3."""
        # -S: no site-packages, so this Python cannot import torch; PYTHONPATH
        # still finds the backport.
        root = str(Path(backport.__file__).parent.parent)
        proc = _python_m_backport("-S", "-m", "backport", env={**os.environ, "PYTHONPATH": root})
        self.assertEqual(proc.returncode, 3)
        self.assertEqual(proc.stdout, "")
        self.assertExpectedInline(proc.stderr.replace(sys.executable, "<python>"), """\
backport: this Python (<python>) has no torch: install it first with pip install "torch>=2.7,<2.16" (for a CPU-only or a specific CUDA/ROCm build, add the index URL that pytorch.org gives), then run python -m backport again
""")

    @pytest.mark.tooling
    def test_usage_error(self) -> None:
        """An unknown argument is a usage error (exit status 2), with no check run."""
        proc = _python_m_backport("-X", "importtime", "-m", "backport", "--world-size=4")
        self.assertEqual(proc.returncode, 2)
        self.assertFalse("torch" in _imported(proc.stderr), "a usage error imported torch")
        self.assertExpectedInline(
            "\n".join(line for line in proc.stderr.splitlines() if "import time" not in line),
            """\
usage: python -m backport [-h]
python -m backport: error: unrecognized arguments: --world-size=4""",
        )


if __name__ == "__main__":
    unittest.main()
