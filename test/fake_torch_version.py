"""Run Python on the installed torch faked as another release, to see what the backport does there.

    python test/fake_torch_version.py 2.16.0            # python -m backport on a torch "2.16.0"
    python test/fake_torch_version.py 2.16.0 -- -c "import backport; print(backport.apply())"
    python test/fake_torch_version.py 2.17.0 --fix=undetected --changed-shape

Nothing is installed or modified on disk: a ``sitecustomize`` in a temporary folder on
``PYTHONPATH`` sets ``torch.__version__`` in every Python process the command starts (the
ranks of ``python -m backport`` included). With the options it also puts another
``_verify_options`` in ``torch.distributed.checkpoint.state_dict``, one that calls the real one:

  --fix=detected    it first reshards every FSDP2 module through a helper named
                    ``_reshard_fsdp2_modules``, the fix's artifact that apply() recognises;
  --fix=undetected  the same fix under another helper name, which apply() cannot tell;
  --changed-shape   it has one keyword parameter more than the releases tested.

The arguments after ``--`` go to Python (default: ``-m backport``); the exit status is its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


_SITE_RUN_NAME = "__fake_torch_version_site__"
# Helper names of the faked fix: the one the backport recognises, and another.
_FIX_HELPERS = {"none": None, "detected": "_reshard_fsdp2_modules", "undetected": "_reshard_first"}


def _reshard(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _install() -> None:
    """In each process (from sitecustomize): fake the version and, if asked, the function."""
    import torch
    from torch.torch_version import TorchVersion

    torch.__version__ = TorchVersion(os.environ["FAKE_TORCH_VERSION"])
    helper = _FIX_HELPERS[os.environ.get("FAKE_TORCH_FIX", "none")]
    changed = os.environ.get("FAKE_TORCH_CHANGED_SHAPE") == "1"
    if helper is None and not changed:
        return
    import torch.distributed.checkpoint.state_dict as dsd

    # Compiled from source so that the helper's name is in the function's code.
    source = (
        "def _verify_options(model, optims, optim_only, *, submodules=None, options=None"
        + (", strict=True" if changed else "")
        + "):\n"
        + (f"    {helper}(model)\n" if helper else "")
        + "    return _original(\n"
        + "        model, optims, optim_only, submodules=submodules, options=options\n"
        + "    )\n"
    )
    namespace = {"_original": dsd._verify_options}
    if helper:
        namespace[helper] = _reshard
    exec(compile(source, f"<fake torch {torch.__version__}>", "exec"), namespace)  # noqa: S102
    dsd._verify_options = namespace["_verify_options"]


@contextlib.contextmanager
def faked_env(
    version: str, fix: str = "none", changed_shape: bool = False, base: dict | None = None
) -> Iterator[dict[str, str]]:
    """The environment for a subprocess that sees torch ``version`` (and the options above)."""
    if fix not in _FIX_HELPERS:
        raise ValueError(f"fix must be one of {sorted(_FIX_HELPERS)}, not {fix!r}")
    base = dict(os.environ if base is None else base)
    with tempfile.TemporaryDirectory() as site:
        (Path(site) / "sitecustomize.py").write_text(
            f"import runpy\nrunpy.run_path({str(Path(__file__).resolve())!r}, "
            f"run_name={_SITE_RUN_NAME!r})\n"
        )
        yield {
            **base,
            "PYTHONPATH": os.pathsep.join(filter(None, [site, base.get("PYTHONPATH")])),
            "FAKE_TORCH_VERSION": version,
            "FAKE_TORCH_FIX": fix,
            "FAKE_TORCH_CHANGED_SHAPE": "1" if changed_shape else "0",
        }


def main(argv: list[str]) -> int:
    # Ours before "--", Python's after it.
    split = argv.index("--") if "--" in argv else len(argv)
    ours, python_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python test/fake_torch_version.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("version", help='the torch version to fake, e.g. "2.16.0"')
    parser.add_argument("--fix", choices=sorted(_FIX_HELPERS), default="none")
    parser.add_argument("--changed-shape", action="store_true")
    args = parser.parse_args(ours)
    repo = str(Path(__file__).resolve().parent.parent)
    with faked_env(args.version, args.fix, args.changed_shape) as env:
        # The backport of this checkout, wherever the command is run from.
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], repo])
        return subprocess.call([sys.executable, *(python_args or ["-m", "backport"])], env=env)


if __name__ == _SITE_RUN_NAME:
    _install()
elif __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
