"""The upstream patch and the backport implement one logic.

The helpers the patch adds to state_dict.py must be the backport's helpers,
line for line (comments included), and the patch's new ``_verify_options`` must
do what the backport's wrapper does, statement for statement.
"""

import ast
import inspect
import re
import textwrap
import unittest
from pathlib import Path

import backport


PATCH = next((Path(__file__).parent.parent / "torch_patch").glob("*.patch"))
HELPERS = [
    "_fsdp_reshard_needed",
    "_reshard_fsdp_modules",
    "_find_unmapped_optim_param",
    "_verify_optim_params_owned",
]


def _added_state_dict_source() -> str:
    """The lines the patch adds to state_dict.py, as one source text."""
    diff = PATCH.read_text().split("diff --git a/torch/distributed/checkpoint/state_dict.py")
    diff = diff[1].split("\ndiff --git ")[0]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    return "\n".join(line for line in added if not line.startswith("++"))


def _function_source(source: str, name: str) -> str:
    match = re.search(rf"^def {name}\(.*?(?=^def |\Z)", source, re.MULTILINE | re.DOTALL)
    if match is None:
        raise AssertionError(f"the patch does not add {name}")
    return match.group(0).rstrip() + "\n"


def _without_local_imports(source: str) -> str:
    # The vendorable backport imports torch lazily; state_dict.py at the top.
    lines = source.splitlines()
    kept = []
    for idx, line in enumerate(lines):
        if line.strip().startswith(("from torch", "import torch")):
            continue
        if not line.strip() and kept and not kept[-1].strip():
            continue
        if not line.strip() and idx > 0 and lines[idx - 1].strip().startswith("from torch"):
            continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def _body_statements(func_source: str, rename: dict[str, str]) -> list[str]:
    func = ast.parse(textwrap.dedent(func_source)).body[0]
    body = func.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    dumped = [ast.dump(stmt) for stmt in body]
    for old, new in rename.items():
        dumped = [d.replace(f"'{old}'", f"'{new}'") for d in dumped]
    return dumped


class PatchMatchesBackportTest(unittest.TestCase):
    def test_helpers_are_identical(self) -> None:
        added = _added_state_dict_source()
        for name in HELPERS:
            with self.subTest(helper=name):
                ours = _without_local_imports(inspect.getsource(getattr(backport, name)))
                self.assertEqual(_function_source(added, name), ours)

    def test_verify_options_matches_the_wrapper(self) -> None:
        added = _added_state_dict_source()
        patched = _body_statements(
            _function_source(added, "_verify_options"), {"_verify_options_impl": "original"}
        )
        wrapper = inspect.getsource(backport._make_wrapper)
        inner = re.search(r"    def _verify_options\(.*?(?=\n    setattr)", wrapper, re.DOTALL)
        ours = _body_statements(inner.group(0), {"verify_options": "original"})
        self.assertEqual(patched, ours)

    def test_patch_marks_the_fix_the_backport_detects(self) -> None:
        self.assertIn(f"+def {backport._FIX_ARTIFACT}(", PATCH.read_text())


if __name__ == "__main__":
    unittest.main()
