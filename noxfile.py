"""The test suite once per tested torch release and ruff: ``nox`` runs them all.

``nox -s "tests(torch='2.13.0')"`` runs one. Each session installs that torch
(CUDA builds run on the CPU) and this package with its ``test`` extra into its
own virtualenv, then runs pytest; arguments after ``--`` go to pytest. On
2.7.1 the ``twinkle`` extra replaces the ``test`` extra (their pins conflict).
"""

import os
import shutil

import nox


# 2.10.0 is the primary target; 2.15.0 the newest release; 2.7.1 the release
# twinkle's Ascend documentation pins (torch_npu 2.7.1).
TORCH_VERSIONS = ["2.7.1", "2.10.0", "2.13.0", "2.15.0"]
# twinkle-kit pins peft and numpy against the test extra: twinkle's release
# installs the twinkle extra instead, which has accelerate and transformers
# too, and runs its torch27 tests (accelerate, transformers, twinkle) with it.
TWINKLE_TORCH = "2.7.1"
# The tests marked frameworks (accelerate, transformers, Lightning, torchtitan,
# the examples) run on this release, which installs the frameworks extra, and
# only those, tooling and proof: the rest run on 2.10.0 and 2.15.0 (CI time).
# tooling and proof start Python processes by the dozen, each importing torch:
# a CPU build, where one is at hand (PIP_FIND_LINKS), imports in half the time
# of the CUDA builds the registry serves. 2.7.1 runs the frameworks tests also
# marked torch27 (accelerate, transformers, twinkle).
FRAMEWORKS_TORCH = "2.13.0"
# 2.13.0 and 2.15.0 run the multi-rank tests at world size 2 only; 2.10.0,
# the primary target, at 1, 2 and 4 ranks.
WORLD_SIZE_2_ONLY = "not world_size_1 and not world_size_4"
# Tests of the project's own tools (marked tooling: packaging, the diagnosis's
# texts, the benchmark script, the rank launcher, recheck_upstream.py) on one
# release: their result does not depend on it. prove.py's proof of the
# upstream stack (marked proof) on one too; 2.10.0 and 2.15.0 check that the
# stack applies. The rest, the core suite, on 2.10.0 and 2.15.0.
CORE_SUITE = "not frameworks and not tooling and not proof"
SELECTIONS = {
    "2.7.1": ["-m", "not tooling"],
    "2.10.0": ["-m", CORE_SUITE],
    FRAMEWORKS_TORCH: ["-k", WORLD_SIZE_2_ONLY, "-m", "frameworks or tooling or proof"],
    "2.15.0": ["-k", WORLD_SIZE_2_ONLY, "-m", CORE_SUITE],
}

nox.options.reuse_existing_virtualenvs = True
# uv installs a CUDA build of torch in well under half pip's time; without
# uv, virtualenv and pip.
nox.options.default_venv_backend = "uv|virtualenv"

# `nox` alone runs these (what CI runs); `nox -s flake`, `nox -s fuzz` and
# `nox -s torchtitan03` are run by hand.
nox.options.sessions = ["lint", "tests"]

# A CUDA build of torch fills 5.5-7.3 GiB of virtualenv, and the sessions'
# virtualenvs together over 20 GiB: more than some CI machines have free (a run
# failed with "No space left on device" installing the fourth). With DISCARD_NOX_VENVS=1,
# which .ci/run sets, each session removes its virtualenv when it ends,
# whatever the result, so one is on disk at a time.
DISCARD_VENVS = os.environ.get("DISCARD_NOX_VENVS") == "1"
# A pip constraints file (PIP_CONSTRAINT, pip.conf) that caps torch below a
# release the sessions install makes them fail. NOX_IGNORE_PIP_CONSTRAINT=1
# (opt-in; .ci/run sets it) installs without it; by default a user's or
# company's constraints apply. uv does not read pip's configuration.
IGNORE_PIP_CONSTRAINT = os.environ.get("NOX_IGNORE_PIP_CONSTRAINT") == "1"


def _install(session: nox.Session, *args: str) -> None:
    env = {"PIP_CONSTRAINT": "/dev/null"} if IGNORE_PIP_CONSTRAINT else {}
    session.install(*args, env=env)


def _install_and_run(
    session: nox.Session, requirements: list[str], command: list[str]
) -> None:
    try:
        _install(session, *requirements)
        session.run(*command)
    finally:
        if DISCARD_VENVS:
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def _install_and_pytest(
    session: nox.Session, requirements: list[str], default: list[str]
) -> None:
    """pytest with the arguments after ``--``, or ``default`` without any."""
    command = ["python", "-m", "pytest", *(session.posargs or default)]
    _install_and_run(session, requirements, command)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    extras = ["twinkle" if torch == TWINKLE_TORCH else "test"]
    if torch != "2.7.1":
        extras.append("torchao")
    if torch == FRAMEWORKS_TORCH:
        extras.append("frameworks")
    # --durations: the slowest tests of each session show in the log.
    default = ["-q", "--durations=15"]
    # On 2.7, test/conftest.py skips every test not marked torch27.
    default += SELECTIONS.get(torch, [])
    _install_and_pytest(session, [f"torch=={torch}", f".[{','.join(extras)}]"], default)


@nox.session
def torchtitan03(session: nox.Session) -> None:
    """test/test_torchtitan.py against torchtitan 0.3.x, which no longer calls DSD."""
    requirements = [f"torch=={FRAMEWORKS_TORCH}", ".[test]", "torchtitan==0.3.0"]
    _install_and_pytest(session, requirements, ["-q", "-rs", "test/test_torchtitan.py"])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, at the version the ``lint`` extra pins, on the whole tree."""
    extras = nox.project.load_toml("pyproject.toml")["project"]["optional-dependencies"]
    # Not ".[lint]": that would install torch.
    session.install(*extras["lint"])
    session.run("ruff", "check", *(session.posargs or ["."]))


@nox.session
def flake(session: nox.Session) -> None:
    """The tests marked ranks three times in a row on the frameworks release."""
    _install(session, f"torch=={FRAMEWORKS_TORCH}", ".[test,torchao,frameworks]")
    for _ in range(3):
        session.run(
            "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-m", "ranks", "-k", WORLD_SIZE_2_ONLY, *session.posargs,
        )


@nox.session
def fuzz(session: nox.Session) -> None:
    """A long randomized differential run: ``nox -s fuzz -- --seeds 0-9 --n 100``.

    Arguments go to ``test/fuzz_differential.py`` (``--help`` lists them);
    ``FUZZ_TORCH=2.15.0 nox -s fuzz`` picks the release.
    """
    torch = os.environ.get("FUZZ_TORCH", "2.10.0")
    default = ["--seeds", "0-9", "--n", "30"]
    _install_and_run(
        session,
        [f"torch=={torch}", ".[test]"],
        ["python", "test/fuzz_differential.py", *(session.posargs or default)],
    )
