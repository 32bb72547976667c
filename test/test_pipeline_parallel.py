"""FSDP2 composed with pipeline parallelism: DCP calls on a stage module after an evaluation.

As torchtitan does with PP + FSDP2, each rank of a ("pp", "dp") mesh holds one
stage of TinyLM, sharded with ``reshard_after_forward=False`` over "dp", and
passes its stage module to the state-dict functions. A forward-only
``schedule.eval()`` leaves the stage unsharded. Each of the six calls runs on
torch as installed and again after ``backport.apply()`` and is compared with
the stage's state before the evaluation exactly; then the pipeline trains on.
"""

import functools
import unittest

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor

from _fsdp_cases import (
    CALLS,
    StateDictOptions,
    TinyLM,
    batch,
    call_after_evaluation,
    render_outcomes,
    run_agreed,
    unpatched_then_patched,
)


pytestmark = pytest.mark.ranks

N_STAGES = 2


class StageModule(nn.Module):
    """One of two pipeline stages of TinyLM: embedding and block 0, or block 1 to head."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        full = TinyLM()
        self.embed = full.embed if stage == 0 else None
        self.blocks = nn.ModuleList([full.blocks[stage]])
        self.norm = full.norm if stage == N_STAGES - 1 else None
        self.head = full.head if stage == N_STAGES - 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for block in self.blocks:
            h = block(h)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Pipeline:
    """This rank's stage, sharded over "dp", its schedule and its optimizer."""

    def __init__(self) -> None:
        world_size = dist.get_world_size()
        mesh = init_device_mesh(
            "cpu", (N_STAGES, world_size // N_STAGES), mesh_dim_names=("pp", "dp")
        )
        self.stage_index = mesh["pp"].get_local_rank()
        self.module = StageModule(self.stage_index)
        # torchtitan's default with PP: no reshard after forward.
        for block in self.module.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(self.module, mesh=mesh["dp"], reshard_after_forward=False)
        stage = PipelineStage(
            self.module,
            self.stage_index,
            N_STAGES,
            torch.device("cpu"),
            group=mesh["pp"].get_group(),
        )
        self.schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=_loss)
        self.optims = [torch.optim.AdamW(self.module.parameters(), lr=1e-2)]

    def _run(self, run, step: int) -> None:
        tokens, targets = batch(step)
        if self.stage_index == 0:
            run(tokens)
        else:
            run(target=targets, losses=[])

    def train_step(self, step: int) -> None:
        self._run(self.schedule.step, step)
        for optim in self.optims:
            optim.step()
            optim.zero_grad()

    def evaluate(self, schedule: bool) -> None:
        """A forward-only pass: the schedule's eval(), or the stage module's own forward."""
        with torch.no_grad():
            if schedule:
                self._run(self.schedule.eval, -1)
            elif self.stage_index == 0:
                self.module(batch(-1)[0])
            else:
                self.module(torch.ones(4, 6, 8))

    def is_unsharded(self) -> bool:
        return not isinstance(next(self.module.parameters()), DTensor)


def _outcome(pipeline: Pipeline, call_name: str, schedule: bool) -> str:
    pipeline.train_step(0)
    return call_after_evaluation(
        pipeline.module,
        pipeline.optims,
        StateDictOptions(),
        call_name,
        functools.partial(pipeline.evaluate, schedule),
    )


def pipeline_worker() -> dict[str, str]:
    def render(_label: str) -> str:
        world_size = dist.get_world_size()
        results: dict[str, dict[str, str]] = {}
        for schedule in (True, False):
            evaluation = "schedule.eval()" if schedule else "stage forward"
            for call_name in CALLS:
                pipeline = Pipeline()
                # Each stage's outcome, the same list on every rank.
                outcomes = [None] * world_size
                dist.all_gather_object(outcomes, _outcome(pipeline, call_name, schedule))
                if all(outcome == "ok" for outcome in outcomes):
                    # Every stage made the call: the pipeline trains on.
                    pipeline.train_step(1)
                for stage, outcome in enumerate(outcomes[:: world_size // N_STAGES]):
                    results.setdefault(f"{evaluation}, stage {stage}", {})[call_name] = outcome
        return render_outcomes(results)

    return unpatched_then_patched(render)


def schedule_eval_leaves_stage_unsharded() -> bool:
    pipeline = Pipeline()
    pipeline.train_step(0)
    pipeline.evaluate(schedule=True)
    return pipeline.is_unsharded()


class PipelineParallelTest(expecttest.TestCase):
    def test_world_size_2(self) -> None:
        result = run_agreed(2, pipeline_worker)
        self.assertExpectedInline(
            result["patched"],
            """\
schedule.eval(), stage 0: all 6 calls ok
schedule.eval(), stage 1: all 6 calls ok
stage forward, stage 0: all 6 calls ok
stage forward, stage 1: all 6 calls ok""",
        )
        # On some releases the schedule reshards FSDP2 at the end of eval() (a
        # control there), on others it leaves the stage unsharded (a bug case).
        if run_agreed(2, schedule_eval_leaves_stage_unsharded):
            self.assertExpectedInline(
                result["unpatched"],
                """\
schedule.eval(), stage 0: get_optim -> KeyError: 0
schedule.eval(), stage 0: set_optim, set_state -> KeyError: <DTensor>
schedule.eval(), stage 1: get_optim -> KeyError: 0
schedule.eval(), stage 1: set_optim, set_state -> KeyError: <DTensor>
stage forward, stage 0: get_optim -> KeyError: 0
stage forward, stage 0: set_optim, set_state -> KeyError: <DTensor>
stage forward, stage 1: get_optim -> KeyError: 0
stage forward, stage 1: set_optim, set_state -> KeyError: <DTensor>""",
            )
        else:
            self.assertExpectedInline(
                result["unpatched"],
                """\
schedule.eval(), stage 0: all 6 calls ok
schedule.eval(), stage 1: all 6 calls ok
stage forward, stage 0: get_optim -> KeyError: 0
stage forward, stage 0: set_optim, set_state -> KeyError: <DTensor>
stage forward, stage 1: get_optim -> KeyError: 0
stage forward, stage 1: set_optim, set_state -> KeyError: <DTensor>""",
            )


if __name__ == "__main__":
    unittest.main()
