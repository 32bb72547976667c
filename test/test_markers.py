"""Each test module declares what nox selects it by: the markers cannot drift from the code."""

import re
import unittest
from pathlib import Path


HERE = Path(__file__).parent
# What starts processes with torch.distributed: the rank launchers, torchrun,
# prove.py (MultiProcessTestCase), python -m backport, the benchmark, the
# examples and the fuzzer.
STARTS_RANKS = re.compile(
    r"run_ranks\(|run_agreed\(|torchrun|prove\.py|\"-m\", \"backport\"|"
    r"\"benchmarks\"|\"examples\"|fuzz_differential\.check"
)
PYTESTMARK = re.compile(r"^pytestmark = (.*)$", re.MULTILINE)


def declared_marks(source: str) -> set[str]:
    match = PYTESTMARK.search(source)
    return set(re.findall(r"pytest\.mark\.(\w+)", match.group(1))) if match else set()


class MarkersTest(unittest.TestCase):
    def test_every_module_that_starts_ranks_is_marked_ranks(self) -> None:
        for path in sorted(set(HERE.glob("test_*.py")) - {Path(__file__)}):
            source = path.read_text()
            with self.subTest(path.name):
                self.assertEqual(
                    bool(STARTS_RANKS.search(source)),
                    "ranks" in declared_marks(source),
                    "mark the module pytest.mark.ranks exactly when it starts ranks",
                )

    def test_fresh_ranks_marks_modules_that_start_ranks(self) -> None:
        for path in sorted(HERE.glob("test_*.py")):
            marks = declared_marks(path.read_text())
            with self.subTest(path.name):
                self.assertTrue("fresh_ranks" not in marks or "ranks" in marks)


if __name__ == "__main__":
    unittest.main()
