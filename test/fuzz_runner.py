"""The runner of the differential check (``fuzz_differential.py``): builds one
configuration of ``fuzz_configs.py``, runs it in each mode on real ranks and
records every outcome; ``run_configs`` starts the worlds of ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn.functional as F
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

import backport
from _fsdp_cases import (
    DIM,
    VOCAB,
    apply_tensor_parallel,
    batch,
    clone,
    describe_error,
    device_meshes,
    flat,
)
from fuzz_configs import Config, module_paths


MODES = ("stock", "reference", "fix")
# Deliberately broken fixes, to show the check fails without the real one.
BROKEN_FIXES = ("skip_apply", "only_passed_module")
# Short collectives' timeout: a desynchronized rank fails in seconds, not 90.
# A configuration that calls DSD on rank 0 alone waits for it (a long run's
# pinned one, 6:22, took 46 s with 30 s, 15 s with 5 s).
COLLECTIVE_TIMEOUT = timedelta(seconds=10)
# Where a rank writes what it finished; the parent reads it after a death.
_LOG_NAME = "rank{rank}.jsonl"


# ---------------------------------------------------------------- the model


def _build_model(shape: dict[str, Any]):
    """The ``nn.Module`` that ``shape`` (fuzz_configs.model_shape) describes."""
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

    # An odd hidden size: dims no world size divides (fuzz_surface's shard_placement).
    hidden = DIM + 1 if shape.get("odd_hidden") else DIM

    class Block(nn.Module):
        def __init__(self, idx: int) -> None:
            super().__init__()
            self.lin1 = nn.Linear(DIM, hidden)
            self.lin2 = nn.Linear(hidden, DIM)
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

        def score(self, tokens: torch.Tensor) -> torch.Tensor:
            """The forward as another method: register_fsdp_forward_method's case."""
            return self.forward(tokens)

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
    key = (*shape, tp)
    if key not in _MESHES:
        mesh, fsdp_mesh, tp_mesh = device_meshes(tuple(shape), tp)
        for dim in range(mesh.ndim):
            _set_timeout(mesh.get_group(dim))
        _MESHES[key] = (fsdp_mesh, tp_mesh)
    return _MESHES[key]


_MESHES: dict[tuple[int, ...], tuple[Any, Any]] = {}


def _set_timeout(group=None) -> None:
    set_timeout = getattr(dist, "set_timeout", None)
    if set_timeout is None:
        set_timeout = distributed_c10d._set_pg_timeout
    set_timeout(COLLECTIVE_TIMEOUT, group)


def _reshard_int(mesh_shape: list[int]) -> int:
    # An int must divide the shard group size; a real smaller one where there is.
    shard = mesh_shape[-1]
    return 2 if shard > 2 and shard % 2 == 0 else 1


def _shard_placement_fn(placement: str, shard_size: int):
    """Shard(1) of each matrix, or each parameter's largest dim.

    FSDP2 shards dim 0 unevenly; another dim only where every dim divides
    evenly (2.15 rejects the rest, and 2.10 computes wrong shapes for them):
    such a parameter keeps the default Shard(0).
    """

    def placement_fn(param):
        shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
        if placement == "shard1_matrices":
            dim = 1 if param.ndim == 2 else 0
        else:
            dim = max(range(param.ndim), key=lambda d: shape[d])
        if dim == 0 or any(size % shard_size for size in shape):
            return None
        return Shard(dim)

    return placement_fn


def _wrap(model, wrap: dict[str, Any], surface: dict[str, Any]) -> list[Any]:
    """Apply fully_shard / replicate as ``wrap`` says; return each group's first module."""
    tp = wrap.get("tp")
    mesh, tp_mesh = _mesh(wrap["mesh"], tp["degree"] if tp else 0)
    if tp:
        apply_tensor_parallel(model, tp_mesh, tp["sequence_parallel"])
    kwargs: dict[str, Any] = {"mesh": mesh}
    if "shard_placement" in surface:
        kwargs["shard_placement_fn"] = _shard_placement_fn(
            surface["shard_placement"]["placement"], wrap["mesh"][-1]
        )
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


def _set_switches(model, group_modules: list[Any], surface: dict[str, Any]) -> list[list[Any]]:
    """The ``FSDPModule`` switches ``surface`` names; records where torch lacks one."""
    records = []
    for axis, value in (("reshard_after_backward", False), ("keep_unsharded_storage", True)):
        if axis not in surface:
            continue
        module = group_modules[surface[axis]["group"]]
        setter = getattr(module, f"set_{axis}", None)
        if setter is None:
            records.append([-1, axis, "unavailable"])
        else:
            setter(value, recurse=surface[axis]["recurse"])
    if "forward_method" in surface:
        register_fsdp_forward_method(model, surface["forward_method"]["method"])
    return records


def _convert_float8(model, shape: dict[str, Any]) -> str:
    """The blocks' Linears as torchao float8 training weights, all-gathered in float8."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return "unavailable (no torchao)"
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, pad_inner_dim=True)
    for path in module_paths(shape)["blocks"]:
        convert_to_float8_training(model.get_submodule(path), config=config)
    return "converted"


_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    "sgd_momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "adagrad": (torch.optim.Adagrad, {}),
    "rmsprop": (torch.optim.RMSprop, {}),
    "nadam": (torch.optim.NAdam, {}),
    "radam": (torch.optim.RAdam, {}),
    "muon": (getattr(torch.optim, "Muon", None), {}),
}
_IMPLS = {None: {}, "single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _owned(model, owner: str, trainable: list[Any], head_params: set[int]) -> list[Any]:
    """The parameters of ``trainable`` an optimizer spec's ``owns`` names."""
    blocks = {id(p) for name, p in model.named_parameters() if "blocks." in name}
    if owner == "all":
        return trainable
    if owner == "head":
        return [p for p in trainable if id(p) in head_params]
    if owner == "rest":
        return [p for p in trainable if id(p) not in head_params]
    if owner == "rest_blocks":
        return [p for p in trainable if id(p) not in head_params and id(p) in blocks]
    if owner == "rest_other":
        return [p for p in trainable if id(p) not in head_params and id(p) not in blocks]
    matrices = {id(p) for p in trainable if id(p) in blocks and p.ndim == 2}
    if owner == "matrices":
        return [p for p in trainable if id(p) in matrices]
    if owner == "non_matrices":
        return [p for p in trainable if id(p) not in matrices]
    raise AssertionError(f"Expected an optimizer owner, got {owner!r}")


def _build_optims(model, spec: dict[str, Any]) -> list[Any]:
    head_params = {id(p) for p in model.head.parameters()}
    if hasattr(model, "lora_a"):
        head_params |= {id(p) for p in (*model.lora_a.parameters(), *model.lora_b.parameters())}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optims = []
    for idx, optim in enumerate(spec["optims"]):
        params = _owned(model, optim["owns"], trainable, head_params)
        if not params:
            # An optimizer needs a parameter; a frozen head leaves the adapter
            # out of it, so give it the norm's.
            params = [p for p in model.norm.parameters()]
        lr = 1e-2 * (idx + 1)
        if optim["param_groups"] == 2 and len(params) > 1:
            groups = [{"params": params[0::2]}, {"params": params[1::2], "lr": lr / 2}]
        else:
            groups = [{"params": params}]
        cls, kwargs = _OPTIMIZERS[optim["kind"]]
        if cls is None:
            raise RuntimeError(f"torch {torch.__version__} has no optimizer {optim['kind']!r}")
        optims.append(cls(groups, lr=lr, **kwargs, **_IMPLS[optim.get("impl")]))
    return optims


# ---------------------------------------------------------------- recording


def _digest_tensor(tensor) -> str:
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


def _digest(value: Any) -> str:
    """A tensor's digest; any other leaf's repr."""
    return _digest_tensor(value) if isinstance(value, torch.Tensor) else repr(value)


def _leaves(tree: Any) -> list[tuple[str, str]]:
    """Every leaf of a state dict as (path, digest), in order."""
    return [(path, _digest(leaf)) for path, leaf in flat(tree).items()]


def _collective_failure(err: BaseException) -> bool:
    """A timed-out or broken collective: the world cannot go on."""
    text = str(err)
    return "gloo" in text.lower() or "timed out" in text.lower() or "Connection closed" in text


# ---------------------------------------------------------------- one run


def _reshard_all(model) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def _mode_installed(mode: str, broken: str | None):
    """Install what ``mode`` runs under: nothing, or the fix (or a broken fix)."""
    if mode != "fix" or broken == "skip_apply":
        yield
        return
    if broken == "only_passed_module":
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
            snapshots[call] = clone(result)
        return _leaves(result)
    snapshot = snapshots[call.replace("set_", "get_")]
    if options.full_state_dict and options.cpu_offload:
        # Rank 0 alone holds the full state dict: every rank passes rank 0's,
        # loaded by broadcast.
        holder = [snapshot]
        dist.broadcast_object_list(holder, src=0)
        snapshot = holder[0]
        options = dataclasses.replace(options, broadcast_from_rank0=True)
    snapshot = clone(snapshot)
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


def _call_in_context(model, optims, event, snapshots):
    """The call as ``event["context"]`` says: as is, inside no_grad, or from another thread."""
    context = event.get("context")
    if context == "no_grad":
        with torch.no_grad():
            return _call(model, optims, event, snapshots)
    if context != "thread":
        return _call(model, optims, event, snapshots)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = _call(model, optims, event, snapshots)
        except Exception as err:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _call_on_ranks(model, optims, event, snapshots, reshard_first: bool):
    """The call on every rank, or on rank 0 alone; the reference reshards first."""
    if event.get("ranks") != "first":
        if reshard_first:
            _reshard_all(model)
        return _call_in_context(model, optims, event, snapshots)
    result: Any = [("skipped", "called on rank 0 only")]
    error: Exception | None = None
    if dist.get_rank() == 0:
        if reshard_first:
            _reshard_all(model)
        try:
            result = _call_in_context(model, optims, event, snapshots)
        except Exception as err:  # every rank learns of it below
            if _collective_failure(err):
                raise
            error = err
    # Every rank raises where rank 0 raised, so none runs ahead into a collective.
    errors: list[Any] = [None] * dist.get_world_size()
    described = None if error is None else describe_error(error, first_line=True)
    dist.all_gather_object(errors, described)
    if error is not None:
        raise error
    if errors[0] is not None:
        raise RuntimeError(f"rank 0 raised {errors[0]}")
    return result


def _held_state(held: list[tuple[str, Any]]) -> list[list[Any]]:
    """Each held tensor's storage size and, where it has storage, its digest."""
    out = []
    for label, tensor in held:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        nbytes = local.untyped_storage().nbytes()
        out.append([label, nbytes, _digest_tensor(tensor) if nbytes else ""])
    return out


def _final_state(model, optims) -> list[tuple[str, str]]:
    """Every parameter's local shard and every optimizer state, sharded first."""
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
                    out.append((f"optim{o_idx}/{g_idx}/{p_idx}/{key}", _digest(value)))
    return out


def run_mode(
    config: Config, mode: str, broken: str | None = None, progress=lambda idx: None
) -> dict[str, Any]:
    """Build the configuration's model and run its events under ``mode``.

    Returns {"status": "ok" | "raised", "records": [[event, what, detail], ...]}.
    A failed collective is raised: the world cannot go on.
    """
    torch.manual_seed(config["seed"] * 1000 + config["index"])
    model, abort_type = _build_model(config["model"])
    surface = config.get("surface", {})
    records: list[list[Any]] = []
    status = "ok"
    optims: list[Any] = []
    snapshots: dict[str, Any] = {}
    # Parameters taken from the model after unshard(), kept across calls.
    held: list[tuple[str, Any]] = []
    # unshard(async_op=True) handles left to the next forward to wait on.
    pending: list[Any] = []
    step = 0
    idx = -1
    with _mode_installed(mode, broken):
        try:
            if "float8" in surface:
                records.append([-1, "float8", _convert_float8(model, config["model"])])
            group_modules = _wrap(model, config["wrapping"], surface)
            records.extend(_set_switches(model, group_modules, surface))
            for idx, event in enumerate(config["events"]):
                progress(idx)
                kind = event["do"]
                if kind == "build_optims":
                    optims = _build_optims(model, config["optimizers"])
                    records.append([idx, kind, len(optims)])
                elif kind == "train":
                    tokens, targets = batch(step)
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
                elif kind == "accumulate":
                    records.append([idx, kind, _accumulate(model, step)])
                    step += 1
                elif kind == "eval":
                    context = torch.inference_mode if event["mode"] == "inference_mode" else torch.no_grad
                    # model(...) runs FSDP2's hooks; a method is hooked only
                    # once register_fsdp_forward_method registered it.
                    forward = getattr(model, event["method"]) if "method" in event else model
                    model.eval()
                    with context():
                        out = forward(batch(-1)[0])
                    model.train()
                    records.append([idx, kind, _digest_tensor(out)])
                elif kind == "unshard":
                    module = group_modules[event["group"] % len(group_modules)]
                    handle = module.unshard(async_op=event.get("async", False))
                    if handle is not None and event.get("wait"):
                        handle.wait()
                    elif handle is not None:
                        pending.append(handle)
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
            records.append([idx, "raised", describe_error(err, first_line=True)])
    del model, optims, snapshots, held, pending
    gc.collect()
    return {"status": status, "records": records}


def _accumulate(model, step: int) -> str:
    """A forward and backward whose gradients FSDP2 accumulates unreduced; no step."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        tokens, targets = batch(step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
    return loss.item().hex()


def _abort(model, event: dict[str, Any], abort_type) -> str:
    """A forward that an exception aborts, then FSDP2's documented recovery."""
    model.tripwire.armed = True
    try:
        with torch.enable_grad() if event["grad"] else torch.no_grad():
            model(batch(-2)[0])
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

