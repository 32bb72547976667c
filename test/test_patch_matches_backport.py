"""The upstream patch series and the backport implement one logic.

- What 0001 and 0002 add to ``_verify_options`` after its option checks is the
  body of the backport's ``_reshard_fsdp2_modules``, line for line (comments
  included), and the checks it moves ahead of the reshard are the ones the
  backport's ``_options_are_valid`` mirrors.
- The helper and constant the series adds are the backport's, line for line.
- 0003 raises its error, or calls its freed-parameter check, in exactly the
  functions the backport wraps for it.
"""

import inspect
import re
import textwrap
import unittest
from pathlib import Path

import backport


PATCHES = sorted((Path(__file__).parent.parent / "torch_patch").glob("0*.patch"))
TARGET = "torch/distributed/checkpoint/state_dict.py"
SERIES = ["0001", "0002", "0003"]
# The option check that 0001 moves ahead of the reshard.
MOVED_CHECK = """\
if options.broadcast_from_rank0 and not options.full_state_dict:
    raise ValueError(
        "full_state_dict must be True when broadcast_from_rank0 is True."
    )
"""


def _hunks(patch: Path) -> list[tuple[str, list[str]]]:
    """(function git names in the header, diff lines) of each state_dict.py hunk."""
    diff = patch.read_text().split(f"diff --git a/{TARGET}")[1].split("\ndiff --git ")[0]
    parts = re.split(r"^@@ [^@]+ @@ ?(.*)$", diff, flags=re.MULTILINE)
    return [(header, body.splitlines()) for header, body in zip(parts[1::2], parts[2::2])]


def _function_name(line: str) -> str | None:
    match = re.match(r"def (\w+)\(", line)
    return match.group(1) if match else None


def _added_blocks(patch: Path) -> list[tuple[str | None, str]]:
    """(enclosing function, dedented text) of each run of lines ``patch`` adds."""
    blocks: list[tuple[str | None, list[str]]] = []
    for header, lines in _hunks(patch):
        function, previous = _function_name(header), ""
        for line in lines:
            if not line.startswith("+"):
                function = _function_name(line[1:]) or function
            if line.startswith("+"):
                if not previous.startswith("+"):
                    blocks.append((function, []))
                blocks[-1][1].append(line[1:])
            previous = line
    return [(function, textwrap.dedent("\n".join(text)) + "\n") for function, text in blocks]


def _reshard_block() -> str:
    """What 0001 + 0002 add to ``_verify_options`` besides the moved check."""
    added = [
        text
        for patch in PATCHES[:2]
        for function, text in _added_blocks(patch)
        if function == "_verify_options"
    ]
    code = "".join(added)
    if not code.startswith(MOVED_CHECK):
        raise AssertionError(f"0001 does not open with the moved option check:\n{code}")
    return code[len(MOVED_CHECK):].lstrip("\n")


def _backport_reshard_body() -> str:
    source = textwrap.dedent(inspect.getsource(backport._reshard_fsdp2_modules))
    body = source.split('"""', 2)[2]  # after the docstring
    lines = [line for line in body.splitlines() if not line.strip().startswith("from torch")]
    return textwrap.dedent("\n".join(lines)).strip("\n") + "\n"


def _added_definition(name: str) -> str:
    """The module-level definition of ``name`` that the series adds."""
    for patch in PATCHES:
        for function, text in _added_blocks(patch):
            match = re.search(
                rf"^(?:def {name}\(.*?(?=\n\n\n|\Z)|{name} = (?:\(\n.*?\n\)|.*?$))", text, re.MULTILINE | re.DOTALL
            )
            if match:
                return match.group(0).rstrip() + "\n"
    raise AssertionError(f"the series does not add {name}")


def _backport_definition(name: str) -> str:
    value = getattr(backport, name)
    if callable(value):
        return textwrap.dedent(inspect.getsource(value)).rstrip() + "\n"
    source = Path(backport.__file__).read_text()
    match = re.search(rf"^{name} = (?:\(\n.*?\n\)|.*?$)", source, re.MULTILINE | re.DOTALL)
    return match.group(0) + "\n"


class PatchMatchesBackportTest(unittest.TestCase):
    def test_series(self) -> None:
        self.assertEqual([patch.name[:4] for patch in PATCHES], SERIES)

    def test_reshard_is_the_backport_helper(self) -> None:
        self.assertEqual(_reshard_block(), _backport_reshard_body())

    def test_moved_check_is_the_one_the_backport_mirrors(self) -> None:
        source = inspect.getsource(backport._options_are_valid)
        self.assertIn("options.broadcast_from_rank0 and not options.full_state_dict", source)
        self.assertIn("optim_only and not optims", source)

    def test_added_definitions_are_identical(self) -> None:
        for name in (
            "_FSDP2_TO_SHARDED_HOOK",
            "_unowned_optim_param_error",
            "_verify_optim_params_allocated",
        ):
            with self.subTest(name=name):
                self.assertEqual(_added_definition(name), _backport_definition(name))

    def test_error_raised_where_the_backport_converts(self) -> None:
        raising = {
            function
            for function, text in _added_blocks(PATCHES[2])
            if not text.startswith("def ")
            and ("raise _unowned_optim_param_error(" in text
                 or "_verify_optim_params_allocated(optim)" in text)
        }
        self.assertEqual(raising, set(backport._WRAPPERS) - {backport._TARGET_NAME})

    def test_patch_marks_the_fix_the_backport_detects(self) -> None:
        self.assertIn(f".{backport._FIX_ARTIFACT}()", _reshard_block())


if __name__ == "__main__":
    unittest.main()
