"""The test suite once per tested torch release: ``nox`` runs them all.

``nox -s "tests(torch='2.13.0')"`` runs one. Each session installs that torch
(CUDA builds run on the CPU) and this package with its ``test`` extra into its
own virtualenv, then runs pytest; arguments after ``--`` go to pytest.
"""

import nox


# 2.10.0 is the primary target; 2.15.0 the newest release.
TORCH_VERSIONS = ["2.10.0", "2.13.0", "2.15.0"]
# The Lightning and torchtitan tests run on this release only (CI time).
FRAMEWORKS_TORCH = "2.13.0"

nox.options.reuse_existing_virtualenvs = True


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    # Some machines cap pip at an older torch through a constraints file.
    extras = "test,frameworks" if torch == FRAMEWORKS_TORCH else "test"
    session.install(f"torch=={torch}", f".[{extras}]", env={"PIP_CONSTRAINT": "/dev/null"})
    session.run("python", "-m", "pytest", *(session.posargs or ["-q"]))
