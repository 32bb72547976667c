"""Prove the upstream patch series on the installed torch's real sources.

    python torch_patch/prove.py

For each prefix of the series (0001, then 0001 + 0002, ...): copies the
installed ``torch/distributed/checkpoint/state_dict.py`` into a scratch tree,
with ``test_fsdp_dsd_base.py`` as upstream's
``test/distributed/checkpoint/fsdp/test_fsdp_dsd.py`` (the wheels do not ship
tests; the stand-in holds the file's import header, which the series' test
hunks edit), applies the patches there with ``git apply``, then runs the test
class the series adds twice:

1. against torch as installed: it must fail;
2. with the patched ``state_dict.py`` loaded in place of the installed one,
   under its real module name, in every process the test starts: it must pass.

Every process of both runs collects garbage before Python finalizes, which frees
the gloo groups the test's models still hold and so avoids a torch race that can
abort a rank at exit (``c10d_issue/ISSUE.md``). The installed torch is never
modified. Exits 0 only if both hold at every stage.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple


HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PATCHES = sorted(HERE.glob("0*.patch"))
TARGET = "torch/distributed/checkpoint/state_dict.py"
UPSTREAM_TEST = "test/distributed/checkpoint/fsdp/test_fsdp_dsd.py"
UPSTREAM_TEST_BASE = HERE / "test_fsdp_dsd_base.py"
MODULE = "torch.distributed.checkpoint.state_dict"
# The patches carry two context lines. Releases whose state_dict.py differs
# near a hunk (2.10's _verify_options) need one line less.
CONTEXT_FALLBACK = ["-C1"]

# Imported by every Python process of both test runs, the ranks the test
# spawns included. With TORCH_PATCH_STATE_DICT set (the patched run) it serves
# that file for MODULE. In both runs it frees, before Python finalizes, the
# gloo groups that the test's models still hold after destroy_process_group():
# their worker threads otherwise can abort a rank at exit (c10d_issue/ISSUE.md).
SITECUSTOMIZE = f'''\
import atexit
import gc
import importlib.abc
import importlib.util
import os
import sys


class _PatchedStateDictFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != {MODULE!r} or "TORCH_PATCH_STATE_DICT" not in os.environ:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.environ["TORCH_PATCH_STATE_DICT"]
        )


sys.meta_path.insert(0, _PatchedStateDictFinder())
atexit.register(gc.collect)
'''


def _installed_state_dict() -> tuple[str, Path]:
    import torch

    return str(torch.__version__), Path(torch.__file__).parent.parent / TARGET


def _apply(tree: Path, patch: Path) -> str:
    """Apply ``patch`` inside ``tree``; return how it applied."""
    for extra in ([], CONTEXT_FALLBACK):
        check = subprocess.run(
            ["git", "apply", "--check", *extra, str(patch)],
            cwd=tree, capture_output=True, text=True,
        )
        if check.returncode == 0:
            subprocess.run(
                ["git", "apply", *extra, str(patch)], cwd=tree, check=True, capture_output=True
            )
            return "clean" if not extra else f"with {' '.join(extra)}"
    raise SystemExit(f"git apply --check {patch.name} failed:\n{check.stderr}")


def _apply_to_copy(tree: Path, patches: list[Path]) -> dict[str, str]:
    """Copy the installed file and the test stand-in into ``tree``; apply ``patches``."""
    _, installed = _installed_state_dict()
    (tree / TARGET).parent.mkdir(parents=True)
    (tree / TARGET).write_bytes(installed.read_bytes())
    (tree / UPSTREAM_TEST).parent.mkdir(parents=True)
    (tree / UPSTREAM_TEST).write_bytes(UPSTREAM_TEST_BASE.read_bytes())
    return {patch.name: _apply(tree, patch) for patch in patches}


def _print_applied(version: str, patches: list[Path], applied: dict[str, str]) -> None:
    print(f"torch {version} + {' + '.join(patch.name[:4] for patch in patches)}:")
    for name, how in applied.items():
        print(f"  git apply {name}: {how}")


class TestRun(NamedTuple):
    returncode: int
    tests: int | None  # unittest's "Ran N tests"; None if the run never got there
    summary: str  # unittest's last "OK ..." or "FAILED ..." line
    log: Path

    def describe(self) -> str:
        verdict = "passed" if self.returncode == 0 else "failed"
        tests = "?" if self.tests is None else self.tests
        return f"{verdict} ({tests} tests, {self.summary or 'no unittest summary'})"

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text().splitlines()
        # unittest's headers name the failing tests; a crashed rank shows only there.
        failed = [line for line in text if re.match(r"(FAIL|ERROR): ", line)]
        return "\n".join([*failed, "...", *text[-lines:]])


def _run_test(test_file: Path, env: dict[str, str], log: Path, test_args) -> TestRun:
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, str(test_file), *test_args],
            cwd=log.parent / "tree", env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    text = log.read_text()
    ran = re.findall(r"^Ran (\d+) tests?", text, re.MULTILINE)
    summary = re.findall(r"^((?:OK|FAILED)\b.*)$", text, re.MULTILINE)
    return TestRun(
        proc.returncode, int(ran[-1]) if ran else None, summary[-1] if summary else "", log
    )


def _prove(patches: list[Path], test_args: list[str], keep: bool) -> bool:
    """Apply ``patches`` to a copy of the installed file; run their test both ways."""
    version, _ = _installed_state_dict()
    scratch = Path(tempfile.mkdtemp(prefix="torch_patch."))
    tree = scratch / "tree"
    applied = _apply_to_copy(tree, patches)
    test_file = tree / UPSTREAM_TEST
    site = scratch / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)

    pythonpath = [*filter(None, [os.environ.get("PYTHONPATH")])]
    base_env = {
        **os.environ,
        "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
        "PYTHONPATH": os.pathsep.join([str(site), *pythonpath]),
    }
    base_env.pop("TORCH_PATCH_STATE_DICT", None)
    # With CI set, torch's run_tests() writes XML reports through xmlrunner,
    # which is PyTorch's CI dependency, not ours; the proof reads unittest's
    # own summary, so run the test as a developer would.
    base_env.pop("CI", None)
    patched_env = {
        **base_env,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO), *pythonpath]),
        "TORCH_PATCH_STATE_DICT": str(tree / TARGET),
    }
    # The patched module must be the one that loads, and the backport must
    # recognise it as a torch that has the fix.
    probe = subprocess.run(
        [
            sys.executable, "-c",
            f"import {MODULE} as m, backport; print(m.__file__); print(backport.status())",
        ],
        env=patched_env, capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    if Path(probe[0]) != tree / TARGET:
        raise SystemExit(f"patched module did not load: {probe[0]}")

    unpatched = _run_test(test_file, base_env, scratch / "unpatched.log", test_args)
    patched = _run_test(test_file, patched_env, scratch / "patched.log", test_args)
    # Both runs must reach unittest's summary over the same tests, so that an
    # import error or a crash before the first test never counts as the bug.
    proven = (
        bool(unpatched.tests)
        and unpatched.tests == patched.tests
        and unpatched.summary.startswith("FAILED")
        and patched.returncode == 0
        and patched.summary.startswith("OK")
    )
    _print_applied(version, patches, applied)
    print(f"  upstream test {test_file.relative_to(tree)}:")
    print(f"    torch as installed: {unpatched.describe()}")
    print(f"    patched state_dict.py: {patched.describe()}")
    print(f"  backport.status() on the patched torch: {probe[1]}")
    if not proven:
        for name, run in (("torch as installed", unpatched), ("patched", patched)):
            print(f"--- last lines of the {name} run ({run.log.name}):\n{run.tail()}")
    if not proven or keep:
        print(f"  logs and scratch tree: {scratch}")
    return proven


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the scratch trees")
    parser.add_argument(
        "--apply-only", action="store_true",
        help="only apply each prefix to a copy of the installed file; run no test",
    )
    parser.add_argument("test_args", nargs="*", help="passed to the upstream test")
    args = parser.parse_args(argv)

    version, _ = _installed_state_dict()
    if args.apply_only:
        for stage in range(1, len(PATCHES) + 1):
            with tempfile.TemporaryDirectory(prefix="torch_patch.") as scratch:
                applied = _apply_to_copy(Path(scratch), PATCHES[:stage])
            _print_applied(version, PATCHES[:stage], applied)
        return 0
    proven = all(
        [_prove(PATCHES[:stage], args.test_args, args.keep) for stage in range(1, len(PATCHES) + 1)]
    )
    print(f"result: {'the series fixes' if proven else 'NOT PROVEN on'} torch {version}")
    return 0 if proven else 1


if __name__ == "__main__":
    sys.exit(main())
