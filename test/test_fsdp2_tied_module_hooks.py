"""FSDP2 bug, pinned as it is today (upstream/fsdp2_issue/): tied weights' secondary module has no state-dict hooks.

``fully_shard`` registers its state-dict pre-hooks (``to_sharded``) and load
pre-hooks only on the module that first owns a shared parameter
(``FSDPParam._module_info.module``), not on the modules sharing it
(``shared_modules``). A per-module full load into the secondary module while the
group is unsharded returns without error and the value is lost at the next
reshard; into the primary module it lands. The backport does not change this
(its plain-module extension finds no hook on the secondary module either).
When FSDP2 registers the hooks on shared modules, these literals change.
"""

from __future__ import annotations

import unittest

import expecttest
import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from _fsdp_cases import (
    StateDictOptions,
    describe_error,
    get_model_state_dict,
    run_agreed,
    set_model_state_dict,
    unpatched_then_patched,
)
from backport import _FSDP2_TO_SHARDED_HOOK


pytestmark = pytest.mark.ranks


def _tied_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight
    fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    return model


def _hooks(module: nn.Module) -> str:
    # Load pre-hooks are stored wrapped (torch.nn.modules.module._WrappedHook).
    names = sorted(
        getattr(getattr(hook, "hook", hook), "__name__", type(hook).__name__)
        for hooks in (module._state_dict_pre_hooks, module._load_state_dict_pre_hooks)
        for hook in hooks.values()
    )
    return ", ".join(names) or "none"


def _register_hooks_on_shared_modules(model: FSDPModule) -> None:
    """What upstream/fsdp2_issue/ proposes, done from outside: the owner's hooks on shared modules."""
    group = model._get_fsdp_state()._fsdp_param_group
    for fsdp_param in group.fsdp_params:
        info = fsdp_param._module_info
        hook = group._module_to_pre_save_state_dict_hook_handle[info.module]
        to_sharded_hook = info.module._state_dict_pre_hooks[hook.id]
        for shared_module in info.shared_modules:
            shared_module.register_state_dict_pre_hook(to_sharded_hook)
            shared_module._register_load_state_dict_pre_hook(to_sharded_hook)


def _load_into(index: int, proposed_fix: bool = False) -> str:
    """A full load of a new weight into ``model[index]`` after a no_grad forward."""
    model = _tied_model()
    with torch.no_grad():
        model(torch.arange(4))
    if proposed_fix:
        _register_hooks_on_shared_modules(model)
    new_weight = torch.full((16, 8), 3.0)
    full = StateDictOptions(full_state_dict=True)
    try:
        set_model_state_dict(model[index], {"weight": new_weight}, options=full)
    except Exception as err:  # noqa: BLE001 - the outcome is what we pin
        return describe_error(err, first_line=True)
    if isinstance(model, FSDPModule):
        model.reshard()
    kept = torch.equal(get_model_state_dict(model, options=full)["0.weight"], new_weight)
    return "returned; after reshard the weight is " + ("the loaded one" if kept else "LOST")


def tied_module_worker() -> dict[str, str]:
    def run(_label: str) -> str:
        model = _tied_model()
        model(torch.arange(4))  # FSDP2 registers its hooks at lazy init
        qualnames = [
            getattr(hook, "__qualname__", None) for hook in model[0]._state_dict_pre_hooks.values()
        ]
        return "\n".join([
            # The backport-only extension calls FSDP2's hook by this name.
            f"the backport finds its hook on model[0]: {_FSDP2_TO_SHARDED_HOOK in qualnames}",
            f"hooks on model[0] (embedding, owner): {_hooks(model[0])}",
            f"hooks on model[1] (head, shares the weight): {_hooks(model[1])}",
            f"full load into model[0] after a no_grad forward: {_load_into(0)}",
            f"full load into model[1] after a no_grad forward: {_load_into(1)}",
            (
                "the same, hooks registered on shared modules as proposed: "
                f"{_load_into(1, proposed_fix=True)}"
            ),
        ])

    return unpatched_then_patched(run)


class FSDP2TiedModuleHooksTest(expecttest.TestCase):
    def test_secondary_module_of_tied_weights(self) -> None:
        result = run_agreed(2, tied_module_worker)
        self.assertExpectedInline(result["unpatched"], """\
the backport finds its hook on model[0]: True
hooks on model[0] (embedding, owner): to_sharded_hook, to_sharded_hook
hooks on model[1] (head, shares the weight): none
full load into model[0] after a no_grad forward: RuntimeError: Error(s) in loading state_dict for Embedding:
full load into model[1] after a no_grad forward: returned; after reshard the weight is LOST
the same, hooks registered on shared modules as proposed: RuntimeError: Error(s) in loading state_dict for Linear:""")
        self.assertExpectedInline(result["patched"], """\
the backport finds its hook on model[0]: True
hooks on model[0] (embedding, owner): to_sharded_hook, to_sharded_hook
hooks on model[1] (head, shares the weight): none
full load into model[0] after a no_grad forward: returned; after reshard the weight is the loaded one
full load into model[1] after a no_grad forward: returned; after reshard the weight is LOST
the same, hooks registered on shared modules as proposed: returned; after reshard the weight is the loaded one""")


if __name__ == "__main__":
    unittest.main()
