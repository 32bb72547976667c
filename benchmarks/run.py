"""What the fix costs: the series per call, against the plain loop, and in a real checkpoint.

    python benchmarks/run.py            # N-layer models and a 135M-parameter LM, 1 and 2 ranks
    python benchmarks/run.py --sizes 10 100 1000 --ranks 1 2 4 --llm-dim 512 --llm-blocks 32

Writes ``bench.json``, ``bench.md`` and ``overhead.png`` to ``--out``
(default ``benchmarks/results``). Key meanings are in benchmarks/README.md.
Every with/without pair is measured interleaved in one process, alternating
which goes first, and reported as the median ratio with its quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
# The ranks come from the tests' harness, test/_ranks.py.
sys.path[:0] = [str(ROOT), str(ROOT / "test")]

import backport
from _ranks import run_ranks


def _log(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _quartiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"median": values[0], "p25": values[0], "p75": values[0]}
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": q2, "p25": q1, "p75": q3}


def _train_one_step(model, optim, inp) -> None:
    model(inp).float().sum().backward()
    optim.step()
    optim.zero_grad()


def _build_layers(n_modules: int):
    """N sharded Linear layers and a head owned by the root group."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # With the root's default reshard_after_forward the head stays unsharded
    # after an eval forward.
    model = nn.Sequential(
        nn.Sequential(*(nn.Linear(16, 16) for _ in range(n_modules))), nn.Linear(16, 16)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model[0]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inp = torch.randn(4, 16)
    _train_one_step(model, optim, inp)
    return model, optim, inp


def _build_lm(dim: int, n_blocks: int):
    """A decoder LM in the usual FSDP2 layout: one group per block, the rest in the root."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

        def forward(self, x):
            scores = self.wq(x) @ self.wk(x).transpose(-1, -2) / dim**0.5
            return self.wo(scores.softmax(-1) @ self.wv(x))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(dim, 4 * dim, bias=False)
            self.w3 = nn.Linear(dim, 4 * dim, bias=False)
            self.w2 = nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = nn.LayerNorm(dim)
            self.attention = Attention()
            self.ffn_norm = nn.LayerNorm(dim)
            self.feed_forward = FeedForward()

        def forward(self, x):
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(1024, dim)
            self.layers = nn.ModuleList(Block() for _ in range(n_blocks))
            self.norm = nn.LayerNorm(dim)
            self.output = nn.Linear(dim, 1024, bias=False)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h))

    torch.manual_seed(0)
    model = LM()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inp = torch.randint(0, 1024, (2, 16))
    _train_one_step(model, optim, inp)
    return model, optim, inp


def _time(fn, number: int, setup: str = "pass") -> float:
    """Seconds per call of ``fn``, from ``number`` calls after ``setup``."""
    from torch.utils.benchmark import Timer

    timer = Timer(stmt="fn()", setup=setup, globals={"fn": fn, "os": os})
    return timer.timeit(number).median


def _best(fn, number: int, tries: int = 5) -> float:
    return min(_time(fn, number) for _ in range(tries))


def _eval_forward(model, inp) -> None:
    import torch

    with torch.no_grad():
        model(inp)


def _interleaved(fn, repeats: int, number: int, setup: str = "pass") -> dict[str, object]:
    """Time ``fn`` with and without the backport, alternating; ratios per pair."""
    import torch.distributed as dist

    with_fix, without_fix, ratios = [], [], []
    for rep in range(repeats):
        pair = {}
        for applied in ((True, False) if rep % 2 else (False, True)):
            backport.apply() if applied else backport.revert()
            dist.barrier()
            pair[applied] = _time(fn, number, setup)
        with_fix.append(pair[True])
        without_fix.append(pair[False])
        ratios.append(pair[True] / pair[False])
    backport.revert()
    return {
        "ratio": _quartiles(ratios),
        "with_fix_ms": statistics.median(with_fix) * 1e3,
        "without_fix_ms": statistics.median(without_fix) * 1e3,
    }


def _mechanisms(model, optim) -> dict:
    """What the series runs per call with nothing unsharded, and what it is held to."""
    from itertools import chain

    from torch.distributed.fsdp import FSDPModule

    osd = optim.state_dict()
    params = [param for group in optim.param_groups for param in group["params"]]
    owned = {param for param in model.parameters()}
    fqn_pid_mapping = {pid: pid for pid, param in enumerate(params) if param in owned}

    def optim_check() -> None:
        # What PR B (0002) adds to a get_optimizer_state_dict call that raises
        # nothing: a membership test per parameter id at the two pid -> FQN lookups.
        for pid in chain(osd["state"], *(g["params"] for g in osd["param_groups"])):
            if pid not in fqn_pid_mapping:
                raise AssertionError(pid)

    def plain_loop() -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    return {
        # What the backport adds to _verify_options in an optimizer call: PR A's
        # (0001) reshard loop with its check of the optimizer, and its own
        # plain-module extension (one isinstance for an FSDP root).
        "fix": lambda: (
            backport._reshard_fsdp2_modules(model, (optim,)),
            backport._reshard_fsdp2_groups_of_plain_module(model),
        ),
        # The bound the fix is held to (torchtitan#1173's loop).
        "plain_loop": plain_loop,
        "optim_check": optim_check,
        # For scale: model.state_dict() runs every state-dict hook and builds a dict.
        "state_dict": lambda: model.state_dict(keep_vars=True),
    }


def _fix_to_plain_loop(mechanisms: dict, repeats: int, number: int) -> dict[str, float]:
    """Per-pair ratios of the fix to the plain loop, alternating which goes first."""
    ratios = []
    for rep in range(repeats):
        pair = {}
        for name in ("fix", "plain_loop") if rep % 2 else ("plain_loop", "fix"):
            pair[name] = _time(mechanisms[name], number)
        ratios.append(pair["fix"] / pair["plain_loop"])
    return _quartiles(ratios)


def _series_costs(model, optim, n_fsdp: int, repeats: int) -> dict[str, object]:
    """The mechanisms' µs per FSDP module, the fix/plain-loop ratio, the series' µs per call."""
    mechanisms = _mechanisms(model, optim)
    number = max(1, 20000 // n_fsdp)
    per_module = {name: _best(fn, number) * 1e6 / n_fsdp for name, fn in mechanisms.items()}
    return {
        "mechanism_us_per_fsdp_module": per_module,
        "fix_to_plain_loop": _fix_to_plain_loop(mechanisms, repeats, number),
        # What every call pays: the reshard block and one optimizer check.
        "series_us": (per_module["fix"] + per_module["optim_check"]) * n_fsdp,
    }


def _module_counts(model) -> dict[str, int]:
    from torch.distributed.fsdp import FSDPModule

    modules = list(model.modules())
    return {
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in modules),
        "modules": len(modules),
        # Global sizes: the parameters are sharded DTensors.
        "params": sum(p.numel() for p in model.parameters()),
    }


def _bench_layers(n_modules: int, repeats: int, eval_repeats: int) -> dict:
    import torch.distributed.checkpoint.state_dict as dsd

    model, optim, inp = _build_layers(n_modules)
    result: dict[str, object] = _module_counts(model)
    n_fsdp = result["fsdp_modules"]
    result.update(_series_costs(model, optim, n_fsdp, repeats))
    fix_us = result["series_us"]
    ratio = result["fix_to_plain_loop"]
    _log(f"N={n_fsdp}: series {fix_us:.1f} us, fix / plain loop x{ratio['median']:.3f}")

    # Each call with nothing unsharded: with/without the fix, interleaved.
    osd = dsd.get_optimizer_state_dict(model, optim)
    per_call = {
        "get_optimizer_state_dict": lambda: dsd.get_optimizer_state_dict(model, optim),
        "set_optimizer_state_dict": lambda: dsd.set_optimizer_state_dict(model, optim, osd),
        "get_state_dict": lambda: dsd.get_state_dict(model, optim),
    }
    call_number = max(1, 200 // n_fsdp)
    result["calls"] = {name: _interleaved(fn, repeats, call_number) for name, fn in per_call.items()}
    for name, call in result["calls"].items():
        ratio = call["ratio"]
        _log(f"N={n_fsdp}: {name} x{ratio['median']:.4f} [{ratio['p25']:.4f}, {ratio['p75']:.4f}]")
    get_ms = result["calls"]["get_optimizer_state_dict"]["without_fix_ms"]
    result["series_fraction_of_get_optimizer_state_dict"] = fix_us * 1e-3 / get_ms

    # After an evaluation: the reshard itself, and the all-gather the next forward pays.
    reshard, fwd_unsharded, fwd_resharded, get_after_eval = [], [], [], []
    backport.apply()
    for _ in range(eval_repeats):
        _eval_forward(model, inp)
        start = time.perf_counter()
        backport._reshard_fsdp2_modules(model, ())
        reshard.append(time.perf_counter() - start)
        _eval_forward(model, inp)  # root unsharded again
        fwd_unsharded.append(_time(lambda: _eval_forward(model, inp), 1))
        backport._reshard_fsdp2_modules(model, ())
        start = time.perf_counter()
        _eval_forward(model, inp)  # the root all-gathers first
        fwd_resharded.append(time.perf_counter() - start)
        _eval_forward(model, inp)
        start = time.perf_counter()
        dsd.get_optimizer_state_dict(model, optim)  # reshards, then maps
        get_after_eval.append(time.perf_counter() - start)
    backport.revert()
    result["after_eval"] = {
        "reshard_us": statistics.median(reshard) * 1e6,
        "next_forward_us_root_unsharded": statistics.median(fwd_unsharded) * 1e6,
        "next_forward_us_after_reshard": statistics.median(fwd_resharded) * 1e6,
        "get_optimizer_state_dict_ms": statistics.median(get_after_eval) * 1e3,
        "get_optimizer_state_dict_ratio_to_nothing_unsharded": statistics.median(get_after_eval)
        * 1e3
        / result["calls"]["get_optimizer_state_dict"]["with_fix_ms"],
    }
    _log(f"N={n_fsdp}: after eval, reshard {result['after_eval']['reshard_us']:.0f} us")
    return result


def _bench_lm(dim: int, n_blocks: int, ckpt_repeats: int, ckpt_dir: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as dsd

    model, optim, inp = _build_lm(dim, n_blocks)
    result: dict[str, object] = _module_counts(model)
    n_fsdp = result["fsdp_modules"]
    result.update(_series_costs(model, optim, n_fsdp, ckpt_repeats))
    fix_us = result["series_us"]
    ratio = result["fix_to_plain_loop"]
    _log(f"LM {result['params'] / 1e6:.0f}M params: series {fix_us:.0f} us, "
         f"fix / plain loop x{ratio['median']:.3f}")

    def checkpoint() -> None:
        msd, osd = dsd.get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)

    checkpoint()  # warm up the storage writer and the page cache
    # Flush the last checkpoint's dirty pages first, so no save pays for another.
    result["checkpoint"] = _interleaved(checkpoint, ckpt_repeats, 1, setup="os.sync()")
    ckpt_ms = result["checkpoint"]["without_fix_ms"]
    result["series_fraction_of_checkpoint"] = fix_us * 1e-3 / ckpt_ms
    ratio = result["checkpoint"]["ratio"]
    _log(f"LM checkpoint {ckpt_ms:.0f} ms, x{ratio['median']:.4f}")

    after_eval = []
    backport.apply()
    for _ in range(max(1, ckpt_repeats // 2)):
        _eval_forward(model, inp)
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        checkpoint()
        after_eval.append(time.perf_counter() - start)
    backport.revert()
    result["after_eval"] = {
        "checkpoint_ms": statistics.median(after_eval) * 1e3,
        "checkpoint_ratio_to_nothing_unsharded": statistics.median(after_eval)
        * 1e3
        / result["checkpoint"]["with_fix_ms"],
    }
    return result


def _worker(sizes, repeats, eval_repeats, lm, ckpt_repeats, ckpt_dir) -> dict:
    import warnings

    # Every checkpoint overwrites the last one on purpose.
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    results = {
        f"N={n + 1}": _bench_layers(n, repeats, eval_repeats) for n in sizes
    }
    if lm is not None:
        results["lm"] = _bench_lm(*lm, ckpt_repeats, ckpt_dir)
    return results


def _ratio(r: dict) -> str:
    return f"{r['median']:.3f} [{r['p25']:.3f}, {r['p75']:.3f}]"


def _markdown(report: dict) -> str:
    lines = [
        f"torch {report['torch']} | {report['status']}",
        f"command: `{report['command']}`",
        f"machine: {report['machine']}",
        "",
        (
            "What the series runs per call with nothing unsharded, µs per FSDP module "
            "(best of 5), and the fix's ratio to the plain loop (median of interleaved "
            "pairs, quartiles in brackets):"
        ),
        "",
        (
            "| ranks | model | FSDP modules | fix (0001 + extension) | plain loop | fix / plain loop "
            "| 0002 check | series per call µs | model.state_dict() |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ranks, results in report["results"].items():
        for key, res in results.items():
            m = res["mechanism_us_per_fsdp_module"]
            lines.append(
                f"| {ranks.split('=')[1]} | {'LM' if key == 'lm' else key} "
                f"| {res['fsdp_modules']} | {m['fix']:.2f} | {m['plain_loop']:.2f} "
                f"| {_ratio(res['fix_to_plain_loop'])} | {m['optim_check']:.2f} "
                f"| {res['series_us']:.1f} | {m['state_dict']:.2f} |"
            )
    lines += [
        "",
        (
            "N sharded `Linear` layers plus the root (one nn.Module per FSDP module); whole "
            "calls with / without `backport.apply()`, nothing unsharded:"
        ),
        "",
        (
            "| ranks | FSDP modules | series % of get_osd | get_osd × | set_osd × "
            "| get_state_dict × | reshard after eval µs "
            "| get_osd after eval / nothing unsharded | next forward µs (unsharded → resharded) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ranks, results in report["results"].items():
        for key, res in results.items():
            if key == "lm":
                continue
            c, a = res["calls"], res["after_eval"]
            lines.append(
                f"| {ranks.split('=')[1]} | {res['fsdp_modules']} "
                f"| {100 * res['series_fraction_of_get_optimizer_state_dict']:.2f}% "
                f"| {_ratio(c['get_optimizer_state_dict']['ratio'])} "
                f"| {_ratio(c['set_optimizer_state_dict']['ratio'])} "
                f"| {_ratio(c['get_state_dict']['ratio'])} | {a['reshard_us']:.0f} "
                f"| {a['get_optimizer_state_dict_ratio_to_nothing_unsharded']:.2f} "
                f"| {a['next_forward_us_root_unsharded']:.0f} → {a['next_forward_us_after_reshard']:.0f} |"
            )
    lm_rows = [(ranks, res["lm"]) for ranks, res in report["results"].items() if "lm" in res]
    if lm_rows:
        lines += [
            "",
            (
                "Decoder LM, one FSDP module per block; checkpoint = `get_state_dict` + `dcp.save` "
                "to local disk:"
            ),
            "",
            (
                "| ranks | params | FSDP modules | nn.Modules | series µs | checkpoint ms "
                "| series % of checkpoint | checkpoint × | checkpoint after eval / nothing unsharded |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for ranks, res in lm_rows:
            lines.append(
                f"| {ranks.split('=')[1]} | {res['params'] / 1e6:.1f}M | {res['fsdp_modules']} "
                f"| {res['modules']} | {res['series_us']:.0f} "
                f"| {res['checkpoint']['without_fix_ms']:.0f} "
                f"| {100 * res['series_fraction_of_checkpoint']:.4f}% "
                f"| {_ratio(res['checkpoint']['ratio'])} "
                f"| {res['after_eval']['checkpoint_ratio_to_nothing_unsharded']:.3f} |"
            )
    lines += [
        "",
        "× = median of per-pair ratios (with fix / without), quartiles in brackets.",
    ]
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ranks, results in report["results"].items():
        layers = {k: v for k, v in results.items() if k != "lm"}
        xs = [res["fsdp_modules"] for res in layers.values()]
        for name in ("fix", "plain_loop", "optim_check", "state_dict"):
            ys = [res["mechanism_us_per_fsdp_module"][name] for res in layers.values()]
            ax.plot(xs, ys, marker="o", label=f"{name} ({ranks})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FSDP modules (one Linear each)")
    ax.set_ylabel("µs per FSDP module per call (nothing unsharded)")
    ax.set_title(f"torch {report['torch']}, CPU gloo")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000],
                        help="FSDP-wrapped Linear layers (the root adds one FSDP module)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--eval-repeats", type=int, default=5)
    parser.add_argument("--llm-dim", type=int, default=512, help="0 skips the LM")
    parser.add_argument("--llm-blocks", type=int, default=32)
    parser.add_argument("--llm-ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--checkpoint-repeats", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    import torch

    report = {
        "torch": str(torch.__version__),
        "status": backport.status(),
        "command": " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "results": {},
    }
    print(f"torch {report['torch']}\n{report['status']}", flush=True)
    start = time.monotonic()
    lm = (args.llm_dim, args.llm_blocks) if args.llm_dim else None
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for ranks in sorted(set(args.ranks) | set(args.llm_ranks if lm else [])):
            print(f"ranks={ranks} ...", flush=True)
            report["results"][f"ranks={ranks}"] = run_ranks(
                ranks, _worker,
                args.sizes if ranks in args.ranks else [],
                args.repeats, args.eval_repeats,
                lm if ranks in args.llm_ranks else None,
                args.checkpoint_repeats, f"{ckpt_dir}/ranks{ranks}",
                timeout=3600,
            )[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = _markdown(report)
    (args.out / "bench.md").write_text(markdown)
    _plot(report, args.out / "overhead.png")
    print(markdown)
    print(f"wrote {args.out}/bench.json, bench.md, overhead.png in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
