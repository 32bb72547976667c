"""Every public DCP state-dict call after an evaluation forward, on 1, 2 and 4 ranks.

Each case trains one step, records the state dicts while every FSDP2 group is
sharded (the reference), evaluates under no_grad/inference_mode and then makes
one of the six calls. "ok" means the call returned (or, for a set call,
restored) exactly the reference tensors. The same process runs every case
first on the unpatched torch, then after ``backport.apply()``.
"""

import unittest

import expecttest
import pytest

from _fsdp_cases import has_replicate, matrix_worker
from _ranks import run_ranks


pytestmark = pytest.mark.ranks


class EvalStateDictMatrixTest(expecttest.TestCase):
    def _check(self, world_size: int) -> None:
        results = run_ranks(world_size, matrix_worker, has_replicate())
        for rank, result in enumerate(results):
            self.assertEqual(result, results[0], f"rank {rank} disagrees with rank 0")
        result = results[0]
        # Without the fix: every optimizer call fails, and so does a full
        # model state dict load. get_state_dict passes only because
        # model.state_dict() reshards through FSDP2's hooks first.
        self.assertExpectedInline(result["before"], """\
root_none, root_false, tied_weights, raf_int, hsdp, lora_root_group, multi_optim_groups, inference_mode, cpu_offload, flatten_optimizer_state_dict:
    get_optim -> KeyError: 0
    set_optim, set_state -> KeyError: <DTensor>
blocks_false_root_true:
    get_optim -> KeyError: 1
    set_optim, set_state -> KeyError: <DTensor>
tail_group_false:
    get_optim -> KeyError: 9
    set_optim, set_state -> KeyError: <DTensor>
full_state_dict, full_cpu_offload, broadcast_from_rank0:
    get_optim -> KeyError: 0
    set_optim, set_state -> KeyError: <DTensor>
    set_model -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:""")
        self.assertExpectedInline(result["after"], """\
root_none, root_false, blocks_false_root_true, tail_group_false, tied_weights, raf_int, hsdp, lora_root_group, multi_optim_groups, inference_mode, full_state_dict, cpu_offload, full_cpu_offload, broadcast_from_rank0, flatten_optimizer_state_dict: all 6 calls ok""")
        if not has_replicate():
            return
        # replicate() builds on FSDPModule and fails the same way.
        self.assertExpectedInline(result["replicate before"], """\
replicate: get_optim -> KeyError: 0
replicate: set_optim, set_state -> KeyError: <DTensor>""")
        self.assertExpectedInline(result["replicate after"], """replicate: all 6 calls ok""")

    def test_world_size_1(self) -> None:
        self._check(1)

    def test_world_size_2(self) -> None:
        self._check(2)

    def test_world_size_4(self) -> None:
        self._check(4)


if __name__ == "__main__":
    unittest.main()
