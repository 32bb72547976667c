"""``python -m backport``'s verdict and exit status for each outcome, in one process.

The reports are rendered from worker results, for outcomes the installed torch
does not show; test_diagnose.py runs the real check on 2 ranks.
"""

import unittest

import expecttest
import pytest

from backport._diagnose import _report


pytestmark = pytest.mark.torch27


def _result(without, with_fix=None, version="2.13.0", **fields) -> dict:
    # What rank 0's worker returns, for outcomes not seen on the installed torch.
    result = {"torch": version, "torch_dir": "<torch_dir>", "without": without, **fields}
    if with_fix is not None:
        result["with"] = with_fix
    return result


OK = {"save": "ok", "load": "ok"}
FAILED = {"save": "KeyError: 4", "load": "KeyError: DTensor(...)"}
REFUSED = (
    "torch 2.6.0 is older than the releases this backport supports (2.7 to 2.15), "
    "so this backport cannot patch it safely"
)


class ReportTest(expecttest.TestCase):
    """The verdict and exit status for each outcome, from worker results."""

    def _report(self, result: dict) -> str:
        text, status = _report(result)
        table_end = text.index("\n\n")
        return f"exit status {status}\n{text[table_end + 2:]}"

    def test_not_affected(self) -> None:
        status = "not applied: torch 2.13.0 has the bug; call backport.apply()"
        self.assertExpectedInline(self._report(_result(OK, OK, status=status)), """\
exit status 0
Affected: no. torch 2.13.0 saved and loaded the optimizer state after
the evaluation forward: you do not need backport.apply().""")

    def test_torch_with_the_fix(self) -> None:
        status = "not needed: torch 2.13.0 already contains the fix; remove the backport"
        self.assertExpectedInline(self._report(_result(OK, OK, status=status)), """\
exit status 0
Affected: no. torch 2.13.0 already contains the fix; remove the backport.""")

    def test_refused_and_not_affected(self) -> None:
        """Not affected is exit status 0 even where apply() refuses the torch."""
        result = _result(OK, version="2.6.0", status="unsupported: ...", refused=REFUSED)
        self.assertExpectedInline(self._report(result), """\
exit status 0
Affected: no. torch 2.6.0 saved and loaded the optimizer state after
the evaluation forward: you do not need backport.apply().

Next step: remove backport.apply() from your code; it refuses this torch:
torch 2.6.0 is older than the releases this backport supports (2.7 to 2.15), so
this backport cannot patch it safely.""")

    def test_refused_and_affected(self) -> None:
        result = _result(FAILED, version="2.6.0", status="unsupported: ...", refused=REFUSED)
        self.assertExpectedInline(self._report(result), """\
exit status 1
Affected: yes. After the evaluation forward, DSD could not map the optimizer's
parameters to the model's: the model still holds FSDP2's unsharded parameters,
the optimizer the sharded ones. Each KeyError is the optimizer parameter DSD
looked for, by its index (KeyError: <n>) or itself (KeyError: DTensor(...)).

Fixed by backport.apply(): no, it refused this torch (right column: not run):
torch 2.6.0 is older than the releases this backport supports (2.7 to 2.15), so
this backport cannot patch it safely.

Next step: install a supported torch (2.7 to 2.15), e.g.

    pip install "torch>=2.7,<2.16"

or apply torch_patch/ (from the backport's project) to your torch.""")

    def test_untested_and_not_affected(self) -> None:
        status = "not applied: torch 2.16.0 (untested: newer than 2.7 to 2.15); ..."
        result = _result(OK, OK, version="2.16.0", status=status)
        self.assertExpectedInline(self._report(result), """\
exit status 0
Untested: torch 2.16.0 is newer than the releases this backport supports
(2.7 to 2.15); the table above is what it does here.

Affected: no. torch 2.16.0 saved and loaded the optimizer state after
the evaluation forward: you do not need backport.apply().""")

    def test_affected_and_not_fixed(self) -> None:
        failed = {"save": "ok", "load": "WRONG VALUES"}
        result = _result(failed, failed, status="not applied")
        self.assertExpectedInline(self._report(result), """\
exit status 1
Affected: yes. After the evaluation forward, the optimizer state read back
differs from the state before it.

Fixed by backport.apply(): no (right column). Do not rely on the backport with
torch 2.13.0; please report this output and how torch was installed.""")

    def test_apply_breaks_a_working_step(self) -> None:
        """Not affected (exit status 0), and the report says to remove apply()."""
        broken = {"save": "ok", "load": "RuntimeError: boom"}
        self.assertExpectedInline(self._report(_result(OK, broken, status="not applied")), """\
exit status 0
Affected: no. torch 2.13.0 saved and loaded the optimizer state after
the evaluation forward: you do not need backport.apply().

Next step: remove backport.apply() from your code; with it a step fails that
works without it (right column). Please report this output.""")


if __name__ == "__main__":
    unittest.main()
