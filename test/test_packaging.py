"""The sdist and wheel: what they contain, and ``python -m backport`` from the installed wheel."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import unittest
import zipfile
from email.parser import Parser
from pathlib import Path

import expecttest
import pytest


pytestmark = [pytest.mark.ranks, pytest.mark.torch27, pytest.mark.tooling]


ROOT = Path(__file__).resolve().parent.parent
# The build outputs and environments a checkout may hold, for a tree without git.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".nox", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
)


def _copy_source(destination: Path) -> None:
    """Copy what a clone holds, and new files not committed yet, to ``destination``."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, destination, ignore=_NOT_SOURCE)
        return
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        # A tracked file deleted in the working tree is not part of it.
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def _run(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    # Not from the checkout: no PYTHONPATH, and a working directory without it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


class PackagingTest(expecttest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(tmp.cleanup)
        cls.tmp = Path(tmp.name)
        source, dist = cls.tmp / "source", cls.tmp / "dist"
        _copy_source(source)
        # The sdist, then the wheel built from the unpacked sdist, with this
        # environment's setuptools (the test extra's): no download.
        proc = _run(
            sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
            str(source), cwd=cls.tmp,
        )
        if proc.returncode != 0:
            raise AssertionError(f"python -m build failed:\n{proc.stdout}\n{proc.stderr}")
        (cls.sdist,) = dist.glob("*.tar.gz")
        (cls.wheel,) = dist.glob("*.whl")
        # A fresh virtualenv that sees this environment's packages (torch, numpy)
        # after its own, so installing the wheel downloads nothing.
        venv = cls.tmp / "venv"
        proc = _run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=cls.tmp)
        if proc.returncode != 0:
            raise AssertionError(f"python -m venv failed:\n{proc.stderr}")
        cls.python = str(venv / "bin" / "python")
        venv_site = _run(
            cls.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            cwd=cls.tmp,
        ).stdout.strip()
        paths = sysconfig.get_paths()
        (Path(venv_site) / "_this_environment.pth").write_text(
            "\n".join(dict.fromkeys([paths["purelib"], paths["platlib"]])) + "\n"
        )
        # --no-index: no download. --no-deps: torch and numpy come from this
        # environment, and a machine's constraints file may cap torch below the
        # one installed. --force-reinstall: this environment may hold the
        # package itself (nox installs it), which pip would take as installed.
        # The requirements are pinned by test_wheel_contents_and_requirements.
        cls.install = _run(
            sys.executable, "-m", "pip", "--python", cls.python, "--isolated", "install",
            "--no-index", "--no-deps", "--force-reinstall", str(cls.wheel), cwd=cls.tmp,
        )
        cls.venv = venv

    def test_sdist_contents(self) -> None:
        """The sdist holds the package, its license, README and pyproject.toml."""
        with tarfile.open(self.sdist) as sdist:
            names = [name.partition("/")[2] for name in sdist.getnames()]
        # test/ travels too (setuptools' default); its files change often.
        self.assertExpectedInline("\n".join(sorted(
            name for name in names if name.partition("/")[0] not in ("", "test")
        )), """\
LICENSE
PKG-INFO
README.md
backport
backport/__init__.py
backport/__main__.py
backport/_diagnose.py
fsdp2_dcp_eval_backport.egg-info
fsdp2_dcp_eval_backport.egg-info/PKG-INFO
fsdp2_dcp_eval_backport.egg-info/SOURCES.txt
fsdp2_dcp_eval_backport.egg-info/dependency_links.txt
fsdp2_dcp_eval_backport.egg-info/requires.txt
fsdp2_dcp_eval_backport.egg-info/top_level.txt
pyproject.toml
setup.cfg""")

    def test_wheel_contents_and_requirements(self) -> None:
        """The wheel holds the package and license, and requires torch and numpy only."""
        with zipfile.ZipFile(self.wheel) as wheel:
            names = sorted(wheel.namelist())
            (metadata_name,) = (n for n in names if n.endswith(".dist-info/METADATA"))
            metadata = Parser().parsestr(wheel.read(metadata_name).decode())
        self.assertExpectedInline("\n".join(names), """\
backport/__init__.py
backport/__main__.py
backport/_diagnose.py
fsdp2_dcp_eval_backport-0.1.0.dist-info/METADATA
fsdp2_dcp_eval_backport-0.1.0.dist-info/RECORD
fsdp2_dcp_eval_backport-0.1.0.dist-info/WHEEL
fsdp2_dcp_eval_backport-0.1.0.dist-info/licenses/LICENSE
fsdp2_dcp_eval_backport-0.1.0.dist-info/top_level.txt""")
        requires = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
        self.assertExpectedInline(
            "\n".join([f"License-Expression: {metadata['License-Expression']}", *requires]),
            """\
License-Expression: BSD-3-Clause
torch>=2.7
numpy""",
        )

    def test_installed_wheel_help(self) -> None:
        """The wheel installs offline over the installed torch; --help answers from it."""
        self.assertEqual(self.install.returncode, 0, self.install.stdout + self.install.stderr)
        where = _run(self.python, "-c", "import backport; print(backport.__file__)", cwd=self.tmp)
        self.assertTrue(where.stdout.strip().startswith(str(self.venv)), where)
        proc = _run(self.python, "-m", "backport", "--help", cwd=self.tmp)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertTrue(proc.stdout.startswith("usage: python -m backport [-h]\n"), proc.stdout)

    def test_installed_wheel_runs_the_check(self) -> None:
        """python -m backport from the installed wheel: affected, and fixed by apply()."""
        self.assertEqual(self.install.returncode, 0, self.install.stdout + self.install.stderr)
        proc = _run(self.python, "-m", "backport", cwd=self.tmp, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("\nAffected: yes. ", proc.stdout)
        self.assertIn("\nFixed by backport.apply(): yes ", proc.stdout)
        # The file to vendor is the installed one.
        installed = _run(
            self.python, "-c", "import backport; print(backport.__file__)", cwd=self.tmp
        ).stdout.strip()
        self.assertTrue(installed.startswith(str(self.venv)), installed)
        self.assertEqual(proc.stdout.splitlines()[-1].strip(), installed, proc.stdout)


if __name__ == "__main__":
    unittest.main()
