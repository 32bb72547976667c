"""More FSDP2 setups after an evaluation (or an explicit unshard), on 2 and 4 ranks.

Each case runs the six public DCP state-dict calls and Lightning Fabric's
per-module full load, first on torch as installed and then after
``backport.apply()``. "ok" means the call returned (or restored) exactly the
reference tensors and the next two training steps gave bitwise the losses of
a run that never evaluated or checkpointed.
"""

import dataclasses
import unittest
from typing import Any

import expecttest
import pytest

from _fsdp_cases import (
    CALLS,
    RAF_INT,
    Case,
    TinyLM,
    _set_model_per_module,
    before_after,
    build,
    get_model_state_dict,
    render_outcome_groups,
    run_agreed,
    run_case,
    side_by_side,
    unpatched_then_patched,
)


pytestmark = pytest.mark.ranks


FULL = (("full_state_dict", True),)
FABRIC_LOAD = "set_model_per_module"


def _and_full(name: str, case: Case) -> dict[str, Case]:
    """``case``, and the same with a full state dict under ``name``_full."""
    return {name: case, f"{name}_full": dataclasses.replace(case, options=FULL)}


SETUPS: dict[str, Case] = {
    **_and_full("frozen_root_group", Case(frozen=True, tail=True)),
    "tied_weights": Case(tied=True),
    **_and_full("explicit_unshard", Case(unshard=True)),
    "mixed_precision": Case(mixed_precision=True),
    "offload_policy": Case(offload_policy=True),
    "checkpoint_wrapper": Case(checkpoint_wrapper=True),
    "compile": Case(compile=True),
}
INT_FROZEN_SETUPS = _and_full("raf_int_frozen", Case(root=RAF_INT, blocks=RAF_INT, frozen=True))


def _calls(case: Case) -> dict:
    # Fabric addresses tensors by named_modules() names, which a wrapper changes.
    if case.compile or case.checkpoint_wrapper:
        return CALLS
    return {**CALLS, FABRIC_LOAD: _set_model_per_module}


def setups_worker(setups: dict[str, Case]) -> dict[str, Any]:
    outcomes = unpatched_then_patched(
        lambda _label: {
            name: run_case(case, _calls(case), check_losses=True) for name, case in setups.items()
        }
    )
    # Wrappers must not leak into the FQNs.
    plain_fqns = sorted(TinyLM().state_dict())
    fqns = []
    for name, case in setups.items():
        if case.compile or case.checkpoint_wrapper:
            model, _, options = build(case)
            same = sorted(get_model_state_dict(model, options=options)) == plain_fqns
            fqns.append(f"{name}: FQNs {'same as' if same else 'differ from'} the unwrapped model")
    return {**outcomes, "fqns": "\n".join(fqns)}


class EvalStateDictSetupsTest(expecttest.TestCase):
    def test_setups_world_size_2(self) -> None:
        result = run_agreed(2, setups_worker, SETUPS)
        self.assertExpectedInline(render_outcome_groups(result["unpatched"]), """\
frozen_root_group: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
frozen_root_group_full:
    set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
    set_model, set_state -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:
tied_weights, explicit_unshard, mixed_precision, offload_policy:
    get_optim -> KeyError: 0
    set_optim, set_state -> KeyError: <DTensor>
    set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
explicit_unshard_full:
    get_optim -> KeyError: 0
    set_optim, set_state -> KeyError: <DTensor>
    set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
    set_model -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:
checkpoint_wrapper, compile:
    get_optim -> KeyError: 0
    set_optim, set_state -> KeyError: <DTensor>""")
        self.assertExpectedInline(render_outcome_groups(result["patched"]), """\
frozen_root_group, frozen_root_group_full, tied_weights, explicit_unshard, explicit_unshard_full, mixed_precision, offload_policy: all 7 calls ok
checkpoint_wrapper, compile: all 6 calls ok""")
        self.assertExpectedInline(result["fqns"], """\
checkpoint_wrapper: FQNs same as the unwrapped model
compile: FQNs same as the unwrapped model""")

    def test_reshard_after_forward_int_frozen_world_size_4(self) -> None:
        result = run_agreed(4, setups_worker, INT_FROZEN_SETUPS)
        columns = {
            name: before_after(result["unpatched"][name], result["patched"][name])
            for name in INT_FROZEN_SETUPS
        }
        self.assertExpectedInline(side_by_side(columns, "stock -> backport applied"), """\
stock -> backport applied | raf_int_frozen                                                    | raf_int_frozen_full
get_model                 | ok                                                                | ok
get_optim                 | KeyError: 0 -> ok                                                 | KeyError: 0 -> ok
get_state                 | ok                                                                | ok
set_model                 | ok                                                                | RuntimeError: Error(s) in loading state_dict for FSDPTinyLM: -> ok
set_optim                 | KeyError: <DTensor> -> ok                                         | KeyError: <DTensor> -> ok
set_state                 | KeyError: <DTensor> -> ok                                         | KeyError: <DTensor> -> ok
set_model_per_module      | RuntimeError: Error(s) in loading state_dict for Embedding: -> ok | RuntimeError: Error(s) in loading state_dict for Embedding: -> ok""")


if __name__ == "__main__":
    unittest.main()
