"""Prove the upstream patch series on the installed torch's real sources.

    python torch_patch/prove.py

Each patch is proved alone, then the whole series (0001, 0002, 0001 + 0002):
each stage copies the installed ``torch/distributed/checkpoint/state_dict.py``
into a scratch tree, with ``test_fsdp_dsd_base.py`` and
``test_state_dict_base.py`` as upstream's
``test/distributed/checkpoint/fsdp/test_fsdp_dsd.py`` and
``test/distributed/checkpoint/test_state_dict.py`` (the wheels do not ship
tests; the stand-ins hold what the series' test hunks edit), applies the
stage's patches there with ``git apply``, then runs each test file the stage
edits twice:

1. against torch as installed: the stage's tests must fail (a file may pass
   here when its tests only guard the fix against regressions);
2. with the patched ``state_dict.py`` loaded in place of the installed one,
   under its real module name, in every process the test starts: every file
   must pass.

Every process of both runs collects garbage before Python finalizes, which frees
the gloo groups the test's models still hold and so avoids a torch race that can
abort a rank at exit (``upstream/c10d_issue/ISSUE.md``). The installed torch is never
modified. Exits 0 only if both hold at every stage. ``--stage 0002`` (or
``0001``, ``0001+0002``) proves that stage only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple


HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PATCHES = sorted(HERE.glob("0*.patch"))
TARGET = "torch/distributed/checkpoint/state_dict.py"
# upstream test file -> its stand-in here
UPSTREAM_TESTS = {
    "test/distributed/checkpoint/fsdp/test_fsdp_dsd.py": HERE / "test_fsdp_dsd_base.py",
    "test/distributed/checkpoint/test_state_dict.py": HERE / "test_state_dict_base.py",
}
MODULE = "torch.distributed.checkpoint.state_dict"
# The patches carry two context lines and apply with all of them to every
# release measured; a release whose state_dict.py differs next to a hunk may
# need one line less, which the output then says.
CONTEXT_FALLBACK = ["-C1"]

# Imported by every Python process of both test runs, the ranks the test
# spawns included. With TORCH_PATCH_STATE_DICT set (the patched run) it serves
# that file for MODULE. In both runs it frees, before Python finalizes, the
# gloo groups that the test's models still hold after destroy_process_group():
# their worker threads otherwise can abort a rank at exit (upstream/c10d_issue/ISSUE.md).
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


class PatchConflict(SystemExit):
    """``git apply --check`` refused a patch: this script exits with git's error.

    recheck_upstream.py catches it to name the hunk instead.
    """

    def __init__(self, patch: Path, stderr: str) -> None:
        super().__init__(f"git apply --check {patch.name} failed:\n{stderr}")
        self.stderr = stderr


def _apply(tree: Path, patch: Path) -> str:
    """Apply ``patch`` inside ``tree``, with one context line less if need be.

    Returns how it applied ("clean" or "with -C1"); raises PatchConflict if
    it does not.
    """
    for extra in ([], CONTEXT_FALLBACK):
        check = subprocess.run(
            ["git", "apply", "--check", *extra, str(patch)],
            cwd=tree, capture_output=True, text=True, check=False,
        )
        if check.returncode == 0:
            subprocess.run(
                ["git", "apply", *extra, str(patch)], cwd=tree, check=True, capture_output=True
            )
            return "clean" if not extra else f"with {' '.join(extra)}"
    raise PatchConflict(patch, check.stderr)


def _stages() -> list[list[Path]]:
    """Each patch alone, then the whole series."""
    return [[patch] for patch in PATCHES] + ([PATCHES] if len(PATCHES) > 1 else [])


def _stage_name(patches: list[Path]) -> str:
    return "+".join(patch.name[:4] for patch in patches)


def _upstream_tests(patches: list[Path]) -> list[str]:
    """The upstream test files that ``patches`` edit."""
    text = "".join(patch.read_text() for patch in patches)
    return [test for test in UPSTREAM_TESTS if f"diff --git a/{test} " in text]


def _apply_to_copy(tree: Path, patches: list[Path]) -> dict[str, str]:
    """Copy the installed file and the test stand-ins into ``tree``; apply ``patches``."""
    _, installed = _installed_state_dict()
    files = {TARGET: installed, **UPSTREAM_TESTS}
    for path, source in files.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_bytes(source.read_bytes())
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
    seconds: float

    def describe(self) -> str:
        verdict = "passed" if self.returncode == 0 else "failed"
        tests = "?" if self.tests is None else self.tests
        summary = self.summary or "no unittest summary"
        return f"{verdict} ({tests} tests, {summary}) in {self.seconds:.0f} s"

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text().splitlines()
        # unittest's headers name the failing tests; a crashed rank shows only there.
        failed = [line for line in text if re.match(r"(FAIL|ERROR): ", line)]
        return "\n".join([*failed, "...", *text[-lines:]])


def _run_test(test_file: Path, env: dict[str, str], log: Path, test_args) -> TestRun:
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, str(test_file), *test_args],
            cwd=log.parent / "tree", env=env, stdout=out, stderr=subprocess.STDOUT,
            check=False,
        )
    text = log.read_text()
    ran = re.findall(r"^Ran (\d+) tests?", text, re.MULTILINE)
    summary = re.findall(r"^((?:OK|FAILED)\b.*)$", text, re.MULTILINE)
    return TestRun(
        proc.returncode,
        int(ran[-1]) if ran else None,
        summary[-1] if summary else "",
        log,
        time.monotonic() - start,
    )


def _prove(patches: list[Path], test_args: list[str], keep: bool) -> bool:
    """Apply ``patches`` to a copy of the installed file; run their test both ways."""
    version, _ = _installed_state_dict()
    scratch = Path(tempfile.mkdtemp(prefix="torch_patch."))
    tree = scratch / "tree"
    applied = _apply_to_copy(tree, patches)
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

    runs = {
        test: tuple(
            _run_test(tree / test, env, scratch / f"{Path(test).stem}.{name}.log", test_args)
            for name, env in (("unpatched", base_env), ("patched", patched_env))
        )
        for test in _upstream_tests(patches)
    }
    # Each run must reach unittest's summary, over the same tests both ways, so
    # that an import error or a crash before the first test never counts as
    # the bug; the stage's tests fail on stock and all pass patched.
    proven = all(
        unpatched.tests and unpatched.tests == patched.tests
        and patched.returncode == 0 and patched.summary.startswith("OK")
        for unpatched, patched in runs.values()
    ) and any(unpatched.summary.startswith("FAILED") for unpatched, _ in runs.values())
    _print_applied(version, patches, applied)
    for test, (unpatched, patched) in runs.items():
        print(f"  upstream test {test}:")
        print(f"    torch as installed: {unpatched.describe()}")
        print(f"    patched state_dict.py: {patched.describe()}")
    print(f"  backport.status() on the patched torch: {probe[1]}")
    if not proven:
        for unpatched, patched in runs.values():
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
    parser.add_argument(
        "--stage", choices=[_stage_name(patches) for patches in _stages()],
        help="prove this stage only (a patch's number, or the series joined by +)",
    )
    parser.add_argument("test_args", nargs="*", help="passed to the upstream test")
    args = parser.parse_args(argv)
    stages = [
        patches for patches in _stages()
        if args.stage in (None, _stage_name(patches))
    ]

    version, _ = _installed_state_dict()
    if args.apply_only:
        for patches in stages:
            with tempfile.TemporaryDirectory(prefix="torch_patch.") as scratch:
                applied = _apply_to_copy(Path(scratch), patches)
            _print_applied(version, patches, applied)
        return 0
    # Every stage runs and reports, also after one fails.
    results = [_prove(patches, args.test_args, args.keep) for patches in stages]
    proven = all(results)
    if args.stage:
        print(f"result: stage {args.stage} {'proven' if proven else 'NOT PROVEN'} on torch {version}")
    else:
        print(f"result: {'the series fixes' if proven else 'NOT PROVEN on'} torch {version}")
    return 0 if proven else 1


if __name__ == "__main__":
    sys.exit(main())
