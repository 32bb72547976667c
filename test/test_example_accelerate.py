"""examples/accelerate_fsdp2_eval_checkpoint.py runs on 2 CPU ranks and resumes identically."""

import unittest
from pathlib import Path

import pytest

from _examples import ExampleTestCase


pytestmark = [pytest.mark.ranks, pytest.mark.frameworks]


EXAMPLE = Path(__file__).parent.parent / "examples" / "accelerate_fsdp2_eval_checkpoint.py"

try:
    import accelerate
    import transformers  # noqa: F401
except ImportError:  # the suite's test extra installs them
    accelerate = None


@unittest.skipIf(accelerate is None, "needs accelerate and transformers")
class AccelerateExampleTest(ExampleTestCase):
    EXAMPLE = EXAMPLE
    ARGS = ("--cpu-fsdp", "--steps", "3")

    def test_example_on_cpu(self) -> None:
        self.assertExpectedInline(self.steps(), """\
step 2: eval loss <loss>, saved <out>/step_2
step 3: resumed loss <loss> == original: True
step 4: resumed loss <loss> == original: True""")

    def test_without_backport_shows_the_bug(self) -> None:
        self.assertExpectedInline(self.without_backport(), """\
rank 0: without the backport, saving the optimizer after the evaluation raised KeyError: <index> (the bug backport.apply() fixes)
rank 1: without the backport, saving the optimizer after the evaluation raised KeyError: <index> (the bug backport.apply() fixes)""")


if __name__ == "__main__":
    unittest.main()
