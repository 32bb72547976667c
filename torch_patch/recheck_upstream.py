"""Recheck every upstream piece against the newest checkouts you have.

    python torch_patch/recheck_upstream.py PYTORCH_CHECKOUT [LIGHTNING_CHECKOUT]

Run it with the Python whose torch you want to test (the newest release or a
nightly). It prints one line per piece and exits non-zero if a piece
conflicts, its tests fail, or the FSDP2 report no longer reproduces:

- PR A, PR B, PR A+B (``0*.patch`` here): each applied to a scratch copy of
  the checkout's ``state_dict.py`` and its two test files, then the tests the
  stage's patches add run as ``prove.py`` runs them: the checkout's own test
  file, with the patched ``state_dict.py`` loaded in place of the installed
  one. A conflict names the hunk that failed.
- the Lightning patch (``upstream/lightning_patch/*.patch``): applied to a
  scratch copy of the checkout's top-level files and of the folders the patch
  touches; then the tests it adds or changes run with ``pytest`` and
  ``PYTHONPATH=<copy>/src``. Skipped without a Lightning checkout.
- the FSDP2 issue and the c10d comment: nothing to apply; their repro
  scripts run on 2 CPU ranks (gloo) against the installed torch. The c10d
  abort is intermittent: ``hold`` runs up to ``--c10d-runs`` times, and a
  clean series says only that it was not seen (exit status unaffected).

No network, and neither checkout is modified. ``--only`` picks pieces,
``--no-tests`` only applies the patches, ``--make-fake-pytorch DIR`` writes a
stand-in "checkout" from the installed torch (its ``state_dict.py`` and the
test stand-ins beside this file) to try the script on.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import prove  # its scratch-tree and test-run machinery


UPSTREAM = HERE.parent / "upstream"
LIGHTNING_PATCHES = sorted((UPSTREAM / "lightning_patch").glob("*.patch"))
PIECES = ["pr-a", "pr-b", "pr-ab", "lightning", "fsdp2", "c10d"]


def _git_apply(tree: Path, patch: Path) -> tuple[bool, str]:
    """Apply ``patch`` in ``tree`` as prove.py does (one context line less if need be).

    Returns whether it applied, and how, or git's error with the failed hunk.
    """
    try:
        how = prove._apply(tree, patch)
    except prove.PatchConflict as conflict:
        return False, f"{patch.name}: {_conflict(patch, conflict.stderr)}"
    return True, "" if how == "clean" else f" ({how})"


def _conflict(patch: Path, stderr: str) -> str:
    """git's first error line, and the hunk of ``patch`` that it names."""
    first = stderr.strip().splitlines()[0] if stderr.strip() else "?"
    failed = re.search(r"patch failed: (\S+):(\d+)", stderr)
    if not failed:
        return first
    # The hunk of that file whose old side starts at that line.
    path, line = failed.groups()
    in_file = False
    for text in patch.read_text().splitlines():
        if text.startswith("diff --git "):
            in_file = text.endswith(f" b/{path}")
        elif in_file and text.startswith(f"@@ -{line},"):
            return f"{first}; hunk {text}"
    return first


def _git_apply_all(tree: Path, patches: list[Path]) -> tuple[bool, str]:
    """Apply ``patches`` in order; whether all applied, and how, or the first conflict."""
    how = ""
    for patch in patches:
        applied, note = _git_apply(tree, patch)
        if not applied:
            return False, note
        how += note
    return True, how


def _added_tests(patches: list[Path], test_file: str) -> list[str]:
    """Names of the test functions ``patches`` add to, or change in, ``test_file``."""
    names: list[str] = []
    in_file = False
    for patch in patches:
        for text in patch.read_text().splitlines():
            if text.startswith("diff --git "):
                in_file = text.endswith(f" b/{test_file}")
                continue
            if not in_file:
                continue
            found = re.match(r"\+\s*(?:async )?def (test_\w+)", text) or re.match(
                r"@@ .* @@\s*(?:async )?def (test_\w+)", text
            )
            if found and found.group(1) not in names:
                names.append(found.group(1))
    return names


def _report(piece: str, ok: bool, text: str, scratch: Path | None = None) -> bool:
    print(f"{piece}: {text}", flush=True)
    if ok and scratch is not None:
        shutil.rmtree(scratch)  # a failure's scratch tree stays, for its logs
    return ok


def _apply_then_test(
    name: str,
    scratch: Path,
    tree: Path,
    patches: list[Path],
    tests: bool,
    run_tests: Callable[[], tuple[bool, str]],
) -> bool:
    """Apply ``patches`` in ``tree`` (in ``scratch``), then run ``run_tests()`` if ``tests``.

    ``run_tests`` returns whether the tests pass and what the line says of them.
    Prints the piece's one line; returns whether it passed.
    """
    applied, how = _git_apply_all(tree, patches)
    if not applied:
        shutil.rmtree(scratch)
        return _report(name, False, f"CONFLICTS: {how}")
    if not tests:
        return _report(name, True, f"applies{how}, tests not run", scratch)
    ok, verdict = run_tests()
    return _report(name, ok, f"applies{how}, tests {verdict}", scratch)


def _torch_stage(name: str, checkout: Path, patches: list[Path], tests: bool) -> bool:
    files = [prove.TARGET, *prove.UPSTREAM_TESTS]
    scratch = Path(tempfile.mkdtemp(prefix="recheck."))
    tree = scratch / "tree"
    missing = [f for f in files if not (checkout / f).is_file()]
    for path in files:
        if path not in missing:
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(checkout / path, tree / path)
    if prove.TARGET in missing:
        return _report(name, False, f"FAILS: {prove.TARGET} is not in {checkout}")
    return _apply_then_test(
        name, scratch, tree, patches, tests, lambda: _torch_tests(scratch, tree, patches, missing)
    )


def _torch_tests(
    scratch: Path, tree: Path, patches: list[Path], missing: list[str]
) -> tuple[bool, str]:
    """The tests ``patches`` add or change, run as prove.py runs them on the patched tree."""
    site = scratch / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(prove.SITECUSTOMIZE)
    env = {
        **os.environ,
        "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        "TORCH_PATCH_STATE_DICT": str(tree / prove.TARGET),
    }
    env.pop("CI", None)
    ok, skipped, results = True, False, []
    for test in prove._upstream_tests(patches):
        names = _added_tests(patches, test)
        if test in missing:
            results.append(f"{test} not in the checkout, not run")
            ok = False
            continue
        args = [arg for name in names for arg in ("-k", name)]
        run = prove._run_test(tree / test, env, scratch / f"{Path(test).stem}.log", args)
        passed = run.returncode == 0 and bool(run.tests) and run.summary.startswith("OK")
        ok &= passed
        # Upstream's FSDPTest skips without 2 GPUs: all skipped proves nothing.
        skipped |= passed and f"skipped={run.tests}" in run.summary
        results.append(f"{Path(test).name}: {run.describe()}")
    verdict = "pass" if ok else f"FAIL (logs: {scratch})"
    if ok and skipped:
        verdict = "pass, but every test of a file was SKIPPED (run them where they can run)"
    return ok, f"{verdict}: {'; '.join(results)}"


def _lightning(checkout: Path | None, tests: bool) -> bool:
    name = "Lightning patch"
    if checkout is None:
        return _report(name, True, "skipped (no Lightning checkout given)")
    scratch = Path(tempfile.mkdtemp(prefix="recheck.lightning."))
    touched = {
        line.split()[2][2:].split("/")[0]
        for patch in LIGHTNING_PATCHES
        for line in patch.read_text().splitlines()
        if line.startswith("diff --git ")
    }
    for entry in checkout.iterdir():
        if entry.is_file():
            shutil.copy2(entry, scratch / entry.name)
        elif entry.name in touched:
            shutil.copytree(entry, scratch / entry.name, symlinks=True)
    return _apply_then_test(
        name, scratch, scratch, LIGHTNING_PATCHES, tests, lambda: _lightning_tests(scratch)
    )


def _lightning_tests(scratch: Path) -> tuple[bool, str]:
    """The tests the Lightning patch adds or changes, run with pytest on the patched copy."""
    targets = []
    for patch in LIGHTNING_PATCHES:
        for line in patch.read_text().splitlines():
            test = line.split()[2][2:] if line.startswith("diff --git ") else ""
            if test.startswith("tests/") and test.endswith(".py"):
                targets += [f"{test}::{n}" for n in _added_tests(LIGHTNING_PATCHES, test)]
    env = {**os.environ, "PYTHONPATH": str(scratch / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider", *targets],
        cwd=scratch, env=env, capture_output=True, text=True, check=False,
    )
    (scratch / "pytest.log").write_text(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or ["no pytest output"])[-1].strip("= ")
    if proc.returncode == 0:
        return True, f"pass ({len(targets)} node ids: {summary})"
    return False, f"FAIL ({summary}; log: {scratch}/pytest.log)"


def _torchrun(script: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run(
            [*command, str(script), *args], env=env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired as timed_out:
        return subprocess.CompletedProcess(timed_out.cmd, -1, "", f"timed out after {timeout} s")


def _fsdp2() -> bool:
    name = "FSDP2 issue"
    script = UPSTREAM / "fsdp2_issue" / "repro.py"
    bug = _torchrun(script)
    out = bug.stdout + bug.stderr
    segfault = bug.returncode != 0 and "calling" in out and ("-11" in out or "SIGSEGV" in out)
    fix = _torchrun(script, "proposed_fix")
    fixed = f"proposed_fix exits {fix.returncode}"
    if segfault:
        return _report(name, fix.returncode == 0, f"still reproduces (SIGSEGV); {fixed}")
    tail = " | ".join(out.strip().splitlines()[-3:])
    return _report(name, False, f"DOES NOT REPRODUCE (exit {bug.returncode}: {tail}); {fixed}")


def _c10d(runs: int) -> bool:
    name = "c10d comment"
    script = UPSTREAM / "c10d_issue" / "exit_race.py"
    for run in range(1, runs + 1):
        proc = _torchrun(script, "hold", timeout=120)
        out = proc.stdout + proc.stderr
        if "terminate called without an active exception" in out:
            return _report(name, True, f"still reproduces (aborted on run {run} of up to {runs})")
        if proc.returncode != 0:
            tail = " | ".join(out.strip().splitlines()[-3:])
            return _report(name, False, f"FAILS otherwise (exit {proc.returncode}: {tail})")
    return _report(name, True, f"no abort in {runs} runs (it can be rare; not proof it is gone)")


def make_fake_pytorch(directory: Path) -> None:
    """Write the installed ``state_dict.py`` and the test stand-ins as a checkout."""
    _, installed = prove._installed_state_dict()
    for path, source in {prove.TARGET: installed, **prove.UPSTREAM_TESTS}.items():
        (directory / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, directory / path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pytorch", type=Path, nargs="?", help="a pytorch/pytorch checkout")
    parser.add_argument("lightning", type=Path, nargs="?", help="a pytorch-lightning checkout")
    parser.add_argument("--only", action="append", choices=PIECES, help="this piece only")
    parser.add_argument("--no-tests", action="store_true", help="only apply the patches")
    parser.add_argument("--c10d-runs", type=int, default=10, metavar="N")
    parser.add_argument("--make-fake-pytorch", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    if args.make_fake_pytorch:
        make_fake_pytorch(args.make_fake_pytorch)
        return 0
    pieces = args.only or PIECES
    if args.pytorch is None and {"pr-a", "pr-b", "pr-ab"} & set(pieces):
        parser.error("a pytorch checkout is needed for the PR pieces")
    import torch

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}", flush=True)
    patches = prove.PATCHES
    stages = {
        "pr-a": ("PR A (0001)", patches[:1]),
        "pr-b": ("PR B (0002)", patches[1:2]),
        "pr-ab": ("PR A+B", patches),
    }
    results = []
    for piece in pieces:
        if piece in stages:
            label, stage = stages[piece]
            results.append(_torch_stage(label, args.pytorch, stage, not args.no_tests))
        elif piece == "lightning":
            results.append(_lightning(args.lightning, not args.no_tests))
        elif piece == "fsdp2" and not args.no_tests:
            results.append(_fsdp2())
        elif piece == "c10d" and not args.no_tests:
            results.append(_c10d(args.c10d_runs))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
