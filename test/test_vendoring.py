"""backport/__init__.py works as one copied file, and copies agree through torch's marker."""

import ast
import functools
import importlib.util
import shutil
import sys
import tempfile
import unittest
from pathlib import Path

import pytest
import torch.distributed.checkpoint.state_dict as dsd

import backport


pytestmark = pytest.mark.torch27


SOURCE = Path(backport.__file__)


def _load_copy(directory: str, name: str):
    path = Path(directory) / f"{name}.py"
    shutil.copy(SOURCE, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class VendoringTest(unittest.TestCase):
    def setUp(self) -> None:
        self.original = dsd._verify_options
        self.originals = {name: getattr(dsd, name) for name in backport._WRAPPERS}
        for name, original in self.originals.items():
            self.addCleanup(setattr, dsd, name, original)

    def test_imports_only_stdlib_and_torch(self) -> None:
        tree = ast.parse(SOURCE.read_text())
        roots = {
            (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
            for alias in node.names
        }
        self.assertEqual(roots - set(sys.stdlib_module_names), {"torch"})

    def test_header_names_license_and_origin(self) -> None:
        # A vendored copy keeps both lines: the license and where it comes from.
        self.assertEqual(SOURCE.read_text().splitlines()[:3], [
            "# SPDX-License-Identifier: BSD-3-Clause",
            "# backport/__init__.py of fsdp2-dcp-eval-backport 0.1.0: this one file is the whole",
            "# backport; copies keep these lines.",
        ])

    def test_docstrings_state_the_rank_local_rule(self) -> None:
        for doc in (backport.__doc__, backport.apply.__doc__):
            text = " ".join(doc.split())
            with self.subTest(doc=doc.splitlines()[0]):
                self.assertIn("on every rank of each FSDP mesh, or on none", text)
                self.assertIn("reset_iter_state()", text)

    def test_copies_share_one_patch(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            vendored = _load_copy(tmp, "yourpkg_dcp_eval_backport")
            self.assertFalse(vendored.is_applied())
            vendored.apply()
            # The package's copy sees the vendored patch and does not wrap it again.
            self.assertTrue(backport.is_applied())
            backport.apply()
            self.assertIs(dsd._verify_options.__wrapped__, self.original)
            # Either copy reverts it.
            backport.revert()
            for name, original in self.originals.items():
                self.assertIs(getattr(dsd, name), original, name)
            self.assertFalse(vendored.is_applied())

    def test_copies_tell_their_wrapper_from_a_foreign_one(self) -> None:
        """A copy sees the other's wrapper under a functools.wraps wrapper, and leaves that."""
        with tempfile.TemporaryDirectory() as tmp:
            vendored = _load_copy(tmp, "yourpkg_dcp_eval_backport")
            vendored.apply()
            ours = dsd._init_optim_state

            @functools.wraps(ours)
            def foreign(*args, **kwargs):
                return ours(*args, **kwargs)

            dsd._init_optim_state = foreign
            backport.apply()
            self.assertIs(dsd._init_optim_state, foreign)
            with self.assertWarnsRegex(backport.BackportWarning, "_init_optim_state is wrapped"):
                self.assertTrue(backport.revert().startswith("partly applied: "))
            self.assertIs(dsd._init_optim_state, foreign)
            self.assertIs(dsd._verify_options, self.original)


if __name__ == "__main__":
    unittest.main()
