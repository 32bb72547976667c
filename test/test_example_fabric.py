"""examples/fabric_fsdp2_eval_checkpoint.py runs on 2 CPU ranks and resumes identically."""

import unittest
from importlib.util import find_spec
from pathlib import Path

import pytest

from _examples import ExampleTestCase


pytestmark = [pytest.mark.ranks, pytest.mark.frameworks]


EXAMPLE = Path(__file__).parent.parent / "examples" / "fabric_fsdp2_eval_checkpoint.py"


@unittest.skipUnless(
    find_spec("lightning_fabric"), "needs the frameworks extra (nox: torch 2.13.0)"
)
class FabricExampleTest(ExampleTestCase):
    EXAMPLE = EXAMPLE
    ARGS = ("--cpu",)

    def test_distributed_checkpoint(self) -> None:
        self.assertExpectedInline(self.steps(), """\
step 2: eval loss <loss>, saved <out>/step_2
step 4: eval loss <loss>, saved <out>/step_4
step 3: resumed loss <loss> == original: True
step 4: resumed loss <loss> == original: True""")

    def test_full_checkpoint(self) -> None:
        self.assertExpectedInline(self.steps("--full-checkpoint"), """\
step 2: eval loss <loss>, saved <out>/step_2
step 4: eval loss <loss>, saved <out>/step_4
step 3: resumed loss <loss> == original: True
step 4: resumed loss <loss> == original: True""")

    def test_without_backport_shows_the_bug(self) -> None:
        self.assertExpectedInline(self.without_backport(), """\
rank 0: without the backport, fabric.save after the evaluation raised KeyError: <index> (the bug backport.apply() fixes)
rank 1: without the backport, fabric.save after the evaluation raised KeyError: <index> (the bug backport.apply() fixes)""")


if __name__ == "__main__":
    unittest.main()
