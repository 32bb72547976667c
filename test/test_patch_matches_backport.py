"""The upstream patch series and the backport implement one logic.

The helpers the series adds to state_dict.py must be the backport's helpers,
line for line (comments included), and the statements it adds to
``_verify_options`` must be the ones the backport's wrapper runs around the
original, in the same order.
"""

import ast
import inspect
import re
import textwrap
import unittest
from pathlib import Path

import backport


PATCHES = sorted((Path(__file__).parent.parent / "torch_patch").glob("0*.patch"))
TARGET = "torch/distributed/checkpoint/state_dict.py"
# The helper each patch adds: 0001 the fix, 0002 the error for foreign params.
HELPERS = {"0001": "_reshard_fsdp2_modules", "0002": "_verify_optim_params_owned"}


def _hunks(patch: Path) -> list[tuple[str, list[str]]]:
    """(function git names in the header, diff lines) of each state_dict.py hunk."""
    diff = patch.read_text().split(f"diff --git a/{TARGET}")[1].split("\ndiff --git ")[0]
    parts = re.split(r"^@@ [^@]+ @@ ?(.*)$", diff, flags=re.MULTILINE)
    return [(header, body.splitlines()) for header, body in zip(parts[1::2], parts[2::2])]


def _function_name(line: str) -> str | None:
    match = re.match(r"def (\w+)\(", line)
    return match.group(1) if match else None


def _added_source(patch: Path) -> str:
    """The lines ``patch`` adds to state_dict.py; hunks end with a marker line."""
    hunks = [
        "\n".join(line[1:] for line in lines if line.startswith("+")) + "\n#hunk end\n"
        for _, lines in _hunks(patch)
    ]
    return "\n".join(hunks)


def _added_to_verify_options(patch: Path) -> list[str]:
    """Blocks of lines ``patch`` adds inside ``_verify_options``, each dedented."""
    blocks: list[list[str]] = []
    for header, lines in _hunks(patch):
        function, previous = _function_name(header), ""
        for line in lines:
            function = _function_name(line[1:]) or function
            if line.startswith("+") and function == "_verify_options":
                if not previous.startswith("+"):
                    blocks.append([])
                blocks[-1].append(line[1:])
            previous = line
    return [textwrap.dedent("\n".join(block)) for block in blocks]


def _function_source(source: str, name: str) -> str:
    match = re.search(rf"^def {name}\(.*?(?=^def |^#hunk end|\Z)", source, re.MULTILINE | re.DOTALL)
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


def _statements(source: str) -> list[str]:
    return [ast.dump(stmt) for stmt in ast.parse(source).body]


def _wrapper_statements() -> list[str]:
    """What the wrapper runs besides calling the original and returning its info."""
    wrapper = ast.parse(textwrap.dedent(inspect.getsource(backport._make_wrapper)))
    inner = next(
        node for node in ast.walk(wrapper)
        if isinstance(node, ast.FunctionDef) and node.name == "_verify_options"
    )
    kept = [
        stmt for stmt in inner.body
        if not isinstance(stmt, (ast.Return, ast.Assign))  # info = original(...)
    ]
    # state_dict.py has the locals that the wrapper reads from the info.
    source = "\n".join(ast.unparse(stmt) for stmt in kept)
    source = source.replace("info.fsdp_modules", "fsdp_modules")
    source = source.replace("info.fqn_param_mapping", "fqn_param_mapping")
    return _statements(source)


class PatchMatchesBackportTest(unittest.TestCase):
    def test_series(self) -> None:
        self.assertEqual([patch.name[:4] for patch in PATCHES], list(HELPERS))

    def test_helpers_are_identical(self) -> None:
        for patch in PATCHES:
            name = HELPERS[patch.name[:4]]
            with self.subTest(patch=patch.name, helper=name):
                ours = _without_local_imports(inspect.getsource(getattr(backport, name)))
                self.assertEqual(_function_source(_added_source(patch), name), ours)

    def test_verify_options_matches_the_wrapper(self) -> None:
        patched = [
            stmt for patch in PATCHES for block in _added_to_verify_options(patch)
            for stmt in _statements(block)
        ]
        self.assertEqual(patched, _wrapper_statements())

    def test_patch_marks_the_fix_the_backport_detects(self) -> None:
        self.assertIn(f"+def {backport._FIX_ARTIFACT}(", PATCHES[0].read_text())


if __name__ == "__main__":
    unittest.main()
