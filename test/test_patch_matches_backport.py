"""The upstream stack (torch_patch/) and the backport implement one logic.

- 0001 (PR A) adds ``_reshard_fsdp2_modules`` and ``_verify_optim_params_allocated``
  and calls them from ``_verify_options`` and ``_init_optim_state``; 0002 (PR B)
  adds ``_unowned_optim_param_error`` and raises it at four lookups in three
  functions. Each definition is the backport's, line for line (the backport
  imports torch inside each function, and raises its own error class, a
  ValueError and a KeyError, where PR B raises a plain ValueError).
- PR B stands alone: it uses no name that PR A adds.
- Each call or raise site sits in a function the backport wraps, or in one that
  the wrapped function calls on the installed torch.
- The backport-only extensions (FSDP2's hook, found by name, and the cause it
  adds when the module passed in holds no FSDP module) are in no patch.
"""

import inspect
import re
import textwrap
import unittest
from pathlib import Path

import pytest
import torch.distributed.checkpoint.state_dict as state_dict_module

import backport


pytestmark = pytest.mark.torch27


PATCHES = sorted((Path(__file__).parent.parent / "torch_patch").glob("0*.patch"))
TARGET = "torch/distributed/checkpoint/state_dict.py"
SERIES = ["0001", "0002"]
# PR B raises in these functions; the backport converts in the function named.
RAISE_SITES = {
    "_get_optim_state_dict": "_get_optim_state_dict",
    "_split_optim_state_dict": "_load_optim_state_dict",
    "_unflatten_optim_state_dict": "_load_optim_state_dict",
}


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


def _added_definition(patch: Path, name: str) -> str:
    """The module-level function ``name`` that ``patch`` adds."""
    for _, text in _added_blocks(patch):
        match = re.search(rf"^def {name}\(.*?(?=\n\n\n|\Z)", text, re.MULTILINE | re.DOTALL)
        if match:
            return match.group(0).rstrip() + "\n"
    raise AssertionError(f"{patch.name} does not add {name}")


def _backport_definition(name: str) -> str:
    """The backport's ``name`` without its function-local imports."""
    source = textwrap.dedent(inspect.getsource(getattr(backport, name)))
    lines = [
        line for line in source.splitlines()
        if not re.fullmatch(r"    (?:import torch|from torch\S* import \w+)", line)
    ]
    return re.sub(r'("""\n)\n', r"\1", "\n".join(lines)).rstrip() + "\n"


def _calls_in(patch: Path) -> dict[str | None, str]:
    """Enclosing function -> the non-definition lines ``patch`` adds to it."""
    calls: dict[str | None, str] = {}
    for function, text in _added_blocks(patch):
        if not text.startswith("def ") and function is not None:
            calls[function] = calls.get(function, "") + text
    return calls


class PatchMatchesBackportTest(unittest.TestCase):
    def test_series(self) -> None:
        self.assertEqual([patch.name[:4] for patch in PATCHES], SERIES)

    def test_added_definitions_are_identical(self) -> None:
        for patch, name in (
            (PATCHES[0], "_reshard_fsdp2_modules"),
            (PATCHES[0], "_verify_optim_params_allocated"),
            (PATCHES[1], "_unowned_optim_param_error"),
        ):
            with self.subTest(name=name):
                backported = _backport_definition(name).replace(
                    "OptimizerParamNotInModelError", "ValueError"
                )
                self.assertEqual(_added_definition(patch, name), backported)

    def test_pr_a_calls_where_the_backport_wraps(self) -> None:
        calls = _calls_in(PATCHES[0])
        self.assertEqual(calls["_verify_options"], "_reshard_fsdp2_modules(model, optims)\n")
        self.assertEqual(calls["_init_optim_state"], "_verify_optim_params_allocated(optim)\n")
        self.assertEqual(set(calls) - {"get_state_dict", "set_state_dict"}, {
            backport._TARGET_NAME, "_init_optim_state"
        })
        self.assertIn("_reshard_fsdp2_modules(model, optims)", inspect.getsource(
            backport._wrap_verify_options
        ))
        self.assertIn("_init_optim_state", backport._WRAPPERS)

    def test_pr_b_raises_where_the_backport_converts(self) -> None:
        raising = {
            function
            for function, text in _calls_in(PATCHES[1]).items()
            if "raise _unowned_optim_param_error(" in text
        }
        self.assertEqual(raising, set(RAISE_SITES))
        self.assertEqual(set(RAISE_SITES.values()) - set(backport._WRAPPERS), set())
        for site, wrapped in RAISE_SITES.items():
            with self.subTest(site=site):
                # getsource follows __wrapped__ when the backport is applied.
                source = inspect.getsource(getattr(state_dict_module, wrapped))
                self.assertIn(f"{site}(", source)

    def test_pr_b_uses_no_name_pr_a_adds(self) -> None:
        def code(patch: Path) -> str:
            """The lines ``patch`` adds anywhere, without their string literals."""
            added = [line[1:] for line in patch.read_text().splitlines() if line.startswith("+")]
            return re.sub(r'[rf]*"[^"\n]*"', '""', "\n".join(added))

        for name in ("FSDPModule", "_reshard_fsdp2_modules", "is_traceable_wrapper_subclass"):
            with self.subTest(name=name):
                self.assertIn(name, code(PATCHES[0]))
                self.assertNotIn(name, code(PATCHES[1]))

    def test_patch_marks_the_fix_the_backport_detects(self) -> None:
        self.assertIn(f"{backport._FIX_ARTIFACT}(model, optims)", _calls_in(PATCHES[0])["_verify_options"])

    def test_backport_only_extension_is_in_no_patch(self) -> None:
        for patch in PATCHES:
            with self.subTest(patch=patch.name):
                self.assertNotIn("__qualname__", patch.read_text())
                self.assertNotIn("to_sharded_hook", patch.read_text())
                self.assertNotIn("an FSDP module outside it owns the group", patch.read_text())
        self.assertIn("an FSDP module outside it owns the group", inspect.getsource(
            backport._unowned_param_error_with_cause
        ))


if __name__ == "__main__":
    unittest.main()
