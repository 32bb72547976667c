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
        before, after = results[0]["before"], results[0]["after"]
        # Without the fix: every optimizer call fails, and so does a full
        # model state dict load. get_state_dict passes only because
        # model.state_dict() reshards through FSDP2's hooks first.
        self.assertExpectedInline(
            "\n".join(line for line in before.splitlines() if not line.startswith("replicate")),
            """\
root_none: get_optim -> KeyError: 0
root_none: set_optim, set_state -> KeyError: <DTensor>
root_false: get_optim -> KeyError: 0
root_false: set_optim, set_state -> KeyError: <DTensor>
blocks_false_root_true: get_optim -> KeyError: 1
blocks_false_root_true: set_optim, set_state -> KeyError: <DTensor>
tail_group_false: get_optim -> KeyError: 9
tail_group_false: set_optim, set_state -> KeyError: <DTensor>
tied_weights: get_optim -> KeyError: 0
tied_weights: set_optim, set_state -> KeyError: <DTensor>
raf_int: get_optim -> KeyError: 0
raf_int: set_optim, set_state -> KeyError: <DTensor>
hsdp: get_optim -> KeyError: 0
hsdp: set_optim, set_state -> KeyError: <DTensor>
lora_root_group: get_optim -> KeyError: 0
lora_root_group: set_optim, set_state -> KeyError: <DTensor>
multi_optim_groups: get_optim -> KeyError: 0
multi_optim_groups: set_optim, set_state -> KeyError: <DTensor>
inference_mode: get_optim -> KeyError: 0
inference_mode: set_optim, set_state -> KeyError: <DTensor>
full_state_dict: get_optim -> KeyError: 0
full_state_dict: set_optim, set_state -> KeyError: <DTensor>
full_state_dict: set_model -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:
cpu_offload: get_optim -> KeyError: 0
cpu_offload: set_optim, set_state -> KeyError: <DTensor>
full_cpu_offload: get_optim -> KeyError: 0
full_cpu_offload: set_optim, set_state -> KeyError: <DTensor>
full_cpu_offload: set_model -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:
broadcast_from_rank0: get_optim -> KeyError: 0
broadcast_from_rank0: set_optim, set_state -> KeyError: <DTensor>
broadcast_from_rank0: set_model -> RuntimeError: Error(s) in loading state_dict for FSDPTinyLM:
flatten_optimizer_state_dict: get_optim -> KeyError: 0
flatten_optimizer_state_dict: set_optim, set_state -> KeyError: <DTensor>""",
        )
        self.assertExpectedInline(
            "\n".join(line for line in after.splitlines() if not line.startswith("replicate")),
            """\
root_none: all 6 calls ok
root_false: all 6 calls ok
blocks_false_root_true: all 6 calls ok
tail_group_false: all 6 calls ok
tied_weights: all 6 calls ok
raf_int: all 6 calls ok
hsdp: all 6 calls ok
lora_root_group: all 6 calls ok
multi_optim_groups: all 6 calls ok
inference_mode: all 6 calls ok
full_state_dict: all 6 calls ok
cpu_offload: all 6 calls ok
full_cpu_offload: all 6 calls ok
broadcast_from_rank0: all 6 calls ok
flatten_optimizer_state_dict: all 6 calls ok""",
        )
        if not has_replicate():
            return
        # replicate() builds on FSDPModule and fails the same way.
        self.assertExpectedInline(
            "\n".join(line for line in before.splitlines() if line.startswith("replicate")),
            """\
replicate: get_optim -> KeyError: 0
replicate: set_optim, set_state -> KeyError: <DTensor>""",
        )
        self.assertExpectedInline(
            "\n".join(line for line in after.splitlines() if line.startswith("replicate")),
            """replicate: all 6 calls ok""",
        )

    def test_world_size_1(self) -> None:
        self._check(1)

    def test_world_size_2(self) -> None:
        self._check(2)

    def test_world_size_4(self) -> None:
        self._check(4)


if __name__ == "__main__":
    unittest.main()
