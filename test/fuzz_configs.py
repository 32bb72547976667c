"""Seeded random configurations for the differential check (``fuzz_differential.py``).

A configuration is plain data (dicts, lists, strings, numbers), fully determined
by ``(seed, index)`` through ``random.Random(f"{seed}:{index}")``: every rank
draws the same one, and a failing one is rebuilt alone from its seed and index.
One function per dimension: the model's shape, the wrapping, the optimizers and
the events. Nothing here imports torch; ``fuzz_differential.py`` builds and runs
what these describe.
"""

from __future__ import annotations

import random
from typing import Any

from fuzz_surface import draw_surface


__all__ = ["Config", "make_config", "module_paths"]

Config = dict[str, Any]

# The six public calls of torch.distributed.checkpoint.state_dict.
GET_CALLS = ("get_model", "get_optim", "get_state")
SET_CALLS = ("set_model", "set_optim", "set_state")
# set_x loads what get_x returned earlier in the run.
SNAPSHOT_OF = {"set_model": "get_model", "set_optim": "get_optim", "set_state": "get_state"}
OPTIM_CALLS = ("get_optim", "get_state", "set_optim", "set_state")
# reshard_after_forward of a group: None (the default), a bool, or an int that
# divides the shard dimension ("int" here; the runner picks the divisor).
RESHARD_CHOICES = (None, True, False, "int")


def model_shape(rng: random.Random) -> dict[str, Any]:
    """Input layer, block container, adapters, tied, frozen, buffers, root parameter."""
    input_layer = rng.choice(["embedding", "embedding", "projection"])
    container = rng.choice(["list", "sequential", "dict", "stages"])
    n_blocks = rng.randint(1, 3) if container != "stages" else rng.randint(2, 4)
    tied = input_layer == "embedding" and rng.random() < 0.35
    lora = rng.random() < 0.25
    frozen = sorted(
        name
        for name in ("input", "block0.lin1", "norm")
        if rng.random() < 0.15
    )
    return {
        "input": input_layer,
        "container": container,
        "n_blocks": n_blocks,
        "tied": tied,
        "lora": lora,
        "frozen": frozen,
        "buffers": rng.random() < 0.4,
        "root_param": rng.random() < 0.3,
        # Where a forward can be aborted by an exception: after this block
        # (-1: before the first one).
        "tripwire_after": rng.randint(-1, n_blocks - 1),
    }


def module_paths(shape: dict[str, Any]) -> dict[str, Any]:
    """FQNs of the modules a configuration may wrap or call on."""
    n = shape["n_blocks"]
    if shape["container"] == "dict":
        blocks = [f"blocks.b{i}" for i in range(n)]
    elif shape["container"] == "stages":
        first = (n + 1) // 2
        blocks = [f"stages.0.blocks.{i}" for i in range(first)]
        blocks += [f"stages.1.blocks.{i}" for i in range(n - first)]
    else:
        blocks = [f"blocks.{i}" for i in range(n)]
    stages = ["stages.0", "stages.1"] if shape["container"] == "stages" else []
    input_layer = "embed" if shape["input"] == "embedding" else "proj"
    return {"input": input_layer, "blocks": blocks, "stages": stages}


def _reshard(rng: random.Random) -> Any:
    return rng.choice(RESHARD_CHOICES)


def wrapping(rng: random.Random, shape: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Which modules get fully_shard (alone or grouped) or replicate, on which mesh."""
    paths = module_paths(shape)
    if world_size == 2:
        meshes = [[2], [2], [2], [1, 2], [2, 1]]
    elif world_size == 4:
        meshes = [[4], [4], [2, 2], [1, 4], [4, 1]]
    else:
        meshes = [[world_size]]
    mesh = rng.choice(meshes)
    if rng.random() < 0.1:
        # replicate() on every block and the root, as in DDP-style training
        # through FSDP2's machinery (needs a 1-D mesh).
        groups = [{"kind": "replicate", "modules": [path]} for path in paths["blocks"]]
        return {
            "mesh": [world_size],
            "mixed_precision": False,
            "offload": False,
            "groups": groups,
            "root": {"kind": "replicate", "reshard": None},
        }
    # A plain root: each top-level FSDP module is a root of its own, which a
    # group of several modules cannot be ("FSDP requires a single root module").
    root = rng.choice(["fully_shard"] * 6 + ["plain"])
    groups: list[dict[str, Any]] = []
    taken: set[str] = set()

    def add(modules: list[str]) -> None:
        groups.append({"kind": "fully_shard", "modules": modules, "reshard": _reshard(rng)})
        taken.update(modules)

    for path in paths["blocks"]:
        if rng.random() < 0.75:
            add([path])
    for path in paths["stages"]:
        if rng.random() < 0.5:
            add([path])
    # Tied weights stay in one group: the root's, or a group of both.
    grouped = [["norm", "head"], ["blocks-pair"]]
    if shape["input"] == "embedding":
        grouped.append(["embed", "head"])
        if not shape["tied"]:
            grouped.append(["embed", "norm"])
    if shape["tied"]:
        grouped = [g for g in grouped if "head" not in g or "embed" in g]
    if root != "plain" and rng.random() < 0.4:
        choice = rng.choice(grouped)
        if choice == ["blocks-pair"]:
            free = [p for p in paths["blocks"] if p not in taken]
            if len(free) >= 2:
                add(rng.sample(free, 2))
        else:
            add(choice)
    singles = [paths["input"], "head"] if not shape["tied"] else []
    for path in singles:
        if path not in taken and rng.random() < 0.15:
            add([path])
    # The root's default (None: not resharded after forward) is what most
    # training scripts use.
    root_reshard = rng.choice([None, None, False, True, "int"])
    return {
        "mesh": mesh,
        # A plain module after a bf16 FSDP module gets bf16 inputs: mixed
        # precision needs an FSDP root.
        "mixed_precision": root != "plain" and rng.random() < 0.25,
        "offload": rng.random() < 0.15,
        "groups": groups,
        "root": {"kind": root, "reshard": root_reshard if root == "fully_shard" else None},
    }


def tensor_parallel(
    rng: random.Random, shape: dict[str, Any], wrap: dict[str, Any], world_size: int
) -> dict[str, Any] | None:
    """Tensor parallelism over a last mesh dimension, or None.

    Colwise/rowwise on every block's two linears and, with sequence
    parallelism, rowwise on the embedding, SP on the norm and colwise on the
    head, as torchtitan plans. Drawn from a stream of its own: a configuration
    keeps its other dimensions whether it gets TP or not. FSDP2 shards over the
    mesh's other dimensions, which ``wrap["mesh"]`` then names.
    """
    if wrap["root"]["kind"] == "replicate" or rng.random() >= 0.3:
        return None
    degree = rng.choice([d for d in (1, 2, 4) if world_size % d == 0])
    # SP shards the sequence (6 tokens) and gives the head a DTensor input:
    # no tied head, no adapter reading the norm's output.
    sequence_parallel = (
        shape["input"] == "embedding"
        and not shape["tied"]
        and not shape["lora"]
        and 6 % degree == 0
        and rng.random() < 0.5
    )
    dp = world_size // degree
    if len(wrap["mesh"]) == 2 and dp % 2 == 0:
        wrap["mesh"] = [2, dp // 2]  # HSDP + TP: a 3-D mesh
    else:
        wrap["mesh"] = [dp]
    return {"degree": degree, "sequence_parallel": sequence_parallel}


def optimizers(rng: random.Random, shape: dict[str, Any]) -> dict[str, Any]:
    """One or two optimizers (the second owns the head), kinds, param groups, build time."""
    split = rng.random() < 0.35
    specs = []
    for owner in (["rest", "head"] if split else ["all"]):
        kind = rng.choice(["sgd", "sgd_momentum", "adam", "adamw"])
        specs.append({"owns": owner, "kind": kind, "param_groups": rng.choice([1, 1, 2])})
    return {
        "optims": specs,
        # after_shard: right after fully_shard; after_step: after a forward
        # and backward; after_eval: after an evaluation forward (the optimizer
        # then holds FSDP2's unsharded parameters).
        "built": rng.choice(["after_shard"] * 4 + ["after_step", "after_eval"]),
    }


def _options(rng: random.Random, call: str) -> dict[str, bool]:
    options = {}
    if rng.random() < 0.3:
        options["full_state_dict"] = True
        if rng.random() < 0.4:
            options["cpu_offload"] = True
    elif rng.random() < 0.15:
        options["cpu_offload"] = True
    if call in OPTIM_CALLS and rng.random() < 0.2:
        options["flatten_optimizer_state_dict"] = True
    if rng.random() < 0.15:
        options["ignore_frozen_params"] = True
    if call in SET_CALLS and (rng.random() < 0.3 or options.get("ignore_frozen_params")):
        # A state dict without the frozen parameters loads only non-strictly.
        options["strict"] = False
    return options


def _call_target(
    rng: random.Random, shape: dict[str, Any], optims: dict[str, Any], call: str
) -> tuple[str, list[int]]:
    """The module a call gets (FQN, "" for the root) and the optimizers it gets."""
    n_optims = len(optims["optims"])
    if call in OPTIM_CALLS:
        if n_optims == 2 and rng.random() < 0.35:
            # The head's own optimizer with the head: with tied weights, the
            # secondary module of the embedding's weight.
            return "head", [1]
        if n_optims == 2 and rng.random() < 0.3:
            return "", [rng.randrange(2)]
        return "", list(range(n_optims))
    if rng.random() < 0.3:
        paths = module_paths(shape)
        candidates = ["head", "norm", paths["input"], *paths["blocks"], *paths["stages"]]
        candidates.append(paths["blocks"][0] + ".lin1")
        return rng.choice(candidates), []
    return "", []


def events(
    rng: random.Random, shape: dict[str, Any], wrap: dict[str, Any], optims: dict[str, Any]
) -> list[dict[str, Any]]:
    """Training, evaluations, unshard(), an aborted forward and the state-dict calls."""
    out: list[dict[str, Any]] = []
    if optims["built"] == "after_step":
        out.append({"do": "train"})
    elif optims["built"] == "after_eval":
        out.append({"do": "train"})
        out.append({"do": "eval", "mode": rng.choice(["no_grad"] * 3 + ["inference_mode"])})
    out.append({"do": "build_optims"})
    n_groups = len(wrap["groups"]) + (wrap["root"]["kind"] != "plain")

    def unshard() -> dict[str, Any]:
        # hold: keep the group's first parameter as the module exposes it now,
        # as code that reads weights after unshard() does.
        return {"do": "unshard", "group": rng.randrange(n_groups), "hold": rng.random() < 0.4}

    def filler() -> dict[str, Any]:
        kind = rng.choice(["train", "train", "eval", "unshard", "abort"])
        if kind == "eval":
            return {"do": "eval", "mode": rng.choice(["no_grad"] * 3 + ["inference_mode"])}
        if kind == "unshard" and n_groups:
            return unshard()
        if kind == "abort":
            return {
                "do": "abort",
                "grad": rng.random() < 0.5,
                "reset": rng.random() < 0.8,
            }
        return {"do": "train"}

    def call_event(optim_bias: bool = False) -> list[dict[str, Any]]:
        # The optimizer calls are where stock torch fails after an evaluation.
        call = rng.choice(OPTIM_CALLS if optim_bias and rng.random() < 0.6 else GET_CALLS + SET_CALLS)
        target, optim_ids = _call_target(rng, shape, optims, call)
        event = {
            "do": "call",
            "call": call,
            "target": target,
            "optims": optim_ids,
            "options": _options(rng, call),
        }
        options = event["options"]
        if (
            call == "get_optim"
            and not options.get("full_state_dict")
            and not options.get("cpu_offload")
            and rng.random() < 0.1
        ):
            # On rank 0 alone, as a rank-0-only checkpoint hook might: no
            # collective on stock torch, but the fix's reshard is rank-local.
            event["ranks"] = "first"
        if call not in SET_CALLS:
            return [event]
        snapshot = dict(event, call=SNAPSHOT_OF[call], snapshot=True)
        between = [filler() for _ in range(rng.randint(0, 2))]
        return [snapshot, *between, event]

    out.extend(filler() for _ in range(rng.randint(0, 2)))
    # The bug needs a forward without backward (or unshard()) right before the call.
    before = rng.random()
    if before < 0.7:
        out.append({"do": "eval", "mode": rng.choice(["no_grad"] * 3 + ["inference_mode"])})
    elif before < 0.8 and n_groups:
        out.append(unshard())
    else:
        before = 1.0
    first = call_event(optim_bias=True)
    if before < 1.0 and len(first) > 1:
        # The snapshot of a set call goes before the evaluation.
        out[-1:-1] = [first[0]]
        first = first[1:]
    out.extend(first)
    if rng.random() < 0.6:
        out.append({"do": "train"})
        out.extend(filler() for _ in range(rng.randint(0, 2)))
        out.extend(call_event())
    out.append({"do": "train"})
    return out


def make_config(seed: int, index: int, world_size: int, surface: bool = True) -> Config:
    """The configuration ``index`` of ``seed`` for ``world_size`` ranks.

    ``surface=False``: without the axes of ``fuzz_surface.py``, as the long runs
    before them drew it.
    """
    rng = random.Random(f"{seed}:{index}")
    shape = model_shape(rng)
    wrap = wrapping(rng, shape, world_size)
    wrap["tp"] = tensor_parallel(random.Random(f"{seed}:{index}:tp"), shape, wrap, world_size)
    optim = optimizers(rng, shape)
    config = {
        "seed": seed,
        "index": index,
        "world_size": world_size,
        "model": shape,
        "wrapping": wrap,
        "optimizers": optim,
        "events": events(rng, shape, wrap, optim),
    }
    if surface:
        draw_surface(config)
    return config
