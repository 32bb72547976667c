"""The test suite once per tested torch release, and twinkle's tests: ``nox`` runs them all.

``nox -s "tests(torch='2.13.0')"`` runs one. Each session installs that torch
(CUDA builds run on the CPU) and this package with its ``test`` extra into its
own virtualenv, then runs pytest; arguments after ``--`` go to pytest. The
``twinkle`` session installs the ``twinkle`` extra instead (its pins conflict
with the ``test`` extra's) and runs ``test/test_twinkle.py``.
"""

import os
import shutil

import nox


# 2.10.0 is the primary target; 2.15.0 the newest release; 2.7.1 the release
# twinkle's Ascend documentation pins (torch_npu 2.7.1).
TORCH_VERSIONS = ["2.7.1", "2.10.0", "2.13.0", "2.15.0"]
# The Lightning and torchtitan tests run on this release only (CI time). It
# runs the multi-rank matrices at world size 2 only: 2.10.0 (the primary
# target) and 2.15.0 (the newest) run them at 1, 2 and 4 ranks. It checks
# that the upstream series applies but does not run prove.py's tests: its
# state_dict.py differs from 2.15.0's in one comment, and 2.10.0 and 2.15.0
# run them.
FRAMEWORKS_TORCH = "2.13.0"
WORLD_SIZE_2_ONLY = "not world_size_1 and not world_size_4"
FRAMEWORKS_TORCH_SELECTION = [
    "-k", f"{WORLD_SIZE_2_ONLY} and not test_prove_patch_on_installed_torch",
]
# On 2.7 fully_shard rejects reshard_after_forward=None, which the rest of the
# suite builds its root with; test_torch27.py covers 2.7's own cases.
TORCH_27_TESTS = [
    "test/test_torch27.py",
    "test/test_api.py",
    "test/test_vendoring.py",
    "test/test_patch_matches_backport.py",
    "test/test_diagnose.py",
    "test/test_unaffected_models.py",
    "test/test_accelerate.py",
    "test/test_transformers_trainer.py",
]

# Every test file that starts ranks (run_ranks, torchrun, prove.py's
# MultiProcessTestCase); the flake session runs each three times in a row.
MULTI_RANK_TESTS = [
    "test/test_accelerate.py",
    "test/test_benchmarks_smoke.py",
    "test/test_checkpoint_roundtrip.py",
    "test/test_diagnose.py",
    "test/test_do_no_harm.py",
    "test/test_errors.py",
    "test/test_eval_state_dict_matrix.py",
    "test/test_eval_state_dict_setups.py",
    "test/test_example_accelerate.py",
    "test/test_example_fabric.py",
    "test/test_fsdp2_tied_module_hooks.py",
    "test/test_lightning_fabric.py",
    "test/test_lightning_patch.py",
    "test/test_lightning_trainer.py",
    "test/test_state_dict_structure.py",
    "test/test_torch_patch.py",
    "test/test_torchtitan.py",
    "test/test_transformers_trainer.py",
    "test/test_unaffected_models.py",
]

nox.options.reuse_existing_virtualenvs = True

# `nox` alone runs these (what CI runs); `nox -s flake` is run by hand.
nox.options.sessions = ["tests", "twinkle"]

# A CUDA build of torch fills 5.5-7.3 GiB of virtualenv, and the five sessions'
# virtualenvs 23 GiB: more than some CI machines have free (a run failed with
# "No space left on device" installing the fourth). With DISCARD_NOX_VENVS=1,
# which .ci/run sets, each session removes its virtualenv when it ends,
# whatever the result, so one is on disk at a time.
DISCARD_VENVS = os.environ.get("DISCARD_NOX_VENVS") == "1"


def _install(session: nox.Session, *args: str) -> None:
    # Some machines cap pip at an older torch through a constraints file.
    session.install(*args, env={"PIP_CONSTRAINT": "/dev/null"})


def _install_and_test(
    session: nox.Session, requirements: list[str], pytest_args: list[str]
) -> None:
    try:
        _install(session, *requirements)
        session.run("python", "-m", "pytest", *pytest_args)
    finally:
        if DISCARD_VENVS:
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    extras = "test,frameworks" if torch == FRAMEWORKS_TORCH else "test"
    # --durations: the slowest tests of each session show in the log.
    default = ["-q", "--durations=15"]
    if torch.startswith("2.7."):
        default += TORCH_27_TESTS
    elif torch == FRAMEWORKS_TORCH:
        default += FRAMEWORKS_TORCH_SELECTION
    _install_and_test(
        session, [f"torch=={torch}", f".[{extras}]"], session.posargs or default
    )


@nox.session
def twinkle(session: nox.Session) -> None:
    default = ["-q", "--durations=15", "test/test_twinkle.py"]
    _install_and_test(
        session, ["torch==2.13.0", ".[twinkle]"], session.posargs or default
    )


@nox.session
def flake(session: nox.Session) -> None:
    """Each multi-rank test file three times in a row on the frameworks release."""
    _install(session, f"torch=={FRAMEWORKS_TORCH}", ".[test,frameworks]")
    for path in session.posargs or MULTI_RANK_TESTS:
        for _ in range(3):
            session.run(
                "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "-k", WORLD_SIZE_2_ONLY, path,
            )
