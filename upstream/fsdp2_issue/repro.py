"""FSDP2 registers no state-dict hooks on the second module of a tied weight.

    torchrun --nproc-per-node 2 repro.py                         # ends in SIGSEGV
    torchrun --nproc-per-node 2 repro.py get_model_state_dict    # ends in SIGSEGV
    torchrun --nproc-per-node 2 repro.py proposed_fix            # exits 0

CPU and gloo, no GPU needed. The tied pair is grouped the way FSDP2's own error
for shared parameters asks (``fully_shard([module_a, module_b])``), with the
head listed first. The script prints what it sees, then a line before the call
that crashes, so that the crash can be told apart from a failure earlier on.
``proposed_fix`` registers the owner's hook on the shared modules from outside
(what the proposed change does inside ``_register_state_dict_hooks``) and runs
the same steps without crashing.
"""

import gc
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def say(text: str, every_rank: bool = False) -> None:
    # The last line before a segfault must reach the terminal.
    if every_rank or dist.get_rank() == 0:
        sys.stdout.write(f"[rank{dist.get_rank()}] {text}\n")
        sys.stdout.flush()


def reshard_all(model: nn.Module) -> None:
    # model.reshard() reshards only the root's own group, not the tied pair's.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def describe(tensor: torch.Tensor) -> str:
    if isinstance(tensor, DTensor):
        return f"DTensor {tuple(tensor.shape)}"
    nbytes = tensor.untyped_storage().nbytes()
    return f"Tensor {tuple(tensor.shape)}, storage nbytes {nbytes}"


def initial_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return nn.Embedding(16, 8).weight.detach()


def tied_model(group_order: str) -> nn.Sequential:
    """Embedding and head share one weight; one FSDP group holds both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if group_order == "head first":
        pair = [model[1], model[0]]
    else:
        pair = [model[0], model[1]]
    fully_shard(pair, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


def to_sharded_hook(group):
    # The hook FSDPParamGroup._register_state_dict_hooks puts on owners.
    def hook(*args, **kwargs) -> None:
        group._to_sharded()

    return hook


def register_hooks_on_shared_modules(model: nn.Module) -> None:
    """The proposed fix, applied from outside: hook the shared modules too."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch <= 2.10 keeps one group per state
            groups = [state._fsdp_param_group] if state._fsdp_param_group else []
        for group in groups:
            for fsdp_param in group.fsdp_params:
                for shared in fsdp_param._module_info.shared_modules:
                    hook = to_sharded_hook(group)
                    shared.register_state_dict_pre_hook(hook)
                    shared._register_load_state_dict_pre_hook(hook)


def eval_forward(model: nn.Module, proposed_fix: bool) -> None:
    if proposed_fix:
        register_hooks_on_shared_modules(model)
    with torch.no_grad():
        model(torch.arange(4))  # the pair's group stays unsharded after this


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "clone"
    if mode not in ("clone", "get_model_state_dict", "proposed_fix"):
        raise SystemExit(f"unknown mode {mode!r}")
    proposed_fix = mode == "proposed_fix"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    say(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {mode}")

    # 1. Calls on the submodules: the head (owner) resharded, the embedding not.
    model = tied_model("head first")
    eval_forward(model, proposed_fix)
    say(f"model[0].state_dict()['weight']: {describe(model[0].state_dict()['weight'])}")
    say(f"model[1].state_dict()['weight']: {describe(model[1].state_dict()['weight'])}")

    # 2. A load into the hook-less module returns and is lost at the next reshard.
    model = tied_model("head first")
    eval_forward(model, proposed_fix)
    try:
        model[0].load_state_dict({"weight": torch.full((16, 8), 5.0)})
        reshard_all(model)
        kept = bool((model[0].weight.full_tensor() == 5.0).all())
        say(f"load 5.0 into model[0], reshard: weight is 5.0: {kept}")
    except RuntimeError as err:
        message = " ".join(str(err).split())
        say(f"load 5.0 into model[0]: {type(err).__name__}: {message}")

    # 3. Grouped in registration order, the owner is visited first: no harm.
    model = tied_model("embedding first")
    eval_forward(model, proposed_fix)
    state_dict = model.state_dict()
    for key in ("0.weight", "1.weight"):
        entry = describe(state_dict[key])
        say(f"embedding listed first: model.state_dict()[{key!r}]: {entry}")

    # 4. The whole model: state_dict() visits the embedding before the head,
    # whose hook then frees the storage the embedding's entry still points at.
    model = tied_model("head first")
    eval_forward(model, proposed_fix)
    if mode != "get_model_state_dict":
        state_dict = model.state_dict()
        for key in ("0.weight", "1.weight"):
            say(f"model.state_dict()[{key!r}]: {describe(state_dict[key])}")
        dist.barrier()
        say("calling model.state_dict()['0.weight'].clone()", True)
        copy = state_dict["0.weight"].clone()
        say(f"clone returned {describe(copy)}")
    if mode != "clone":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        sharded = get_model_state_dict(model)
        for key in ("0.weight", "1.weight"):
            say(f"get_model_state_dict(model)[{key!r}]: {describe(sharded[key])}")
        # That call resharded the model; unshard it again as an evaluation does.
        model = tied_model("head first")
        eval_forward(model, proposed_fix)
        dist.barrier()
        say("calling get_model_state_dict(model, full_state_dict=True)", True)
        options = StateDictOptions(full_state_dict=True)
        full = get_model_state_dict(model, options=options)
        for key in ("0.weight", "1.weight"):
            same = torch.equal(full[key], initial_weight())
            say(f"returned {key}: equal to the initial weight: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # FSDP modules sit in reference cycles, so the gloo group they hold would
    # otherwise be freed by the interpreter's final collection, where its worker
    # threads can abort the process (pytorch#190489).
    gc.collect()
