"""Each test module declares what nox selects it by: the markers cannot drift from the code."""

import ast
import re
import sys
import unittest
from pathlib import Path


HERE = Path(__file__).parent
# What starts processes with torch.distributed: the rank launchers, torchrun,
# prove.py (MultiProcessTestCase), python -m backport, the benchmark, the
# examples and the fuzzer.
STARTS_RANKS = re.compile(
    r"run_ranks\(|run_agreed\w*\(|torchrun|prove\.py|\"-m\", \"backport\"|"
    r"\"benchmarks\"|\"examples\"|fuzz_differential\.check"
)
PYTESTMARK = re.compile(r"^pytestmark = (.*)$", re.MULTILINE)
# What imports, looks for or runs (examples/) a framework on top of torch.
USES_A_FRAMEWORK = re.compile(
    r'(?:^\s*(?:import|from)\s+|")(accelerate|transformers|peft|lightning_fabric|'
    r'pytorch_lightning|lightning|torchtitan|twinkle)\b|"examples"',
    re.MULTILINE,
)


# What the package itself requires, whatever the extra.
REQUIRED = {"torch", "numpy"}


def imported_top_level(source: str) -> set[str]:
    """The modules a file imports when it is imported (not in functions or try blocks)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def declared_marks(source: str) -> set[str]:
    match = PYTESTMARK.search(source)
    return set(re.findall(r"pytest\.mark\.(\w+)", match.group(1))) if match else set()


class MarkersTest(unittest.TestCase):
    def assert_marked_exactly_where(self, mark: str, pattern: re.Pattern, what: str) -> None:
        for path in sorted(set(HERE.glob("test_*.py")) - {Path(__file__)}):
            source = path.read_text()
            with self.subTest(path.name):
                self.assertEqual(
                    bool(pattern.search(source)),
                    mark in declared_marks(source),
                    f"mark the module pytest.mark.{mark} exactly when it {what}",
                )

    def test_every_module_that_starts_ranks_is_marked_ranks(self) -> None:
        self.assert_marked_exactly_where("ranks", STARTS_RANKS, "starts ranks")

    def test_every_module_that_uses_a_framework_is_marked_frameworks(self) -> None:
        self.assert_marked_exactly_where("frameworks", USES_A_FRAMEWORK, "uses a framework")

    def test_fresh_ranks_marks_modules_that_start_ranks(self) -> None:
        for path in sorted(HERE.glob("test_*.py")):
            marks = declared_marks(path.read_text())
            with self.subTest(path.name):
                self.assertTrue("fresh_ranks" not in marks or "ranks" in marks)

    def test_the_dev_extra_runs_every_module_not_marked_ranks(self) -> None:
        # pytest -m "not ranks" with only torch and .[dev] installed (the README's fast
        # path): every third-party import of those modules, and of the test helpers they
        # import, is the package's own requirement or in the dev extra.
        extra = re.search(r"^dev = \[(.*)\]$", (HERE.parent / "pyproject.toml").read_text(),
                          re.MULTILINE)
        dev = {re.split(r"[<>=!~ \[]", req)[0] for req in re.findall(r'"([^"]+)"', extra[1])}
        local = {path.stem for path in HERE.glob("*.py")} | {"backport"}
        for path in sorted(HERE.glob("test_*.py")):
            if "ranks" in declared_marks(path.read_text()):
                continue
            seen, todo, third_party = set(), [path.stem, "conftest"], set()
            while todo:
                name = todo.pop()
                seen.add(name)
                for imported in imported_top_level((HERE / f"{name}.py").read_text()):
                    if imported in local:
                        if imported not in seen and imported != "backport":
                            todo.append(imported)
                    elif imported not in sys.stdlib_module_names:
                        third_party.add(imported)
            with self.subTest(path.name):
                self.assertLessEqual(third_party, dev | REQUIRED)


if __name__ == "__main__":
    unittest.main()
