"""torch 2.7: the bug is wider there, and the fix covers it, on 2 CPU ranks.

FSDP2 on 2.7 never reshards the root group after a forward, whatever its
``reshard_after_forward`` (``_fsdp_state.py`` sets the root's
``post_forward_mesh_info`` to None; an explicit ``True`` on the root is honoured
from 2.8, pytorch#154704/#155319), so every call that maps a root-group parameter
fails after an evaluation. ``reshard_after_forward=None`` is rejected there.
Each case runs the six calls after a ``no_grad`` evaluation, first on torch as
installed, then after ``backport.apply()``; "ok" means the exact reference state.
The rest of the suite builds its root with ``None``, so the 2.7.1 nox session runs
this file and the version-independent ones.
"""

import unittest

import expecttest
import pytest

from _fsdp_cases import (
    Case,
    build,
    render_outcome_groups,
    run_agreed,
    run_case,
    unpatched_then_patched,
)
from _ranks import run_ranks
from _versions import IS_TORCH_27


pytestmark = [pytest.mark.ranks, pytest.mark.torch27]


CASES_27 = {
    # An explicit True on the root: resharded after a forward from 2.8 only.
    "root_true": Case(root=True),
    "root_false": Case(root=False),
    "blocks_false_root_true": Case(root=True, blocks=False),
    "tail_group_false": Case(root=True, tail=False),
    "tied_weights_root_true": Case(root=True, tied=True),
    "lora_root_true": Case(root=True, lora=True),
    "full_state_dict_root_true": Case(root=True, options=(("full_state_dict", True),)),
    "unshard_root_true": Case(root=True, unshard=True),
}


def torch27_worker() -> dict[str, str]:
    outcomes = unpatched_then_patched(
        lambda _label: {name: run_case(case) for name, case in CASES_27.items()}
    )
    return {label: render_outcome_groups(result) for label, result in outcomes.items()}


def root_none_worker() -> dict[str, str]:
    def run(_label: str) -> str:
        try:
            build(Case(root=None))
        except ValueError as err:
            return f"ValueError: {str(err)[:60]}..."
        return "accepted"

    return unpatched_then_patched(run)


@unittest.skipUnless(IS_TORCH_27, "torch 2.7 only (nox: tests(torch='2.7.1'))")
class Torch27Test(expecttest.TestCase):
    def test_every_root_group_stays_unsharded(self) -> None:
        result = run_agreed(2, torch27_worker)
        self.assertExpectedInline(result["unpatched"], """\
root_true, root_false, blocks_false_root_true, tail_group_false, tied_weights_root_true, lora_root_true, unshard_root_true:
    get_optim -> KeyError: 0
    set_optim, set_state -> KeyError: <DTensor>
full_state_dict_root_true:
    get_optim -> KeyError: 0
    set_optim, set_state -> KeyError: <DTensor>
    set_model -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:""")
        self.assertExpectedInline(result["patched"], """\
root_true, root_false, blocks_false_root_true, tail_group_false, tied_weights_root_true, lora_root_true, full_state_dict_root_true, unshard_root_true: all 6 calls ok""")

    def test_root_none_is_rejected_with_and_without_the_fix(self) -> None:
        results = run_ranks(2, root_none_worker)
        self.assertEqual(results[0]["patched"], results[0]["unpatched"])
        self.assertExpectedInline(results[0]["unpatched"], """ValueError: reshard_after_forward should be a bool or an int representin...""")


if __name__ == "__main__":
    unittest.main()
