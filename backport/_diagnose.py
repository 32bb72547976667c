"""Check whether the installed torch has the FSDP2 evaluation checkpoint bug, and
whether backport.apply() fixes it.

Runs a small FSDP2 job in 2 CPU processes (gloo; no GPU needed; under a
minute): one training step, an evaluation forward under torch.no_grad(), then
get_optimizer_state_dict and set_optimizer_state_dict. Once on torch as
installed, once after backport.apply() in those 2 processes only: nothing is
written to disk, and your torch stays unpatched until your code calls
backport.apply().

On a torch newer than the releases the backport supports (2.7 to 2.15) it
says so; apply() patches such a torch where the functions it wraps keep their
shape, and this check shows whether it still needs the backport. Install a
supported torch with: pip install "torch>=2.7,<2.16" (for a CPU-only or a specific
CUDA/ROCm build, add the index URL that pytorch.org gives).

Exit status:
  0  not affected, or affected and fixed by backport.apply()
  1  affected and not fixed: backport.apply() does not fix it or refuses this
     torch
  2  usage error
  3  no verdict: the check could not run, or this Python has no torch
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib.util
import os
import sys
import textwrap
import uuid
import warnings
from datetime import timedelta

import backport


WORLD_SIZE = 2
# The exit status when there is no verdict, apart from 1 (affected and not fixed).
NO_VERDICT = 3
# One failing rank must fail the check, not leave its peer in a collective
# until gloo's default 30 minute timeout.
_PG_TIMEOUT = timedelta(seconds=90)
_OK = "ok"
# (row label, key in a scenario's outcome)
_STEPS = (
    ("optimizer state saved after no_grad eval", "save"),
    ("optimizer state loaded after no_grad eval", "load"),
)


def _progress(line: str) -> None:
    # stderr: the ranks' stdout goes there too (_rank), and the report on
    # stdout stays clean when redirected.
    print(f"backport: {line}", file=sys.stderr, flush=True)


def _build():
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    # The root keeps the default reshard_after_forward (False for the root).
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _snapshot(osd):
    import torch
    from torch.distributed.tensor import DTensor

    flat = {}
    for fqn, entries in osd["state"].items():
        for key, value in entries.items():
            if isinstance(value, DTensor):
                value = value.to_local()
            flat[(fqn, key)] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return flat


def _equal(a, b) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _error(err: BaseException) -> str:
    import torch

    if isinstance(err, KeyError) and err.args and isinstance(err.args[0], torch.Tensor):
        return f"KeyError: {type(err.args[0]).__name__}(...)"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:60]


def _scenario() -> dict[str, str]:
    import torch
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_map_only

    model, optim = _build()
    # Every group is sharded before the evaluation, so this works on any torch.
    # Cloned: the state dict shares storage with the optimizer state.
    reference = tree_map_only(
        torch.Tensor, lambda t: t.detach().clone(), get_optimizer_state_dict(model, optim)
    )
    expected = _snapshot(reference)
    outcome = {}
    with torch.no_grad():
        model(torch.randn(4, 8))
    try:
        saved = get_optimizer_state_dict(model, optim)
        outcome["save"] = _OK if _equal(_snapshot(saved), expected) else "WRONG VALUES"
    except Exception as err:  # noqa: BLE001 - reported in the table
        outcome["save"] = _error(err)
    with torch.no_grad():
        for state in optim.state.values():
            for value in state.values():
                value.add_(1.0)
        model(torch.randn(4, 8))
    try:
        set_optimizer_state_dict(model, optim, reference)
        restored = _snapshot(get_optimizer_state_dict(model, optim))
        outcome["load"] = _OK if _equal(restored, expected) else "WRONG VALUES"
    except Exception as err:  # noqa: BLE001 - reported in the table
        outcome["load"] = _error(err)
    return outcome


def _worker() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    report = _progress if dist.get_rank() == 0 else lambda line: None
    result: dict[str, object] = {
        "torch": str(torch.__version__),
        "torch_dir": os.path.dirname(torch.__file__),
        "status": backport.status(),
    }
    report(f"checking torch {torch.__version__} as installed...")
    result["without"] = _scenario()
    try:
        with warnings.catch_warnings():
            # "not needed" is reported from status above, "untested" from the version.
            warnings.simplefilter("ignore", backport.BackportWarning)
            backport.apply()
    except backport.UnsupportedTorchError as err:
        result["refused"] = err.reason
        return result
    try:
        report("checking again with backport.apply() in these processes...")
        result["with"] = _scenario()
    finally:
        backport.revert()
    return result


def _rank() -> dict[str, object]:
    """One rank of the check, as torch's launcher starts it (torchrun's environment)."""
    import torch
    import torch.distributed as dist

    # Native libraries (gloo) log to stdout; keep the parent's stdout for the report.
    os.dup2(2, 1)
    # A rank killed by a signal prints its Python stacks, not only its exit code.
    faulthandler.enable()
    if "OMP_NUM_THREADS" not in os.environ:
        # What torchrun does for several ranks on one host.
        torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=_PG_TIMEOUT)
    try:
        return _worker()
    finally:
        dist.destroy_process_group()
        # A gloo group still referenced (FSDP2's mesh info, in reference cycles)
        # keeps its threads; one that outlives the interpreter's finalization
        # aborts the rank (upstream/c10d_issue/ISSUE.md). Freeing the groups now joins them.
        gc.collect()


def _run_check() -> dict[str, object]:
    """Rank 0's result of ``_rank`` on ``WORLD_SIZE`` processes started by torch's launcher."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=WORLD_SIZE,
        run_id=f"backport-check-{uuid.uuid4().hex[:8]}",
        # The launcher's own store, on a port the OS assigns.
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
    )
    return elastic_launch(config, _rank)()[0]


def _table(without: dict[str, str], with_fix: dict[str, str] | None) -> list[str]:
    width = max(len(label) for label, _ in _STEPS)
    lines = [
        f"{'step'.ljust(width)} | {'torch as installed':<38} | with backport.apply()",
        f"{'-' * width}-|-{'-' * 38}-|-{'-' * 22}",
    ]
    for label, key in _STEPS:
        fixed = with_fix[key] if with_fix else "-"
        lines.append(f"{label.ljust(width)} | {without[key]:<38} | {fixed}")
    return lines


def _affected(outcomes: list[str]) -> list[str]:
    if any(value.startswith("KeyError") for value in outcomes):
        return [
            "Affected: yes. After the evaluation forward, DSD could not map the optimizer's",
            "parameters to the model's: the model still holds FSDP2's unsharded parameters,",
            "the optimizer the sharded ones. Each KeyError is the optimizer parameter DSD",
            "looked for, by its index (KeyError: <n>) or itself (KeyError: DTensor(...)).",
        ]
    if "WRONG VALUES" in outcomes:
        return [
            "Affected: yes. After the evaluation forward, the optimizer state read back",
            "differs from the state before it.",
        ]
    return ["Affected: yes. After the evaluation forward, a step raised the error shown."]


def _report(result: dict[str, object]) -> tuple[str, int]:
    """Return the report on ``result`` from rank 0 and the exit status."""
    version = result["torch"]
    without = result["without"]
    with_fix = result.get("with")
    refused = result.get("refused")
    affected = any(value != _OK for value in without.values())
    lines = [f"torch {version} ({result['torch_dir']})", *_table(without, with_fix), ""]
    if backport._is_untested(str(version)):
        lines += [
            f"Untested: torch {version} is newer than the releases this backport supports",
            f"({backport._supported_range()}); the table above is what it does here.",
            "",
        ]
    if not affected:
        if str(result["status"]).startswith("not needed: "):
            lines += [f"Affected: no. {str(result['status'])[len('not needed: '):]}."]
            return "\n".join(lines), 0
        lines += [
            f"Affected: no. torch {version} saved and loaded the optimizer state after",
            "the evaluation forward: you do not need backport.apply().",
        ]
        if refused is not None:
            lines += [
                "",
                "Next step: remove backport.apply() from your code; it refuses this torch:",
                *textwrap.wrap(f"{refused}.", width=80),
            ]
        elif any(value != _OK for value in with_fix.values()):
            lines += [
                "",
                "Next step: remove backport.apply() from your code; with it a step fails that",
                "works without it (right column). Please report this output.",
            ]
        return "\n".join(lines), 0
    lines += _affected(list(without.values()))
    if refused is not None:
        lines += [
            "",
            "Fixed by backport.apply(): no, it refused this torch (right column: not run):",
            *textwrap.wrap(f"{refused}.", width=80),
            "",
            f"Next step: install a supported torch ({backport._supported_range()}), e.g.",
            "",
            f"    {backport._install_command()}",
            "",
            "or apply torch_patch/ (from the backport's project) to your torch.",
        ]
        return "\n".join(lines), 1
    if any(value != _OK for value in with_fix.values()):
        lines += [
            "",
            "Fixed by backport.apply(): no (right column). Do not rely on the backport with",
            f"torch {version}; please report this output and how torch was installed.",
        ]
        return "\n".join(lines), 1
    lines += [
        "",
        "Fixed by backport.apply(): yes (right column). This check applied it in its",
        f"own {WORLD_SIZE} processes only: your torch is not patched.",
        "",
        "Next step: on every rank, before the first checkpoint (e.g. at the top of the",
        "training script), add",
        "",
        "    import backport; backport.apply()",
        "",
        "or vendor the backport: copy this one file into your code base under any name",
        "and call its apply() the same way:",
        f"    {os.path.abspath(backport.__file__)}",
    ]
    if backport._is_untested(str(version)):
        lines += [
            "",
            f"On torch {version} apply() warns UntestedTorchWarning once when it patches.",
        ]
    return "\n".join(lines), 0


def _parser() -> argparse.ArgumentParser:
    description, _, exit_status = (__doc__ or "").partition("\nExit status:\n")
    return argparse.ArgumentParser(
        prog="python -m backport",
        description=description,
        epilog=f"exit status:\n{exit_status}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> int:
    # Parsed before torch is imported, so --help and usage errors answer at once.
    _parser().parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        _progress(
            f"this Python ({sys.executable}) has no torch: install it first with "
            f"{backport._install_command()} (for a CPU-only or a specific CUDA/ROCm build, add "
            "the index URL that pytorch.org gives), then run python -m backport again"
        )
        return NO_VERDICT
    _progress(
        f"starting {WORLD_SIZE} CPU processes (gloo) for the check (backport "
        f"{backport.__version__}), under a minute..."
    )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        result = _run_check()
    except ChildFailedError as err:
        _progress(f"the check could not run:\n{err}")
        return NO_VERDICT
    text, status = _report(result)
    print(text, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
