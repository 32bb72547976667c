"""FSDP2's surface in the differential check's configurations (``fuzz_configs.py``).

Each axis is drawn from a stream of its own, ``random.Random(f"{seed}:{index}:{axis}")``,
after the configuration's other dimensions: a configuration keeps what it drew
before whether it gets an axis or not, and adding an axis changes no other
axis's draws. What an axis adds is recorded under ``config["surface"][axis]``
(the runner reads it; the report counts configurations per axis). Nothing here
imports torch: an axis whose switch the running torch lacks is recorded as
unavailable by the runner (``set_keep_unsharded_storage`` is new in 2.15).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


__all__ = ["AXES", "draw_surface"]

Config = dict[str, Any]

OPTIM_CALLS = ("get_optim", "get_state", "set_optim", "set_state")


def _fsdp_groups(config: Config) -> list[int]:
    """Indices (in the runner's group list: groups, then the root) of fully_shard groups."""
    wrap = config["wrapping"]
    out = [idx for idx, group in enumerate(wrap["groups"]) if group["kind"] == "fully_shard"]
    if wrap["root"]["kind"] == "fully_shard":
        out.append(len(wrap["groups"]))
    return out


def _group_switch(probability: float) -> Callable[[random.Random, Config], Any]:
    """A switch of ``FSDPModule`` set on one group, with or without its submodules."""

    def draw(rng: random.Random, config: Config) -> Any:
        groups = _fsdp_groups(config)
        if not groups or rng.random() >= probability:
            return None
        return {"group": rng.choice(groups), "recurse": rng.random() < 0.5}

    return draw


def _gradient_accumulation(rng: random.Random, config: Config) -> Any:
    """A forward and backward with ``set_requires_gradient_sync(False)`` and no step."""
    if not _fsdp_groups(config) or rng.random() >= 0.15:
        return None
    events = config["events"]
    built = next(idx for idx, event in enumerate(events) if event["do"] == "build_optims")
    # Anywhere after the optimizers exist: before a training step (accumulated
    # gradients reduced there) or before a call (the call meets them pending).
    at = rng.randint(built + 1, len(events) - 1)
    events.insert(at, {"do": "accumulate"})
    return {"at": at}


def _async_unshard(rng: random.Random, config: Config) -> Any:
    """``unshard(async_op=True)``, the handle waited on or left to the next forward."""
    unshards = [event for event in config["events"] if event["do"] == "unshard"]
    if not unshards or rng.random() >= 0.5:
        return None
    for event in unshards:
        event["async"] = True
        event["wait"] = rng.random() < 0.5
    return {"unshards": len(unshards)}


def _shard_placement(rng: random.Random, config: Config) -> Any:
    """``shard_placement_fn`` (``Shard(1)`` or the largest dim), with uneven shards of dim 0."""
    if not _fsdp_groups(config) or rng.random() >= 0.15:
        return None
    # An odd hidden size gives the blocks' weights dims no world size divides
    # (not under TP, which would shard them unevenly too).
    odd_hidden = rng.random() < 0.5 and not config["wrapping"].get("tp")
    config["model"]["odd_hidden"] = odd_hidden
    return {"placement": rng.choice(["shard1_matrices", "largest_dim"]), "odd_hidden": odd_hidden}


def _forward_method(rng: random.Random, config: Config) -> Any:
    """Evaluations through a method registered with ``register_fsdp_forward_method``."""
    evals = [event for event in config["events"] if event["do"] == "eval"]
    if config["wrapping"]["root"]["kind"] != "fully_shard" or not evals or rng.random() >= 0.15:
        return None
    for event in evals:
        if rng.random() < 0.7:
            event["method"] = "score"
    return {"method": "score"}


def _remap_optims(config: Config, mapping: dict[int, list[int]]) -> None:
    """Calls keep passing what they passed: an optimizer split in parts passes all parts."""
    for event in config["events"]:
        if "optims" in event:
            event["optims"] = sorted(new for old in event["optims"] for new in mapping[old])


def _optimizers(rng: random.Random, config: Config) -> Any:
    """Other optimizer classes and implementations, Muon with AdamW, three optimizers."""
    spec = config["optimizers"]["optims"]
    if rng.random() >= 0.5:
        return None
    variant = rng.choice(["classes", "classes", "muon_pair", "three"])
    if variant == "muon_pair" and len(spec) == 1:
        # Muon for the blocks' 2-D weights, AdamW for the rest, passed to DSD together.
        config["optimizers"]["optims"] = [
            {"owns": "matrices", "kind": "muon", "param_groups": 1},
            {"owns": "non_matrices", "kind": "adamw", "param_groups": spec[0]["param_groups"]},
        ]
        _remap_optims(config, {0: [0, 1]})
        return {"variant": variant}
    if variant == "three" and len(spec) == 2:
        # The rest's optimizer split in two: the blocks', and the others'.
        rest = spec[0]
        config["optimizers"]["optims"] = [
            dict(rest, owns="rest_blocks"), spec[1], dict(rest, owns="rest_other"),
        ]
        _remap_optims(config, {0: [0, 2], 1: [1]})
        return {"variant": variant}
    for optim in spec:
        optim["kind"] = rng.choice(
            ["adagrad", "rmsprop", "nadam", "radam", optim["kind"], optim["kind"]]
        )
        # foreach (multi-tensor) kernels, or fused ones where DTensor has them.
        fused_ok = optim["kind"] in ("adam", "adamw")
        optim["impl"] = rng.choice(["foreach", "single"] + (["fused"] if fused_ok else []))
    return {"variant": "classes"}


def _mesh_3d(rng: random.Random, config: Config) -> Any:
    """On 4 ranks, HSDP + TP with the shard dim (not the replicate dim) of size 2."""
    wrap = config["wrapping"]
    if not wrap.get("tp") or wrap["mesh"] != [2, 1] or rng.random() >= 0.5:
        return None
    wrap["mesh"] = [1, 2]
    return {"mesh": [*wrap["mesh"], wrap["tp"]["degree"]]}


def _call_context(rng: random.Random, config: Config) -> Any:
    """DSD called inside no_grad, from another thread, or on a submodule with the optimizers."""
    if rng.random() >= 0.3:
        return None
    contexts = []
    for event in config["events"]:
        if event["do"] != "call" or rng.random() >= 0.5:
            continue
        choices = ["no_grad", "thread"]
        if event["call"] in ("get_optim", "get_state") and event["target"] == "" and not event.get(
            "snapshot"
        ):
            choices.append("submodule")
        context = rng.choice(choices)
        if context == "submodule":
            paths = ["norm", "head"]
            event["target"] = rng.choice(paths)
        else:
            event["context"] = context
        contexts.append(context)
    return {"contexts": contexts} if contexts else None


def _float8(rng: random.Random, config: Config) -> Any:
    """torchao float8 training weights on the blocks, with FSDP2's float8 all-gather."""
    wrap = config["wrapping"]
    if (
        wrap.get("tp")
        or wrap["mixed_precision"]
        or wrap["root"]["kind"] == "replicate"
        or not _fsdp_groups(config)
        or rng.random() >= 0.08
    ):
        return None
    return {"all_gather": True}


AXES: dict[str, Callable[[random.Random, Config], Any]] = {
    "reshard_after_backward": _group_switch(0.12),
    "keep_unsharded_storage": _group_switch(0.12),
    "gradient_accumulation": _gradient_accumulation,
    "async_unshard": _async_unshard,
    "shard_placement": _shard_placement,
    "forward_method": _forward_method,
    "optimizers": _optimizers,
    "mesh_3d": _mesh_3d,
    "call_context": _call_context,
    "float8": _float8,
}


def draw_surface(config: Config) -> None:
    """Draw every axis of ``AXES`` for ``config``, each from its own stream."""
    config["surface"] = {}
    for axis, draw in AXES.items():
        rng = random.Random(f"{config['seed']}:{config['index']}:{axis}")
        value = draw(rng, config)
        if value is not None:
            config["surface"][axis] = value
