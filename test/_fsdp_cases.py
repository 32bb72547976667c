"""FSDP2 models, evaluation scenarios and renderings shared by the multi-process tests.

Everything here runs inside a rank started by ``_ranks.run_ranks`` (test/_ranks.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (  # imported before apply() on purpose
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._pytree import SequenceKey, tree_flatten_with_path, tree_map_only

import backport


VOCAB, DIM = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(F.relu(self.lin1(x)))


class TinyLM(nn.Module):
    """Embedding, blocks, norm and head: the shape of a decoder LM, in miniature."""

    def __init__(self, n_blocks: int = 2, tied: bool = False, lora: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.lora_a = self.lora_b = None
        if lora:
            # Adapter on the head, which lives in the root FSDP group.
            self.lora_a = nn.Linear(DIM, 2, bias=False)
            self.lora_b = nn.Linear(2, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        logits = self.head(h)
        if self.lora_a is not None:
            logits = logits + self.lora_b(self.lora_a(h))
        return logits


# reshard_after_forward as an int that divides the world size; see raf_int().
RAF_INT = "int"


@dataclasses.dataclass(frozen=True)
class Case:
    """One way of sharding, optimizing and evaluating the model."""

    root: bool | str | None = None  # reshard_after_forward of the root group
    blocks: bool | str | None = True
    tail: bool | None = None  # a separate [norm, head] group, as accelerate builds
    tied: bool = False
    lora: bool = False
    hsdp: bool = False
    replicate: bool = False
    multi_optim: bool = False
    inference_mode: bool = False
    options: tuple[tuple[str, bool], ...] = ()
    # The root group holds only a frozen embedding; the optimizer the rest.
    frozen: bool = False
    # FSDPModule.unshard() on every FSDP module instead of an evaluation.
    unshard: bool = False
    mixed_precision: bool = False  # MixedPrecisionPolicy(param_dtype=bfloat16)
    offload_policy: bool = False  # FSDP2's CPUOffloadPolicy
    checkpoint_wrapper: bool = False  # blocks wrapped for activation checkpointing
    compile: bool = False  # torch.compile(backend="eager") around the sharded model
    # Tensor parallelism of this degree on a ("dp", "tp") mesh, or with hsdp a
    # ("replicate", "shard", "tp") one; FSDP2 shards over the other dimensions.
    tp: int = 0
    sequence_parallel: bool = False  # with tp: SP on the norm, as torchtitan plans
    fsdp: bool = True  # False with tp: tensor parallel only, no fully_shard
    # The blocks' Linear weights as torchao's int8 mixed-precision training
    # tensors: a wrapper subclass holding its data in an inner tensor.
    int8_training: bool = False
    # FSDPModule.set_keep_unsharded_storage(True) on the root (torch 2.15 on):
    # reshard() keeps the unsharded parameters' storage.
    keep_unsharded_storage: bool = False


def raf_int(world_size: int) -> int:
    # An int must divide the shard group size; 2 is a real smaller mesh on 4 ranks.
    return 2 if world_size % 2 == 0 and world_size > 2 else 1


CASES: dict[str, Case] = {
    "root_none": Case(),
    "root_false": Case(root=False),
    "blocks_false_root_true": Case(root=True, blocks=False),
    "tail_group_false": Case(root=True, tail=False),
    "tied_weights": Case(tied=True),
    "raf_int": Case(root=RAF_INT, blocks=RAF_INT),
    "hsdp": Case(hsdp=True),
    "lora_root_group": Case(lora=True),
    "multi_optim_groups": Case(multi_optim=True),
    "inference_mode": Case(inference_mode=True),
    "full_state_dict": Case(options=(("full_state_dict", True),)),
    "cpu_offload": Case(options=(("cpu_offload", True),)),
    "full_cpu_offload": Case(options=(("full_state_dict", True), ("cpu_offload", True))),
    "broadcast_from_rank0": Case(
        options=(("full_state_dict", True), ("broadcast_from_rank0", True))
    ),
    "flatten_optimizer_state_dict": Case(
        options=(("flatten_optimizer_state_dict", True),)
    ),
}
REPLICATE_CASE = Case(replicate=True)


def has_replicate() -> bool:
    try:
        from torch.distributed._composable.replicate_with_fsdp import (  # noqa: F401
            replicate,
        )
    except ImportError:
        return False
    return True


def build(case: Case, seed: int = 0):
    """Return (model, optimizers, options) for ``case`` on the current process group."""
    world_size = dist.get_world_size()
    torch.manual_seed(seed)
    model = TinyLM(tied=case.tied, lora=case.lora)
    if case.checkpoint_wrapper:
        model.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in model.blocks)
    if case.frozen:
        model.embed.weight.requires_grad_(False)
    if case.int8_training:
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training

        quantize_(model.blocks, int8_mixed_precision_training())
    fsdp_kwargs: dict[str, Any] = {}
    if case.mixed_precision:
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if case.offload_policy:
        # Pinned memory needs an accelerator.
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    root = raf_int(world_size) if case.root == RAF_INT else case.root
    blocks = raf_int(world_size) if case.blocks == RAF_INT else case.blocks
    if case.replicate:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("replicate",))
        for block in model.blocks:
            replicate(block, mesh=mesh)
        replicate(model, mesh=mesh)
    elif case.tp:
        mesh = _tensor_parallelize(model, case, world_size)
    elif case.hsdp:
        shape = (2, world_size // 2) if world_size >= 2 else (1, 1)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    if case.fsdp and not case.replicate:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=blocks, **fsdp_kwargs)
        if case.tail is not None:
            fully_shard(
                [model.norm, model.head],
                mesh=mesh,
                reshard_after_forward=case.tail,
                **fsdp_kwargs,
            )
        fully_shard(model, mesh=mesh, reshard_after_forward=root, **fsdp_kwargs)
    if case.keep_unsharded_storage:
        model.set_keep_unsharded_storage(True)
    if case.frozen:
        optims = [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)]
    elif case.lora:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("lora_"))
        optims = [torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)]
    elif case.multi_optim:
        block_params = list(model.blocks.parameters())
        ids = {id(p) for p in block_params}
        lin1 = [p for b in model.blocks for p in b.lin1.parameters()]
        lin2 = [p for b in model.blocks for p in b.lin2.parameters()]
        rest = [p for p in model.parameters() if id(p) not in ids]
        optims = [
            torch.optim.Adam([{"params": lin1}, {"params": lin2, "lr": 5e-3}], lr=1e-2),
            torch.optim.SGD(rest, lr=1e-2, momentum=0.9),
        ]
    else:
        optims = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    if case.compile:
        model = torch.compile(model, backend="eager")
    return model, optims, StateDictOptions(**dict(case.options))


def shard_blocks_then_root(model: TinyLM, mesh) -> TinyLM:
    """``fully_shard`` each block, then the root, as the frameworks' FSDP2 set-ups do.

    The root keeps the default reshard_after_forward: unsharded after a forward.
    """
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tp_mesh_shape(case: Case, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The device mesh of a TP case: its shape and dimension names."""
    dp = world_size // case.tp
    if case.hsdp:
        replicas = 2 if dp % 2 == 0 else 1
        return (replicas, dp // replicas, case.tp), ("replicate", "shard", "tp")
    return (dp, case.tp), ("dp", "tp")


def device_meshes(fsdp_shape: tuple[int, ...], tp: int = 0):
    """The CPU mesh of ``fsdp_shape`` ("dp", or "replicate" and "shard") and a "tp"
    dimension of ``tp`` ranks if ``tp``: (whole mesh, FSDP mesh, TP mesh or None)."""
    names = ("dp",) if len(fsdp_shape) == 1 else ("replicate", "shard")
    if not tp:
        mesh = init_device_mesh("cpu", tuple(fsdp_shape), mesh_dim_names=names)
        return mesh, mesh, None
    mesh = init_device_mesh("cpu", (*fsdp_shape, tp), mesh_dim_names=(*names, "tp"))
    return mesh, mesh[names], mesh["tp"]


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Megatron-style TP on every ``Block``'s lin1 and lin2 (SP on the rest if asked).

    With SP the activations between blocks are sharded on the sequence
    dimension and the embedding, norm and head are tensor parallel too, as in
    torchtitan's plan; without it they stay plain parameters.
    """
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


def _tensor_parallelize(model: TinyLM, case: Case, world_size: int):
    """``apply_tensor_parallel`` on ``case``'s mesh; returns the FSDP mesh."""
    shape, _ = tp_mesh_shape(case, world_size)
    _, mesh, tp_mesh = device_meshes(shape[:-1], shape[-1])
    apply_tensor_parallel(model, tp_mesh, case.sequence_parallel)
    return mesh


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Same data on every rank, so results do not depend on the world size.
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=gen)
    return tokens, torch.roll(tokens, 1, dims=1)


def train_step(model, optims, step: int) -> float:
    tokens, targets = batch(step)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    for optim in optims:
        optim.step()
        optim.zero_grad()
    return loss.item()


def evaluate(model, case: Case = Case()) -> None:
    """A forward with no backward: leaves reshard_after_forward=False groups unsharded."""
    if case.unshard:
        # As RL frameworks do before generation; nothing reshards until a backward.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
        return
    mode = torch.inference_mode if case.inference_mode else torch.no_grad
    model.eval()
    with mode():
        model(batch(-1)[0])
    model.train()


def clone(tree: Any) -> Any:
    """``tree`` with every tensor detached and copied: a state dict shares storage with its source."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def _path_part(key: Any) -> str:
    # The spelling the pinned outputs use: /dict_key, [list_index].
    if isinstance(key, SequenceKey):
        return f"[{key.idx}]"
    return f"/{getattr(key, 'key', getattr(key, 'name', key))}"


def flat(tree: Any) -> dict[str, Any]:
    """Every leaf of ``tree`` by its path (``/state/0/exp_avg``, ``/param_groups[0]``), None included."""
    leaves, _ = tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return {
        "".join(_path_part(key) for key in path):
        leaf
        for path, leaf in leaves
    }


def count_tensors(tree: Any) -> int:
    return sum(isinstance(value, torch.Tensor) for value in flat(tree).values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    if isinstance(tensor, ShardedTensor):  # FSDP1's sharded state dict
        return tensor.local_tensor()
    return tensor


def differences(actual: Any, expected: Any) -> list[str]:
    """Paths where two state dicts differ; tensors are compared exactly."""
    flat_a, flat_e = flat(actual), flat(expected)
    diffs = sorted(set(flat_a) ^ set(flat_e))
    for path in sorted(set(flat_a) & set(flat_e)):
        a, e = flat_a[path], flat_e[path]
        if isinstance(a, torch.Tensor) != isinstance(e, torch.Tensor):
            diffs.append(path)
        elif isinstance(a, torch.Tensor):
            same_layout = type(a) is type(e) and (
                not isinstance(a, DTensor) or a.placements == e.placements
            )
            if not (same_layout and a.dtype == e.dtype and torch.equal(_local(a), _local(e))):
                diffs.append(path)
        elif a != e:
            diffs.append(path)
    return diffs


def restored(actual: Any, expected: Any) -> str:
    """"restored exactly", or the first paths where a loaded state differs from the saved one."""
    diffs = differences(actual, expected)
    return "restored exactly" if not diffs else f"differs at {diffs[:3]}"


def perturb(model, optims, params: bool = True, optim_state: bool = True) -> None:
    """Change parameters and optimizer states, so a load has something to restore."""
    with torch.no_grad():
        for param in model.parameters() if params else ():
            param.add_(1.0)
        for optim in optims if optim_state else ():
            for state in optim.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.add_(1.0)


def _get_model(model, optims, options, ref):
    return differences(get_model_state_dict(model, options=options), ref["model"])


def _get_optim(model, optims, options, ref):
    return differences(get_optimizer_state_dict(model, optims, options=options), ref["optim"])


def _get_state(model, optims, options, ref):
    msd, osd = get_state_dict(model, optims, options=options)
    return differences(msd, ref["model"]) + differences(osd, ref["optim"])


def _rank0_only(options: StateDictOptions) -> bool:
    return options.full_state_dict and options.cpu_offload


def _load_options(options: StateDictOptions) -> StateDictOptions:
    # A full state dict offloaded to CPU exists on rank 0 only: load by broadcast.
    if _rank0_only(options):
        return dataclasses.replace(options, broadcast_from_rank0=True)
    return options


def _load_input(ref: dict[str, Any], key: str, options: StateDictOptions) -> Any:
    """What each rank passes to a set call.

    Every rank passes rank 0's full state dict: a rank that passed an empty one
    would skip the FQN mapping that fails on rank 0 without the fix, and the
    ranks would then disagree on the next collective.
    """
    value = [clone(ref[key])]
    if _rank0_only(options):
        dist.broadcast_object_list(value, src=0)
    return value[0]


def _set_model(model, optims, options, ref):
    set_model_state_dict(
        model, _load_input(ref, "model", options), options=_load_options(options)
    )
    return differences(get_model_state_dict(model, options=options), ref["model"])


def _set_optim(model, optims, options, ref):
    set_optimizer_state_dict(
        model, optims, _load_input(ref, "optim", options), options=_load_options(options)
    )
    return differences(get_optimizer_state_dict(model, optims, options=options), ref["optim"])


def _set_state(model, optims, options, ref):
    set_state_dict(
        model,
        optims,
        model_state_dict=_load_input(ref, "model", options),
        optim_state_dict=_load_input(ref, "optim", options),
        options=_load_options(options),
    )
    msd, osd = get_state_dict(model, optims, options=options)
    return differences(msd, ref["model"]) + differences(osd, ref["optim"])


def _set_model_per_module(model, optims, options, ref):
    """Lightning Fabric's load of a full checkpoint into an FSDP2 model.

    One ``set_model_state_dict`` per module and tensor, on the module that holds
    it directly (``fabric/strategies/model_parallel.py``, ``_load_raw_module_state``).
    """
    full = clone(ref["full_model"])
    load_options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False
    )
    for module_name, module in model.named_modules():
        for name, _ in itertools.chain(
            module.named_buffers(recurse=False), module.named_parameters(recurse=False)
        ):
            fqn = f"{module_name}.{name}" if module_name else name
            set_model_state_dict(module, {name: full[fqn]}, options=load_options)
    return differences(get_model_state_dict(model, options=options), ref["model"])


CALLS: dict[str, Callable] = {
    "get_model": _get_model,
    "get_optim": _get_optim,
    "get_state": _get_state,
    "set_model": _set_model,
    "set_optim": _set_optim,
    "set_state": _set_state,
}


def describe_error(err: BaseException, *, first_line: bool = False) -> str:
    """The one rendering of an exception that the tests pin: its type and message.

    A tensor the error carries (torch's ``KeyError(param)``) is shown by its type,
    ``KeyError: <DTensor>``, and object addresses as ``0x?``, so the text is the
    same on every run and rank.
    """
    if isinstance(err, KeyError) and err.args and isinstance(err.args[0], torch.Tensor):
        return f"KeyError: <{type(err.args[0]).__name__}>"
    text = re.sub(r"0x[0-9a-f]+", "0x?", str(err))
    if first_line:
        text = text.split("\n")[0]
    return f"{type(err).__name__}: {text}"


def outcomes(text: str, sep: str = ": ") -> dict[str, str]:
    """``step<sep>outcome`` lines as {step: outcome}."""
    return dict(line.split(sep, 1) for line in text.splitlines())


def before_after(
    stock: str | dict[str, str], fixed: str | dict[str, str], sep: str = ": "
) -> dict[str, str]:
    """{step: "stock -> fixed"} from two renderings (or {step: outcome} dicts),
    or the one outcome where both agree."""
    before = stock if isinstance(stock, dict) else outcomes(stock, sep)
    after = fixed if isinstance(fixed, dict) else outcomes(fixed, sep)
    return {
        step: before.get(step, "-") if before.get(step) == after.get(step)
        else f"{before.get(step, '-')} -> {after.get(step, '-')}"
        for step in dict.fromkeys([*before, *after])
    }


def side_by_side(columns: dict[str, dict[str, str]], corner: str = "") -> str:
    """One table: a row per step (in first-seen order), a column per case; "-" where absent.

    Cases that differ only in data render as one literal to pin, not one each.
    """
    steps = list(dict.fromkeys(step for column in columns.values() for step in column))
    rows = [[corner, *columns]] + [
        [step, *(column.get(step, "-") for column in columns.values())] for step in steps
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in rows
    )


def losses_after(model, optims, steps: tuple[int, ...] = (1, 2)) -> list[float]:
    return [train_step(model, optims, step) for step in steps]


def reference_losses(case: Case) -> list[float]:
    """Losses of the steps after the first, in a run that never evaluated or checkpointed."""
    model, optims, _ = build(case)
    train_step(model, optims, 0)
    return losses_after(model, optims)


def outcome_of(call: Callable[[], Any]) -> str:
    """'ok', or the first line of what ``call`` raised."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the outcome is what we render
        return describe_error(err, first_line=True)
    return "ok"


def restored_by(
    load: Callable[[], Any], state: Callable[[], Any], saved: Any, what: str = ""
) -> str:
    """``load()`` (a load, a resume): the first line of what it raised, or how well
    ``state()`` then matches ``saved``, after ``what`` ("optimizer state restored exactly")."""
    outcome = outcome_of(load)
    if outcome != "ok":
        return outcome
    return " ".join(filter(None, [what, restored(state(), saved)]))


def call_after_evaluation(
    model,
    optims,
    options: StateDictOptions,
    call_name: str,
    evaluate: Callable[[], None],
    calls: dict[str, Callable] = CALLS,
) -> str:
    """Record the sharded state, evaluate, make the call: 'ok' or what went wrong.

    'ok' means the call returned (or, for a set call, restored) exactly the
    state recorded before the evaluation; a set call first gets what it
    restores perturbed.
    """
    call = calls[call_name]
    # Before any evaluation every group is sharded: the reference state.
    ref = {
        "model": clone(get_model_state_dict(model, options=options)),
        "optim": clone(get_optimizer_state_dict(model, optims, options=options)),
    }
    if call is _set_model_per_module:
        ref["full_model"] = clone(
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        )
    if call_name.startswith("set_"):
        # Only what the call restores, so the next steps can match the reference.
        perturb(
            model,
            optims,
            params="model" in call_name or "state" in call_name,
            optim_state="optim" in call_name or "state" in call_name,
        )
    evaluate()
    try:
        diffs = call(model, optims, options, ref)
    except Exception as err:  # noqa: BLE001 - the outcome is what we render
        return describe_error(err, first_line=True)
    return f"differs at {diffs[:3]}" if diffs else "ok"


def run_case(
    case: Case, calls: dict[str, Callable] = CALLS, check_losses: bool = False
) -> dict[str, str]:
    """Each call after an evaluation: 'ok' or what went wrong.

    With ``check_losses``, 'ok' also needs the next training steps to give the
    exact losses of a run that never evaluated or checkpointed.
    """
    expected_losses = reference_losses(case) if check_losses else None
    outcomes = {}
    for call_name in calls:
        model, optims, options = build(case)
        train_step(model, optims, 0)
        outcome = call_after_evaluation(
            model, optims, options, call_name, functools.partial(evaluate, model, case), calls
        )
        if outcome == "ok" and check_losses:
            losses = losses_after(model, optims)
            if losses != expected_losses:
                outcome = f"losses {losses} != {expected_losses}"
        outcomes[call_name] = outcome
    return outcomes


def summarize(outcomes: dict[str, str]) -> list[str]:
    """The calls that did not return the exact reference state, grouped by outcome."""
    failed = {call: out for call, out in outcomes.items() if out != "ok"}
    if not failed:
        return [f"all {len(outcomes)} calls ok"]
    return [
        ", ".join(call for call, out in failed.items() if out == kind) + f" -> {kind}"
        for kind in sorted(set(failed.values()))
    ]


def render_outcomes(results: dict[str, dict[str, str]]) -> str:
    """One line per case and outcome: the calls that did not return the reference state."""
    return "\n".join(
        f"{name}: {line}" for name, outcomes in results.items() for line in summarize(outcomes)
    )


def render_outcome_groups(results: dict[str, dict[str, str]]) -> str:
    """``render_outcomes`` with the cases that share every outcome named together.

    Each case stands in one group, so a case's lines are exactly its group's.
    """
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, outcomes in results.items():
        groups.setdefault(tuple(summarize(outcomes)), []).append(name)
    return "\n".join(
        f"{', '.join(names)}: {lines[0]}" if len(lines) == 1
        else f"{', '.join(names)}:" + "".join(f"\n    {line}" for line in lines)
        for lines, names in groups.items()
    )


def optimizer_state_summary(model, optims) -> str:
    """How many of the optimizers' parameters get_optimizer_state_dict returns state for."""
    n_params = sum(len(group["params"]) for optim in optims for group in optim.param_groups)
    try:
        osd = get_optimizer_state_dict(model, optims)
    except ValueError as err:
        return f"ValueError: {err}"
    except KeyError as err:
        return describe_error(err)
    return f"ok, state for {len(osd['state'])} of {n_params} optimizer params"


def cases_worker(cases: dict[str, Case]) -> dict[str, dict[str, str]]:
    """{label: {case: the calls that failed, or "all 6 calls ok"}}, stock then patched.

    Each call is also checked by the next training steps' losses.
    """
    return unpatched_then_patched(
        lambda _label: {
            name: "; ".join(summarize(run_case(case, check_losses=True)))
            for name, case in cases.items()
        }
    )


def cases_table(world_size: int, cases: dict[str, Case]) -> str:
    """``cases_worker`` on ``world_size`` ranks as one table: stock, backport applied.

    Each case named "control: ..." (there must be one) gives the same outcome
    with the fix as on stock torch.
    """
    result = run_agreed(world_size, cases_worker, cases)
    controls = [name for name in result["unpatched"] if "control:" in name]
    assert controls, "no control case"
    for name in controls:
        assert result["patched"][name] == result["unpatched"][name], name
    return side_by_side(
        {"stock": result["unpatched"], "backport applied": result["patched"]}, "case"
    )


def optimizer_built_after_evaluation_worker(cases: dict[str, Case]) -> dict[str, str]:
    """A new optimizer over each case's model, built before any forward and after an evaluation.

    Built before any forward the optimizer holds FSDP2's sharded DTensors, which
    DSD's zero-grad step() initializes. Built after an evaluation it holds the
    unsharded parameters of the groups left unsharded: the fix's reshard
    unregisters them during the call, or, with the model resharded before the
    call, has freed their storage (for a DTensor or another wrapper subclass,
    its inner tensors' storage) unless the case keeps it.
    """

    def run(name: str, case: Case, built: str, call: str) -> str:
        model, optims, _ = build(case)
        if built != "before any forward":
            train_step(model, optims, 0)
            saved = clone(get_optimizer_state_dict(model, optims))
            evaluate(model, case)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        if built == "after an evaluation, resharded before the call":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        if call == "get":
            outcome = optimizer_state_summary(model, [optim])
        else:
            outcome = outcome_of(lambda: set_optimizer_state_dict(model, optim, clone(saved)))
        return f"{name}, built {built}, {call}: {outcome}"

    def render(label: str) -> str:
        lines = []
        for name, case in cases.items():
            lines.append(run(name, case, "before any forward", "get"))
            # reshard() keeps the storage for an int reshard_after_forward too.
            keeps_storage = case.keep_unsharded_storage or case.root == RAF_INT
            for built in ("after an evaluation", "after an evaluation, resharded before the call"):
                for call in ("get", "set"):
                    if label == "unpatched" and "resharded" in built and not keeps_storage:
                        # Stock DSD's zero-grad step() writes to the freed storage.
                        lines.append(f"{name}, built {built}, {call}: not run (step() on freed storage)")
                    else:
                        lines.append(run(name, case, built, call))
        return "\n".join(lines)

    return unpatched_then_patched(render)


def run_agreed(world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on ``world_size`` ranks; every rank's result must equal rank 0's."""
    from _ranks import run_ranks

    results = run_ranks(world_size, fn, *args)
    for rank, result in enumerate(results):
        assert result == results[0], f"rank {rank} disagrees with rank 0"
    return results[0]


def run_agreed_in_temp_dir(world_size: int, fn: Callable[[str], Any]) -> Any:
    """``run_agreed(world_size, fn, folder)`` with a new temporary folder for its files."""
    with tempfile.TemporaryDirectory() as folder:
        return run_agreed(world_size, fn, folder)


def run_agreed_before_after(worker: Callable[[str], dict[str, str]]) -> str:
    """``worker(folder)`` on 2 ranks, with a new temporary folder, rendered by
    render_before_after: a worker of steps ``step -> outcome`` per line, run
    ``unpatched_then_patched``, checkpointing in ``folder``."""
    return render_before_after(run_agreed_in_temp_dir(2, worker), " -> ")


def unpatched_then_patched(run: Callable[[str], Any]) -> dict[str, Any]:
    """``run(label)`` on torch as installed, then with the backport, keyed by label."""
    results = {"unpatched": run("unpatched")}
    backport.apply()
    try:
        results["patched"] = run("patched")
    finally:
        backport.revert()
    return results


def render_before_after(result: dict[str, Any], sep: str = ": ") -> str:
    """``unpatched_then_patched``'s two renderings as one table: "stock -> patched" per step."""
    return side_by_side(
        {"stock -> backport applied": before_after(result["unpatched"], result["patched"], sep)}
    )


def render_before_after_columns(results: dict[str, dict[str, Any]], sep: str = ": ") -> str:
    """``unpatched_then_patched`` results of several cases as one table, a column each."""
    return side_by_side(
        {
            name: before_after(result["unpatched"], result["patched"], sep)
            for name, result in results.items()
        },
        "stock -> backport applied",
    )


def matrix_worker(include_replicate: bool) -> dict[str, str]:
    """Run every case without and then with the backport; return the renderings.

    The replicate case, which not every release has, is rendered on its own.
    """
    cases = dict(CASES)
    if include_replicate:
        cases["replicate"] = REPLICATE_CASE
    outcomes = unpatched_then_patched(
        lambda _label: {name: run_case(case) for name, case in cases.items()}
    )
    rendered = {}
    for label, key in (("unpatched", "before"), ("patched", "after")):
        results = outcomes[label]
        rendered[key] = render_outcome_groups({name: results[name] for name in CASES})
        if include_replicate:
            rendered[f"replicate {key}"] = render_outcomes({"replicate": results["replicate"]})
    return rendered


def _describe_value(value: Any) -> str:
    if isinstance(value, DTensor):
        placements = ", ".join(str(p) for p in value.placements)
        return f"DTensor{list(value.shape)} {value.dtype} ({placements})"
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {value.dtype}"
    return repr(value)


def optim_state_dict_rows(osd: dict[str, Any]) -> dict[str, str]:
    """Structure of a DCP optimizer state dict: each FQN's state entries, then the param groups."""
    rows = {}
    for fqn in sorted(osd["state"]):
        entries = osd["state"][fqn]
        rows[fqn] = ", ".join(f"{k}={_describe_value(entries[k])}" for k in sorted(entries))
    for idx, group in enumerate(osd["param_groups"]):
        # Only lr: the other hyperparameters differ between torch releases.
        rows[f"param_groups[{idx}] lr={group['lr']}"] = ", ".join(group["params"])
    return rows


def model_state_dict_rows(msd: dict[str, Any]) -> dict[str, str]:
    return {fqn: _describe_value(msd[fqn]) for fqn in sorted(msd)}
