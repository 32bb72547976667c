"""``python -m backport``: does the installed torch have the bug, and does apply() fix it?

Runs a real FSDP2 job in two CPU processes (gloo): one training step, an
evaluation forward under ``torch.no_grad()``, then the optimizer state is saved
with ``get_optimizer_state_dict`` and loaded back with
``set_optimizer_state_dict``; once on torch as installed, once after
``backport.apply()``.
"""

from __future__ import annotations

import sys
import warnings

import backport
from backport._launch import run_ranks


WORLD_SIZE = 2


def _build():
    import torch
    import torch.distributed as dist
    import torch.nn as nn
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
        outcome["save"] = "ok" if _equal(_snapshot(saved), expected) else "WRONG VALUES"
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
        outcome["load"] = "ok" if _equal(restored, expected) else "WRONG VALUES"
    except Exception as err:  # noqa: BLE001 - reported in the table
        outcome["load"] = _error(err)
    return outcome


def _worker() -> dict[str, object]:
    import torch

    result: dict[str, object] = {"torch": str(torch.__version__)}
    result["status_before"] = backport.status()
    result["without"] = _scenario()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", backport.BackportWarning)
            result["status_after"] = backport.apply()
    except backport.UnsupportedTorchError as err:
        result["status_after"] = f"apply() refused: {err}"
        return result
    result["with"] = _scenario()
    backport.revert()
    return result


def main() -> int:
    print(f"backport {backport.__version__}: running FSDP2 on {WORLD_SIZE} CPU processes (gloo)...")
    result = run_ranks(WORLD_SIZE, _worker)[0]
    without, with_fix = result["without"], result.get("with")
    rows = [
        ("optimizer state saved after no_grad eval", "save"),
        ("optimizer state loaded after no_grad eval", "load"),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"torch {result['torch']}")
    print(f"{'step'.ljust(width)} | {'torch as installed':<38} | with backport.apply()")
    print(f"{'-' * width}-|-{'-' * 38}-|-{'-' * 22}")
    for label, key in rows:
        fixed = with_fix[key] if with_fix else "-"
        print(f"{label.ljust(width)} | {without[key]:<38} | {fixed}")
    affected = any(value != "ok" for value in without.values())
    fixed = with_fix is not None and all(value == "ok" for value in with_fix.values())
    print(f"affected: {'yes' if affected else 'no'}")
    print(f"fixed by backport.apply(): {'yes' if fixed else 'no'}")
    print(f"backport: {result['status_after']}")
    return 0 if fixed or not affected else 1


if __name__ == "__main__":
    sys.exit(main())
