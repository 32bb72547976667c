"""Randomized differential check of ``backport.apply()`` on real ranks.

Each configuration of ``fuzz_configs.py`` runs three times on every rank, from
the same seeded initial state:

- ``stock``: torch as installed;
- ``reference``: torch as installed, with every FSDP2 module of the whole model
  resharded (``FSDPModule.reshard()``) right before each state-dict call;
- ``fix``: after ``backport.apply()`` (``revert()`` after it).

Every outcome is recorded: each loss, each evaluation's output, each returned
state dict leaf by leaf (the rank's local shard, its type, placements, dtype,
shape and a SHA-256 of its bytes), each exception's type and first line, and at
the end every parameter and optimizer state. Where stock works, the fix must
give exactly stock's outcome; where stock fails (raises, dies or hangs) and the
reference works, the fix must give exactly the reference's outcome; where both
fail, the fix must give one of theirs. Only the documented changes of the
backport (``RULES``) are accepted otherwise, each as a narrow named rule.

    python test/fuzz_differential.py --seeds 0-3 --n 20       # 4 x 20 configurations
    python test/fuzz_differential.py --repro 2:7               # a standalone script for one
    python test/fuzz_differential.py --seeds 0 --n 20 --broken skip_apply   # negative control

A configuration that kills or hangs a rank ends its world: the ranks log every
finished run to a file, and the batch goes on in a fresh world after the run
that died, recorded as ``died`` (or ``hang``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from typing import Any


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuzz_configs import Config, make_config, module_paths


MODES = ("stock", "reference", "fix")
# Deliberately broken fixes, to show the check fails without the real one.
BROKEN_FIXES = ("skip_apply", "only_passed_module")
VOCAB, DIM = 16, 8
# Short collectives' timeout: a desynchronized rank fails in seconds, not 90.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)
# Where a rank writes what it finished; the parent reads it after a death.
_LOG_NAME = "rank{rank}.jsonl"


# ---------------------------------------------------------------- the model


def _build_model(shape: dict[str, Any]):
    """The ``nn.Module`` that ``shape`` (fuzz_configs.model_shape) describes."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Abort(Exception):
        """Raised by an armed tripwire: a forward aborted by an exception."""

    class Tripwire(nn.Module):
        """A plain module that raises in forward while armed."""

        def __init__(self) -> None:
            super().__init__()
            self.armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed:
                raise Abort("forward aborted on purpose")
            return x

    class Block(nn.Module):
        def __init__(self, idx: int) -> None:
            super().__init__()
            self.lin1 = nn.Linear(DIM, DIM)
            self.lin2 = nn.Linear(DIM, DIM)
            if shape["buffers"]:
                self.register_buffer("scale", torch.full((DIM,), 1.0 + 0.125 * idx))
                self.register_buffer("calls", torch.zeros(()), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x + self.lin2(F.relu(self.lin1(x)))
            if shape["buffers"]:
                if self.training:
                    self.calls += 1
                # Buffers keep float32 under mixed precision.
                out = out * self.scale.to(out.dtype)
            return out

    class Stage(nn.Module):
        def __init__(self, blocks: list[nn.Module]) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(blocks)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    class FuzzModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if shape["input"] == "embedding":
                self.embed = nn.Embedding(VOCAB, DIM)
            else:
                self.proj = nn.Linear(VOCAB, DIM)
            blocks = [Block(i) for i in range(shape["n_blocks"])]
            container = shape["container"]
            if container == "list":
                self.blocks = nn.ModuleList(blocks)
            elif container == "sequential":
                self.blocks = nn.Sequential(*blocks)
            elif container == "dict":
                self.blocks = nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
            else:
                first = (len(blocks) + 1) // 2
                self.stages = nn.ModuleList([Stage(blocks[:first]), Stage(blocks[first:])])
            self.tripwire = Tripwire()
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            if shape["tied"]:
                self.head.weight = self.embed.weight
            if shape["lora"]:
                self.lora_a = nn.Linear(DIM, 2, bias=False)
                self.lora_b = nn.Linear(2, VOCAB, bias=False)
            if shape["root_param"]:
                self.out_bias = nn.Parameter(torch.linspace(-0.5, 0.5, VOCAB))

        def _blocks(self) -> list[nn.Module]:
            if shape["container"] == "dict":
                return list(self.blocks.values())
            return list(self.blocks)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            if shape["input"] == "embedding":
                h = self.embed(tokens)
            else:
                # The input dtype FSDP2's mixed precision would cast a float input to.
                h = self.proj(F.one_hot(tokens, VOCAB).to(self.proj.weight.dtype))
            if shape["tripwire_after"] == -1:
                h = self.tripwire(h)
            if shape["container"] == "sequential":
                h = self._sequential(h)
            elif shape["container"] == "stages":
                h = self.stages[0](h)
                if shape["tripwire_after"] >= 0:
                    h = self.tripwire(h)
                h = self.stages[1](h)
            else:
                for idx, module in enumerate(self._blocks()):
                    h = module(h)
                    if idx == shape["tripwire_after"]:
                        h = self.tripwire(h)
            h = self.norm(h)
            logits = self.head(h)
            if shape["lora"]:
                logits = logits + self.lora_b(self.lora_a(h))
            if shape["root_param"]:
                logits = logits + self.out_bias
            return logits

        def _sequential(self, h: torch.Tensor) -> torch.Tensor:
            for idx, block in enumerate(self.blocks):
                h = block(h)
                if idx == shape["tripwire_after"]:
                    h = self.tripwire(h)
            return h

    model = FuzzModel()
    frozen = {
        "input": model.embed if shape["input"] == "embedding" else model.proj,
        "norm": model.norm,
    }
    for name in shape["frozen"]:
        module = frozen.get(name)
        if module is None:  # "block0.lin1"
            module = model.get_submodule(module_paths(shape)["blocks"][0] + ".lin1")
        module.requires_grad_(False)
    if shape["lora"]:
        # The adapter trains; the base head is frozen, as LoRA does.
        model.head.requires_grad_(False)
    return model, Abort


def _mesh(shape: list[int], tp: int = 0):
    """The FSDP mesh of ``shape`` (and a TP dimension of ``tp`` ranks), cached.

    Each new mesh makes process groups. Returns (FSDP mesh, TP mesh or None).
    """
    from torch.distributed.device_mesh import init_device_mesh

    key = (*shape, tp)
    if key not in _MESHES:
        names = ("dp",) if len(shape) == 1 else ("replicate", "shard")
        full_shape, full_names = tuple(shape), names
        if tp:
            full_shape, full_names = (*shape, tp), (*names, "tp")
        mesh = init_device_mesh("cpu", full_shape, mesh_dim_names=full_names)
        for dim in range(len(full_shape)):
            _set_timeout(mesh.get_group(dim))
        _MESHES[key] = (mesh[names], mesh["tp"]) if tp else (mesh, None)
    return _MESHES[key]


_MESHES: dict[tuple[int, ...], tuple[Any, Any]] = {}


def _set_timeout(group=None) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    set_timeout = getattr(dist, "set_timeout", None)
    if set_timeout is None:
        set_timeout = distributed_c10d._set_pg_timeout
    set_timeout(COLLECTIVE_TIMEOUT, group)


def _reshard_int(mesh_shape: list[int]) -> int:
    # An int must divide the shard group size; a real smaller one where there is.
    shard = mesh_shape[-1]
    return 2 if shard > 2 and shard % 2 == 0 else 1


def _wrap(model, wrap: dict[str, Any]) -> list[Any]:
    """Apply fully_shard / replicate as ``wrap`` says; return each group's first module."""
    import torch
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    tp = wrap.get("tp")
    mesh, tp_mesh = _mesh(wrap["mesh"], tp["degree"] if tp else 0)
    if tp:
        _tensor_parallelize(model, tp_mesh, tp["sequence_parallel"])
    kwargs: dict[str, Any] = {"mesh": mesh}
    if wrap["mixed_precision"]:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if wrap["offload"]:
        # Pinned memory needs an accelerator.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)

    def reshard(value):
        return _reshard_int(wrap["mesh"]) if value == "int" else value

    firsts = []
    for group in wrap["groups"]:
        modules = [model.get_submodule(path) for path in group["modules"]]
        if group["kind"] == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(modules[0], mesh=mesh)
        else:
            target = modules[0] if len(modules) == 1 else modules
            fully_shard(target, reshard_after_forward=reshard(group["reshard"]), **kwargs)
        firsts.append(modules[0])
    root = wrap["root"]
    if root["kind"] == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=mesh)
        firsts.append(model)
    elif root["kind"] == "fully_shard":
        fully_shard(model, reshard_after_forward=reshard(root["reshard"]), **kwargs)
        firsts.append(model)
    return firsts


def _tensor_parallelize(model, tp_mesh, sequence_parallel: bool) -> None:
    """fuzz_configs.tensor_parallel's plan, applied before fully_shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    layout = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    if sequence_parallel:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=layout)
        plan["norm"] = SequenceParallel()
        plan["head"] = ColwiseParallel(input_layouts=layout, output_layouts=Replicate())
    for path, module in model.named_modules():
        if type(module).__name__ == "Block":
            plan[f"{path}.lin1"] = ColwiseParallel(input_layouts=layout)
            plan[f"{path}.lin2"] = RowwiseParallel(output_layouts=layout)
    parallelize_module(model, tp_mesh, plan)


def _build_optims(model, spec: dict[str, Any]) -> list[Any]:
    import torch

    head_params = {id(p) for p in model.head.parameters()}
    if hasattr(model, "lora_a"):
        head_params |= {id(p) for p in (*model.lora_a.parameters(), *model.lora_b.parameters())}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optims = []
    for idx, optim in enumerate(spec["optims"]):
        if optim["owns"] == "all":
            params = trainable
        elif optim["owns"] == "head":
            params = [p for p in trainable if id(p) in head_params]
        else:
            params = [p for p in trainable if id(p) not in head_params]
        if not params:
            # An optimizer needs a parameter; a frozen head leaves the adapter
            # out of it, so give it the norm's.
            params = [p for p in model.norm.parameters()]
        lr = 1e-2 * (idx + 1)
        if optim["param_groups"] == 2 and len(params) > 1:
            groups = [{"params": params[0::2]}, {"params": params[1::2], "lr": lr / 2}]
        else:
            groups = [{"params": params}]
        kind = optim["kind"]
        if kind == "sgd":
            optims.append(torch.optim.SGD(groups, lr=lr))
        elif kind == "sgd_momentum":
            optims.append(torch.optim.SGD(groups, lr=lr, momentum=0.9))
        elif kind == "adam":
            optims.append(torch.optim.Adam(groups, lr=lr))
        else:
            optims.append(torch.optim.AdamW(groups, lr=lr))
    return optims


def _batch(step: int):
    import torch

    # Same data on every rank.
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=gen)
    return tokens, torch.roll(tokens, 1, dims=1)


# ---------------------------------------------------------------- recording


def _digest_tensor(tensor) -> str:
    import torch
    from torch.distributed.tensor import DTensor

    kind = type(tensor).__name__
    layout = ""
    if isinstance(tensor, DTensor):
        layout = "(" + ",".join(str(p) for p in tensor.placements) + ")"
        local = tensor.to_local()
    else:
        local = tensor
    if local.layout != torch.strided:
        return f"{kind}{layout} {local.layout}"
    # A copy: numpy() on a view would make the tensor's storage non-resizable,
    # and FSDP2 resizes its unsharded parameters' storage.
    data = local.detach().cpu().clone().reshape(-1).view(torch.uint8)
    sha = hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]
    return f"{kind}{layout} {local.dtype} {list(tensor.shape)} local{list(local.shape)} {sha}"


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Every leaf of a state dict as (path, digest), in order."""
    import torch

    if isinstance(tree, dict):
        out = []
        for key, value in tree.items():
            out += _leaves(value, f"{prefix}/{key}")
        return out
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        out = []
        for idx, value in enumerate(tree):
            out += _leaves(value, f"{prefix}[{idx}]")
        return out
    if isinstance(tree, torch.Tensor):
        return [(prefix, _digest_tensor(tree))]
    return [(prefix, repr(tree))]


def _describe_error(err: BaseException) -> str:
    """Type and first line, with tensor printouts and addresses scrubbed."""
    import torch

    if isinstance(err, KeyError) and err.args and isinstance(err.args[0], torch.Tensor):
        return f"{type(err).__name__}: <{type(err.args[0]).__name__}>"
    text = str(err).split("\n")[0]
    text = re.sub(r"0x[0-9a-f]+", "0x?", text)
    return f"{type(err).__name__}: {text}"


def _collective_failure(err: BaseException) -> bool:
    """A timed-out or broken collective: the world cannot go on."""
    text = str(err)
    return "gloo" in text.lower() or "timed out" in text.lower() or "Connection closed" in text


def _clone(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


# ---------------------------------------------------------------- one run


def _reshard_all(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def _mode_installed(mode: str, broken: str | None):
    """Install what ``mode`` runs under: nothing, or the fix (or a broken fix)."""
    import torch.distributed.checkpoint.state_dict as dsd

    import backport

    if mode != "fix" or broken == "skip_apply":
        yield
        return
    if broken == "only_passed_module":
        from torch.distributed.fsdp import FSDPModule

        original = dsd._verify_options

        def verify_options(model, *args, **kwargs):
            if isinstance(model, FSDPModule):
                model.reshard()
            return original(model, *args, **kwargs)

        dsd._verify_options = verify_options
        try:
            yield
        finally:
            dsd._verify_options = original
        return
    backport.apply()
    try:
        yield
    finally:
        backport.revert()


def _call(model, optims, event: dict[str, Any], snapshots: dict[str, Any]):
    """One of the six DSD calls, as ``event`` says; returns what to record."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as dsd

    target = model.get_submodule(event["target"]) if event["target"] else model
    chosen = [optims[idx] for idx in event["optims"]]
    options = dsd.StateDictOptions(**event["options"])
    call = event["call"]
    if call == "get_model":
        result = dsd.get_model_state_dict(target, options=options)
    elif call == "get_optim":
        result = dsd.get_optimizer_state_dict(target, chosen, options=options)
    elif call == "get_state":
        result = dsd.get_state_dict(target, chosen, options=options)
    if call.startswith("get_"):
        if event.get("snapshot"):
            snapshots[call] = _clone(result)
        return _leaves(result)
    snapshot = snapshots[call.replace("set_", "get_")]
    if options.full_state_dict and options.cpu_offload:
        # Rank 0 alone holds the full state dict: every rank passes rank 0's,
        # loaded by broadcast.
        holder = [snapshot]
        dist.broadcast_object_list(holder, src=0)
        snapshot = holder[0]
        options = dataclasses.replace(options, broadcast_from_rank0=True)
    snapshot = _clone(snapshot)
    if call == "set_model":
        result = dsd.set_model_state_dict(target, snapshot, options=options)
    elif call == "set_optim":
        result = dsd.set_optimizer_state_dict(target, chosen, snapshot, options=options)
    else:
        model_sd, optim_sd = snapshot
        result = dsd.set_state_dict(
            target, chosen, model_state_dict=model_sd, optim_state_dict=optim_sd,
            options=options,
        )
    return [("returned", repr(result))]


def _call_on_ranks(model, optims, event, snapshots, reshard_first: bool):
    """The call on every rank, or on rank 0 alone; the reference reshards first."""
    import torch.distributed as dist

    if event.get("ranks") != "first":
        if reshard_first:
            _reshard_all(model)
        return _call(model, optims, event, snapshots)
    result: Any = [("skipped", "called on rank 0 only")]
    error: Exception | None = None
    if dist.get_rank() == 0:
        if reshard_first:
            _reshard_all(model)
        try:
            result = _call(model, optims, event, snapshots)
        except Exception as err:  # every rank learns of it below
            if _collective_failure(err):
                raise
            error = err
    # Every rank raises where rank 0 raised, so none runs ahead into a collective.
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else _describe_error(error))
    if error is not None:
        raise error
    if errors[0] is not None:
        raise RuntimeError(f"rank 0 raised {errors[0]}")
    return result


def _held_state(held: list[tuple[str, Any]]) -> list[list[Any]]:
    """Each held tensor's storage size and, where it has storage, its digest."""
    from torch.distributed.tensor import DTensor

    out = []
    for label, tensor in held:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        nbytes = local.untyped_storage().nbytes()
        out.append([label, nbytes, _digest_tensor(tensor) if nbytes else ""])
    return out


def _final_state(model, optims) -> list[tuple[str, str]]:
    """Every parameter's local shard and every optimizer state, sharded first."""
    import torch

    _reshard_all(model)
    out = []
    for name, param in model.named_parameters():
        out.append((f"param/{name}", _digest_tensor(param)))
    for name, buf in model.named_buffers():
        out.append((f"buffer/{name}", _digest_tensor(buf)))
    for o_idx, optim in enumerate(optims):
        for g_idx, group in enumerate(optim.param_groups):
            for p_idx, param in enumerate(group["params"]):
                for key, value in sorted(optim.state.get(param, {}).items()):
                    path = f"optim{o_idx}/{g_idx}/{p_idx}/{key}"
                    digest = _digest_tensor(value) if isinstance(value, torch.Tensor) else repr(value)
                    out.append((path, digest))
    return out


def run_mode(
    config: Config, mode: str, broken: str | None = None, progress=lambda idx: None
) -> dict[str, Any]:
    """Build the configuration's model and run its events under ``mode``.

    Returns {"status": "ok" | "raised", "records": [[event, what, detail], ...]}.
    A failed collective is raised: the world cannot go on.
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(config["seed"] * 1000 + config["index"])
    model, abort_type = _build_model(config["model"])
    records: list[list[Any]] = []
    status = "ok"
    optims: list[Any] = []
    snapshots: dict[str, Any] = {}
    # Parameters taken from the model after unshard(), kept across calls.
    held: list[tuple[str, Any]] = []
    step = 0
    idx = -1
    with _mode_installed(mode, broken):
        try:
            group_modules = _wrap(model, config["wrapping"])
            for idx, event in enumerate(config["events"]):
                progress(idx)
                kind = event["do"]
                if kind == "build_optims":
                    optims = _build_optims(model, config["optimizers"])
                    records.append([idx, kind, len(optims)])
                elif kind == "train":
                    tokens, targets = _batch(step)
                    step += 1
                    loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
                    loss.backward()
                    for optim in optims:
                        optim.step()
                        optim.zero_grad()
                    if not optims:
                        # No optimizer yet: gradients left on the parameters
                        # would make DSD skip initializing its state.
                        model.zero_grad(set_to_none=True)
                    records.append([idx, kind, loss.item().hex()])
                elif kind == "eval":
                    context = torch.inference_mode if event["mode"] == "inference_mode" else torch.no_grad
                    model.eval()
                    with context():
                        out = model(_batch(-1)[0])
                    model.train()
                    records.append([idx, kind, _digest_tensor(out)])
                elif kind == "unshard":
                    module = group_modules[event["group"] % len(group_modules)]
                    module.unshard()
                    if event.get("hold"):
                        name, param = next(iter(module.named_parameters()), ("", None))
                        if param is not None:
                            held.append((f"{event['group']}:{name}", param))
                    records.append([idx, kind, "ok"])
                elif kind == "abort":
                    records.append([idx, kind, _abort(model, event, abort_type)])
                elif kind == "call":
                    records.append([idx, event["call"], _call_on_ranks(
                        model, optims, event, snapshots, reshard_first=mode == "reference"
                    )])
                    if held:
                        records.append([idx, "held", _held_state(held)])
                else:
                    raise AssertionError(f"Expected an event kind, got {kind!r}")
            idx = len(config["events"])
            records.append([idx, "final", _final_state(model, optims)])
        except abort_type as err:  # an armed tripwire left armed: a runner bug
            raise AssertionError("tripwire left armed") from err
        except Exception as err:
            if _collective_failure(err):
                raise
            status = "raised"
            records.append([idx, "raised", _describe_error(err)])
    del model, optims, snapshots, held
    gc.collect()
    return {"status": status, "records": records}


def _abort(model, event: dict[str, Any], abort_type) -> str:
    """A forward that an exception aborts, then FSDP2's documented recovery."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    model.tripwire.armed = True
    try:
        with torch.enable_grad() if event["grad"] else torch.no_grad():
            model(_batch(-2)[0])
    except abort_type:
        outcome = "aborted"
    else:
        raise AssertionError("the armed tripwire did not raise")
    finally:
        model.tripwire.armed = False
    if event["reset"]:
        roots = [
            m for name, m in model.named_modules()
            if isinstance(m, FSDPModule)
            and not any(
                isinstance(parent, FSDPModule)
                for pname, parent in model.named_modules()
                if pname != name and (pname == "" or name.startswith(pname + "."))
            )
        ]
        for root in roots:
            if hasattr(root, "reset_iter_state"):
                root.reset_iter_state()
                outcome += ", reset"
            else:
                outcome += ", no reset_iter_state"
    return outcome


# ---------------------------------------------------------------- ranks


def rank_worker(items: list[list[Any]], log_dir: str, broken: str | None) -> int:
    """Run each (config, mode) of ``items``; log each as it starts and ends."""
    import torch.distributed as dist

    _set_timeout()
    rank = dist.get_rank()
    path = os.path.join(log_dir, _LOG_NAME.format(rank=rank))
    with open(path, "a") as log:
        for config, mode in items:
            seed, index = config["seed"], config["index"]
            log.write(json.dumps({"start": [seed, index, mode]}) + "\n")
            log.flush()
            def progress(idx: int) -> None:
                log.write(json.dumps({"event": idx}) + "\n")
                log.flush()

            outcome = run_mode(config, mode, broken, progress)
            log.write(json.dumps({"done": [seed, index, mode], "outcome": outcome}) + "\n")
            log.flush()
    return len(items)


def _read_logs(log_dir: str, world_size: int) -> tuple[dict, dict]:
    """Finished outcomes by (seed, index, mode, rank), and the event each rank's
    unfinished run had started (-1: before the first)."""
    done: dict[tuple, dict] = {}
    started: dict[int, int] = {}
    for rank in range(world_size):
        path = os.path.join(log_dir, _LOG_NAME.format(rank=rank))
        if not os.path.exists(path):
            continue
        with open(path) as log:
            for line in log:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut by the death
                    continue
                if "start" in entry:
                    started[rank] = -1
                elif "event" in entry:
                    started[rank] = entry["event"]
                else:
                    seed, index, mode = entry["done"]
                    done[(seed, index, mode, rank)] = entry["outcome"]
                    started.pop(rank, None)
    return done, started


def _has_rank_local_call(config: Config) -> bool:
    return any(event.get("ranks") == "first" for event in config["events"])


def run_configs(
    configs: list[Config],
    world_size: int,
    broken: str | None = None,
    per_run_timeout: float = 60.0,
) -> dict[tuple[int, int], dict[str, list[dict]]]:
    """Every mode of each (seed, index) on ``world_size`` ranks, by mode and rank.

    A run that kills or hangs the world is recorded as {"status": "died"} or
    {"status": "hang"} on every rank, and the rest go on in a fresh world.
    """
    from _ranks import RankError, run_ranks

    items = [[config, mode] for config in configs for mode in MODES]
    results: dict[tuple[int, int], dict[str, list[dict]]] = {
        (c["seed"], c["index"]): {mode: [None] * world_size for mode in MODES} for c in configs
    }
    position = 0
    while position < len(items):
        log_dir = tempfile.mkdtemp(prefix="fuzz_ranks_")
        todo = items[position:]
        failure = None
        try:
            run_ranks(world_size, rank_worker, todo, log_dir, broken,
                      timeout=30 + per_run_timeout * len(todo))
        except RankError as err:
            failure = str(err)
        done, started = _read_logs(log_dir, world_size)
        finished = 0
        for config, mode in todo:
            seed, index = config["seed"], config["index"]
            outcomes = [done.get((seed, index, mode, rank)) for rank in range(world_size)]
            if any(o is None for o in outcomes):
                break
            results[(seed, index)][mode] = outcomes
            finished += 1
        position += finished
        if failure is None:
            break
        if position >= len(items):
            # Every run finished; a rank died at exit (upstream/c10d_issue/).
            print(f"every run finished, then: {failure[:300]}", file=sys.stderr)
            break
        if any(_has_rank_local_call(config) for config, _ in todo[:finished]):
            # A call on rank 0 alone can leave a collective pending on the
            # default group, which the next run of this world then matches:
            # the run that failed after it gets a fresh world of its own.
            continue
        # The run after the last one every rank finished ended the world.
        config, mode = items[position]
        seed, index = config["seed"], config["index"]
        died = re.search(r"exit code -\d+|exited with code", failure) is not None
        status = "died" if died else "hang"
        detail = failure.splitlines()[1][:200] if "\n" in failure else failure[:200]
        # A rank that finished this run keeps its outcome.
        results[(seed, index)][mode] = [
            done.get((seed, index, mode, rank))
            or {"status": status, "records": [], "detail": detail, "at_event": started.get(rank)}
            for rank in range(world_size)
        ]
        position += 1
    return results


# ---------------------------------------------------------------- the check


def _failed(outcome: dict) -> bool:
    return outcome["status"] != "ok"


def _first_difference(actual: dict, expected: dict) -> int | None:
    """Index of the first record that differs, or None when identical.

    A run that died left no records: against it, a run's own failure (its last
    record) is where they differ.
    """
    if actual["status"] != expected["status"] and (
        actual["status"] in ("died", "hang") or expected["status"] in ("died", "hang")
    ):
        if actual["status"] == "raised":
            return len(actual["records"]) - 1
        return 0
    a, e = actual["records"], expected["records"]
    for idx in range(max(len(a), len(e))):
        if idx >= len(a) or idx >= len(e) or a[idx] != e[idx]:
            return idx
    return None


def _raised(outcome: dict, idx: int) -> str | None:
    records = outcome["records"]
    if idx < len(records) and records[idx][1] == "raised":
        return records[idx][2]
    return None


def _failing_event(config: Config, outcome: dict, idx: int) -> dict | None:
    """The event of record ``idx``; None for the final state (or wrapping, -1)."""
    records = outcome["records"]
    if idx < len(records) and 0 <= records[idx][0] < len(config["events"]):
        return config["events"][records[idx][0]]
    return None


def _optimizer_built_unsharded(config: Config) -> bool:
    """An evaluation (or unshard()) left groups unsharded when the optimizers were built."""
    for event in config["events"]:
        if event["do"] == "build_optims":
            return False
        if event["do"] in ("eval", "unshard", "abort"):
            return True
    return False


def _rule_optimizer_built_after_eval(config, baseline, fix, idx) -> bool:
    """README, "What changes": an optimizer built while groups were unsharded gets PR A's
    ValueError (or, once stepped and resharded, OptimizerParamNotInModelError)."""
    error = _raised(fix, idx)
    event = _failing_event(config, fix, idx)
    return (
        _optimizer_built_unsharded(config)
        and error is not None
        and event is not None
        and event["do"] == "call"
        and event["call"] in ("get_optim", "get_state", "set_optim", "set_state")
        and (
            "has no allocated storage" in error
            or "is an FSDP2 unsharded parameter" in error
            or error.startswith("OptimizerParamNotInModelError:")
            or "holds a parameter that the model does not own" in error
        )
    )


def _rule_unowned_param_error_type(config, baseline, fix, idx) -> bool:
    """README, "What changes": OptimizerParamNotInModelError (a KeyError) where torch
    raised a bare KeyError for an optimizer parameter outside the model."""
    error, base_error = _raised(fix, idx), _raised(baseline, idx)
    return (
        error is not None
        and base_error is not None
        and base_error.startswith("KeyError")
        and (
            error.startswith("OptimizerParamNotInModelError:")
            or "holds a parameter that the model does not own" in error
        )
    )


def _rule_tied_secondary(config, baseline, fix, idx) -> bool:
    """README, Limits: an optimizer call on the secondary module of tied weights
    (the head sharing the embedding's weight) while the group is unsharded
    cannot be fixed: the backport raises a clear error instead."""
    error = _raised(fix, idx)
    event = _failing_event(config, fix, idx)
    return (
        config["model"]["tied"]
        and error is not None
        and event is not None
        and event["do"] == "call"
        and event["target"] == "head"
        and ("tied" in error.lower() or "shared" in error.lower() or "shares" in error.lower())
    )


def _rule_tied_secondary_model_call(config, baseline, fix, idx) -> bool:
    """README, Limits: a model call on the secondary module of tied weights sees
    the group as FSDP2 left it, as with stock torch: while the group is
    unsharded, get_model_state_dict returns the unsharded parameter (a full
    tensor, in the compute dtype under mixed precision) and loading a sharded
    state dict into it fails."""
    event = _failing_event(config, fix, idx)
    if not (config["model"]["tied"] and event is not None and event["do"] == "call"
            and event["target"] == "head" and event["call"] in ("get_model", "set_model")):
        return False
    error = _raised(fix, idx)
    if error is not None:
        return error.startswith("RuntimeError: Error(s) in loading state_dict for Linear")
    record = fix["records"][idx]
    return record[1] == "get_model" and all(
        not leaf[1].startswith("DTensor") for leaf in record[2] if leaf[0].endswith("weight")
    )


def _group_paths(config: Config) -> list[list[str]]:
    """Each FSDP2 group's module paths, indexed as unshard events count them."""
    wrap = config["wrapping"]
    paths = [list(group["modules"]) for group in wrap["groups"]]
    if wrap["root"]["kind"] != "plain":
        paths.append([""])
    return paths


def _is_under(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _rule_group_outside_target(config, baseline, fix, idx) -> bool:
    """README "What it changes": a call on a submodule reshards the FSDP2 groups
    in it and the group owning its own parameters, not the rest of the model as
    the reference does: a tensor held from unshard() of another group stays
    allocated, as with stock torch."""
    records, base = fix["records"], baseline["records"]
    if idx >= len(records) or idx >= len(base) or records[idx][1] != "held":
        return False
    event = _failing_event(config, fix, idx)
    if event is None or event["do"] != "call" or event["target"] == "":
        return False
    target, paths = event["target"], _group_paths(config)
    owner = max(
        (p for group in paths for p in group if _is_under(target, p)), key=len, default=None
    )
    for got, want in zip(records[idx][2], base[idx][2]):
        if got == want:
            continue
        group = paths[int(got[0].split(":")[0]) % len(paths)]
        if not (got[0] == want[0] and got[1] > 0 and want[1] == 0):
            return False
        if any(_is_under(p, target) or p == owner for p in group):
            return False
    return len(records[idx][2]) == len(base[idx][2])


def _rule_aborted_forward_without_reset(config, baseline, fix, idx) -> bool:
    """backport's docstring, README "What it changes": a forward or backward that
    raised leaves its groups marked as running, and reshard() skips them until
    reset_iter_state() on the root (which 2.10 does not have). Accepted only
    where the baseline fails: FSDP2's state-dict hook, which the backport runs
    for a plain module passed in, reshards such a group all the same, so a
    call on a plain module can work there."""
    return _raised(baseline, idx) is not None and any(
        record[1] == "abort" and not record[2].endswith(", reset")
        for record in fix["records"][:idx]
    )


def _rule_rank_local_reshard(config, baseline, fix, idx) -> bool:
    """README "What it changes": the reshard is rank-local; a call on a subset of
    ranks after a forward without backward fails at the next forward (gloo aborts
    with "collective mismatch"), where stock torch did not."""
    rank_local = [
        at for at, event in enumerate(config["events"]) if event.get("ranks") == "first"
    ]
    if not rank_local:
        return False
    if fix["status"] in ("died", "hang"):
        at_event = fix.get("at_event")
        return at_event is not None and at_event > rank_local[0]
    error = _raised(fix, idx)
    at = fix["records"][idx][0] if idx < len(fix["records"]) else -1
    return error is not None and at > rank_local[0] and "mismatch" in error.lower()


RULES = {
    "optimizer built after an evaluation": _rule_optimizer_built_after_eval,
    "OptimizerParamNotInModelError for a bare KeyError": _rule_unowned_param_error_type,
    "tied secondary module (Limits)": _rule_tied_secondary,
    "tied secondary module, model call (Limits)": _rule_tied_secondary_model_call,
    "a group outside the submodule passed in": _rule_group_outside_target,
    "forward aborted without reset_iter_state()": _rule_aborted_forward_without_reset,
    "rank-local reshard (a call on rank 0 alone)": _rule_rank_local_reshard,
}


def _forgive_freed_held_tensors(fix: dict, baseline: dict) -> tuple[dict, bool]:
    """README "What it changes": a tensor taken from the model after unshard() is
    invalid after any DSD call (its storage is freed). Returns the fix's outcome
    with each "held" record that differs from the baseline's only by freed
    storage replaced by the baseline's, and whether there was one; every other
    record is still compared."""
    records = list(fix["records"])
    forgiven = False
    for pos, (got, want) in enumerate(zip(records, baseline["records"])):
        if got == want or got[1] != "held" or want[1] != "held" or got[0] != want[0]:
            continue
        if len(got[2]) == len(want[2]) and all(
            g == w or (g[0] == w[0] and g[1] == 0 and w[1] > 0)
            for g, w in zip(got[2], want[2])
        ):
            records[pos] = want
            forgiven = True
    return dict(fix, records=records), forgiven


HELD_TENSOR_RULE = "a tensor held from unshard() freed by the call"


def classify(config: Config, outcomes: dict[str, list[dict]]) -> dict[str, Any]:
    """Compare the three modes rank by rank.

    Returns {"kind": "control" | "bug" | "both fail", "verdict": "same" |
    "documented: <rule>" | "divergence", "rank", "at", "detail"}.
    """
    stock, reference, fix = (outcomes[mode] for mode in MODES)
    world_size = len(stock)
    if not any(_failed(o) for o in stock):
        kind, baselines = "control", ["stock"]
    elif not any(_failed(o) for o in reference):
        kind, baselines = "bug", ["reference"]
    else:
        kind, baselines = "both fail", ["reference", "stock"]
    verdicts = []
    for rank in range(world_size):
        best = None
        for name in baselines:
            baseline = outcomes[name][rank]
            fix_rank, forgiven = _forgive_freed_held_tensors(fix[rank], baseline)
            idx = _first_difference(fix_rank, baseline)
            if idx is None:
                best = (f"documented: {HELD_TENSOR_RULE}" if forgiven else "same", name, None, "")
                break
            rule = next(
                (label for label, fn in RULES.items() if fn(config, baseline, fix_rank, idx)),
                None,
            )
            if rule is not None:
                candidate = (f"documented: {rule}", name, idx, "")
            elif fix[rank]["status"] in ("died", "hang"):
                died = f"fix {fix[rank]['status']}: {fix[rank].get('detail', '')}"
                candidate = ("divergence", name, idx, died)
            else:
                got = fix_rank["records"][idx] if idx < len(fix_rank["records"]) else None
                want = baseline["records"][idx] if idx < len(baseline["records"]) else None
                candidate = ("divergence", name, idx,
                             f"fix {_short(got)} != {name} {_short(want)}")
            if best is None or (best[0] == "divergence" and candidate[0] != "divergence"):
                best = candidate
        verdicts.append((rank, *best))
    worst = next((v for v in verdicts if v[1] == "divergence"), None)
    worst = worst or next((v for v in verdicts if v[1] != "same"), verdicts[0])
    rank, verdict, against, at, detail = worst
    return {"kind": kind, "verdict": verdict, "rank": rank, "against": against, "at": at,
            "detail": detail}


def _short(record: Any) -> str:
    text = json.dumps(record)
    return text if len(text) < 400 else text[:400] + "..."


# ---------------------------------------------------------------- reports


def check(
    pairs: list[tuple[int, int]], world_size: int = 2, broken: str | None = None,
    batch: int = 40, out=sys.stdout,
) -> dict[str, Any]:
    """Run and classify configurations (seed, index); print a line per finding and the counts."""
    start = time.monotonic()
    findings = []
    counts: Counter = Counter()
    for first in range(0, len(pairs), batch):
        chunk = pairs[first:first + batch]
        configs = [make_config(seed, index, world_size) for seed, index in chunk]
        results = run_configs(configs, world_size, broken)
        for seed, index in chunk:
            config = make_config(seed, index, world_size)
            verdict = classify(config, results[(seed, index)])
            counts["configurations"] += 1
            counts[f"kind {verdict['kind']}"] += 1
            statuses = {o["status"] for o in results[(seed, index)]["stock"]}
            if statuses & {"died", "hang"}:
                counts["stock died or hung"] += 1
            if verdict["kind"] == "both fail":
                counts[f"reference fails: {_failure_of(results[(seed, index)]['reference'][0])}"] += 1
            if verdict["verdict"] == "divergence":
                counts["divergences"] += 1
                findings.append((seed, index, verdict))
            elif verdict["verdict"].startswith("documented"):
                counts["documented outcomes"] += 1
                counts[verdict["verdict"]] += 1
            if verdict["verdict"] != "same":
                print(f"{seed}:{index} {verdict['kind']}: {verdict['verdict']} "
                      f"(rank {verdict['rank']}, record {verdict['at']} vs "
                      f"{verdict['against']}) {verdict['detail']}", file=out, flush=True)
    elapsed = time.monotonic() - start
    print(render_counts(counts, elapsed, world_size, broken), file=out, flush=True)
    if findings:
        print("reproduce one: python test/fuzz_differential.py --repro "
              f"{findings[0][0]}:{findings[0][1]} --world {world_size} > repro.py", file=out)
    return {"counts": counts, "findings": findings, "seconds": elapsed}


def _failure_of(outcome: dict) -> str:
    if outcome["status"] != "raised":
        return outcome["status"]
    return outcome["records"][-1][2][:90]


def render_counts(counts: Counter, elapsed: float, world_size: int, broken: str | None) -> str:
    lines = [
        f"world size {world_size}" + (f", broken fix {broken!r}" if broken else "")
        + f": {counts['configurations']} configurations in {elapsed:.0f} s",
        f"  stock fails (bug cases, reference works): {counts['kind bug']}",
        f"  stock works (controls): {counts['kind control']}",
        f"  stock died or hung: {counts['stock died or hung']}",
        f"  stock and reference both fail: {counts['kind both fail']}",
        f"  documented outcomes: {counts['documented outcomes']}",
    ]
    lines += [f"    {key}: {value}" for key, value in sorted(counts.items())
              if key.startswith("documented: ")]
    lines += [f"    {key}: {value}" for key, value in sorted(counts.items())
              if key.startswith("reference fails: ")]
    lines.append(f"  divergences: {counts['divergences']}")
    return "\n".join(lines)


_REPRO = '''\
"""Configuration {seed}:{index} of test/fuzz_differential.py, on {world_size} ranks.

Run from the repository root: python this_file.py
Prints each mode's outcome on rank 0 and the verdict. Edit CONFIG to shrink it.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "test"))
sys.path.insert(0, os.getcwd())

import fuzz_differential

CONFIG = {config}


def main() -> None:
    results = fuzz_differential.run_configs([CONFIG], {world_size})
    outcomes = results[(CONFIG["seed"], CONFIG["index"])]
    for mode, by_rank in outcomes.items():
        print(f"--- {{mode}} (rank 0): {{by_rank[0]['status']}}")
        for record in by_rank[0]["records"]:
            print("   ", json.dumps(record)[:300])
    print(fuzz_differential.classify(CONFIG, outcomes))


if __name__ == "__main__":
    main()
'''


def repro_script(seed: int, index: int, world_size: int) -> str:
    """A script that runs configuration ``seed:index`` alone, its config written out."""
    import pprint

    config = make_config(seed, index, world_size)
    return _REPRO.format(
        seed=seed, index=index, world_size=world_size,
        config=pprint.pformat(config, width=100, sort_dicts=False),
    )


def _parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="A-B (inclusive) or A,B,C")
    parser.add_argument("--n", type=int, default=20, help="configurations per seed")
    parser.add_argument("--world", type=int, default=2, help="ranks (2 or 4)")
    parser.add_argument("--batch", type=int, default=40, help="configurations per world of ranks")
    parser.add_argument("--broken", choices=BROKEN_FIXES, help="a deliberately broken fix")
    parser.add_argument("--repro", metavar="SEED:INDEX", help="print a standalone script for one")
    args = parser.parse_args(argv)
    if args.repro:
        seed, index = (int(part) for part in args.repro.split(":"))
        print(repro_script(seed, index, args.world))
        return 0
    pairs = [(seed, index) for seed in _parse_seeds(args.seeds) for index in range(args.n)]
    report = check(pairs, args.world, args.broken, args.batch)
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
