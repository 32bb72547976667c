"""torchtitan's OptimizersContainer saved and loaded with DCP right after a no_grad evaluation.

    torchrun --nproc-per-node 2 repro.py [stock|reshard|backport]

2 CPU ranks, gloo. A decoder-shaped model sharded with ``fully_shard`` (blocks, then the root
with its default ``reshard_after_forward``, which leaves the root's group unsharded after a
forward), one AdamW step through torchtitan's own ``OptimizersContainer``, a ``no_grad``
evaluation, then ``dcp.save`` and, after another evaluation, ``dcp.load`` of
``{"optimizer": container}``: the path ``CheckpointManager.save`` takes for the optimizer.
Runs on torchtitan 0.2.x and 0.3.x (their constructors differ).

stock:    nothing between the evaluation and the checkpoint.
reshard:  ``reshard()`` on every ``FSDPModule``, on every rank, after each evaluation.
backport: ``backport.apply()`` at the start (``backport/__init__.py`` of
          fsdp2-dcp-eval-backport on the path).
"""

import sys
import tempfile
from importlib.metadata import version

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard


MODE = sys.argv[1] if len(sys.argv) > 1 else "stock"
TITAN = version("torchtitan")
VOCAB, DIM = 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(torch.relu(self.attn(h)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def optimizers_container(model: nn.Module):
    if TITAN.startswith("0.2."):
        from torchtitan.components.optimizer import OptimizersContainer

        return OptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-2})
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    config = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    )
    return OptimizersContainer(config, model_parts=[model])


def evaluate(model: nn.Module) -> None:
    model.eval()
    with torch.no_grad():
        model(torch.arange(8).view(2, 4))
    model.train()
    if MODE == "reshard":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def first_line(call) -> str:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the outcome is what is printed
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return "ok"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if MODE == "backport":
        import backport

        backport.apply()
    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: unsharded after a forward
    optimizers = optimizers_container(model)
    tokens = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizers.step()
    optimizers.zero_grad()
    before = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in optimizers.state_dict().items()
        if isinstance(v, torch.Tensor)
    }

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    evaluate(model)
    saved = first_line(lambda: dcp.save({"optimizer": optimizers}, checkpoint_id=folder[0]))
    print(f"[rank{rank}] torch {torch.__version__}, torchtitan {TITAN}, {MODE}: "
          f"dcp.save after evaluation -> {saved}", flush=True)
    if saved == "ok":
        with torch.no_grad():
            for optim in optimizers.optimizers:
                for state in optim.state.values():
                    for value in state.values():
                        value.add_(1.0)
        evaluate(model)
        loaded = first_line(lambda: dcp.load({"optimizer": optimizers}, checkpoint_id=folder[0]))
        if loaded == "ok":
            after = optimizers.state_dict()
            same = all(
                torch.equal(
                    after[k].full_tensor() if hasattr(after[k], "full_tensor") else after[k],
                    v,
                )
                for k, v in before.items()
            )
            loaded += ", optimizer state restored " + ("exactly" if same else "WRONG")
        print(f"[rank{rank}] dcp.load after evaluation -> {loaded}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
