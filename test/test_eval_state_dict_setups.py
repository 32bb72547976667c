"""More FSDP2 setups after an evaluation (or an explicit unshard), on 2 and 4 ranks.

Each case runs the six public DCP state-dict calls and Lightning Fabric's
per-module full load, first on torch as installed and then after
``backport.apply()``. "ok" means the call returned (or restored) exactly the
reference tensors and the next two training steps gave bitwise the losses of
a run that never evaluated or checkpointed.
"""

import unittest

import expecttest
import pytest

from _fsdp_cases import (
    CALLS,
    RAF_INT,
    Case,
    TinyLM,
    _set_model_per_module,
    build,
    get_model_state_dict,
    render_outcomes,
    run_agreed,
    run_case,
    unpatched_then_patched,
)


pytestmark = pytest.mark.ranks


FULL = (("full_state_dict", True),)
FABRIC_LOAD = "set_model_per_module"
SETUPS: dict[str, Case] = {
    "frozen_root_group": Case(frozen=True, tail=True),
    "frozen_root_group_full": Case(frozen=True, tail=True, options=FULL),
    "tied_weights": Case(tied=True),
    "explicit_unshard": Case(unshard=True),
    "explicit_unshard_full": Case(unshard=True, options=FULL),
    "mixed_precision": Case(mixed_precision=True),
    "offload_policy": Case(offload_policy=True),
    "checkpoint_wrapper": Case(checkpoint_wrapper=True),
    "compile": Case(compile=True),
}
INT_FROZEN_SETUPS: dict[str, Case] = {
    "raf_int_frozen": Case(root=RAF_INT, blocks=RAF_INT, frozen=True),
    "raf_int_frozen_full": Case(root=RAF_INT, blocks=RAF_INT, frozen=True, options=FULL),
}


def _calls(case: Case) -> dict:
    # Fabric addresses tensors by named_modules() names, which a wrapper changes.
    if case.compile or case.checkpoint_wrapper:
        return CALLS
    return {**CALLS, FABRIC_LOAD: _set_model_per_module}


def setups_worker(setups: dict[str, Case]) -> dict[str, str]:
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
    return {
        "before": render_outcomes(outcomes["unpatched"]),
        "after": render_outcomes(outcomes["patched"]),
        "fqns": "\n".join(fqns),
    }


class EvalStateDictSetupsTest(expecttest.TestCase):
    def test_setups_world_size_2(self) -> None:
        result = run_agreed(2, setups_worker, SETUPS)
        self.assertExpectedInline(result["before"], """\
frozen_root_group: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
frozen_root_group_full: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
frozen_root_group_full: set_model, set_state -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:
tied_weights: get_optim -> KeyError: 0
tied_weights: set_optim, set_state -> KeyError: <DTensor>
tied_weights: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
explicit_unshard: get_optim -> KeyError: 0
explicit_unshard: set_optim, set_state -> KeyError: <DTensor>
explicit_unshard: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
explicit_unshard_full: get_optim -> KeyError: 0
explicit_unshard_full: set_optim, set_state -> KeyError: <DTensor>
explicit_unshard_full: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
explicit_unshard_full: set_model -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:
mixed_precision: get_optim -> KeyError: 0
mixed_precision: set_optim, set_state -> KeyError: <DTensor>
mixed_precision: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
offload_policy: get_optim -> KeyError: 0
offload_policy: set_optim, set_state -> KeyError: <DTensor>
offload_policy: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
checkpoint_wrapper: get_optim -> KeyError: 0
checkpoint_wrapper: set_optim, set_state -> KeyError: <DTensor>
compile: get_optim -> KeyError: 0
compile: set_optim, set_state -> KeyError: <DTensor>""")
        self.assertExpectedInline(result["after"], """\
frozen_root_group: all 7 calls ok
frozen_root_group_full: all 7 calls ok
tied_weights: all 7 calls ok
explicit_unshard: all 7 calls ok
explicit_unshard_full: all 7 calls ok
mixed_precision: all 7 calls ok
offload_policy: all 7 calls ok
checkpoint_wrapper: all 6 calls ok
compile: all 6 calls ok""")
        self.assertExpectedInline(result["fqns"], """\
checkpoint_wrapper: FQNs same as the unwrapped model
compile: FQNs same as the unwrapped model""")

    def test_reshard_after_forward_int_frozen_world_size_4(self) -> None:
        result = run_agreed(4, setups_worker, INT_FROZEN_SETUPS)
        self.assertExpectedInline(result["before"], """\
raf_int_frozen: get_optim -> KeyError: 0
raf_int_frozen: set_optim, set_state -> KeyError: <DTensor>
raf_int_frozen: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
raf_int_frozen_full: get_optim -> KeyError: 0
raf_int_frozen_full: set_optim, set_state -> KeyError: <DTensor>
raf_int_frozen_full: set_model_per_module -> RuntimeError: Error(s) in loading state_dict for Embedding:
raf_int_frozen_full: set_model -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:""")
        self.assertExpectedInline(result["after"], """\
raf_int_frozen: all 7 calls ok
raf_int_frozen_full: all 7 calls ok""")


if __name__ == "__main__":
    unittest.main()
