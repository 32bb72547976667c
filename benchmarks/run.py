"""What the fix costs: the no-op check, call overhead, resharding after eval, a full checkpoint.

    python benchmarks/run.py                 # sizes 10 100 1000, 1 and 2 ranks (gloo, CPU)
    python benchmarks/run.py --sizes 10 100 1000 3000 --ranks 1 2 4

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


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import backport  # noqa: E402
from backport._launch import run_ranks  # noqa: E402


CALLS = ("get_optimizer_state_dict", "set_optimizer_state_dict", "get_state_dict")


def _log(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _quartiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"median": values[0], "p25": values[0], "p75": values[0]}
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": q2, "p25": q1, "p75": q3}


def _build(n_modules: int):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # N sharded layers, and a head owned by the root group: with the root's
    # default reshard_after_forward, the head stays unsharded after an eval forward.
    model = nn.Sequential(
        nn.Sequential(*(nn.Linear(16, 16) for _ in range(n_modules))), nn.Linear(16, 16)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model[0]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inp = torch.randn(4, 16)
    model(inp).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim, inp


def _time(fn, number: int) -> float:
    """Seconds per call of ``fn``, from ``number`` calls."""
    from torch.utils.benchmark import Timer

    return Timer(stmt="fn()", globals={"fn": fn}).timeit(number).median


def _eval_forward(model, inp) -> None:
    import torch

    with torch.no_grad():
        model(inp)


def _interleaved(fn, repeats: int, number: int) -> dict[str, object]:
    """Time ``fn`` with and without the backport, alternating; ratios per pair."""
    import torch.distributed as dist

    with_fix, without_fix, ratios = [], [], []
    for rep in range(repeats):
        pair = {}
        for applied in ((True, False) if rep % 2 else (False, True)):
            backport.apply() if applied else backport.revert()
            dist.barrier()
            pair[applied] = _time(fn, number)
        with_fix.append(pair[True])
        without_fix.append(pair[False])
        ratios.append(pair[True] / pair[False])
    backport.revert()
    return {
        "ratio": _quartiles(ratios),
        "with_fix_ms": statistics.median(with_fix) * 1e3,
        "without_fix_ms": statistics.median(without_fix) * 1e3,
    }


def _bench_size(
    n_modules: int, repeats: int, eval_repeats: int, ckpt_repeats: int, ckpt_dir: str
) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as dsd

    model, optim, inp = _build(n_modules)
    optims = (optim,)
    n_fsdp = n_modules + 1
    n_params = sum(len(g["params"]) for g in optim.param_groups)
    result: dict[str, object] = {"fsdp_modules": n_fsdp, "optim_params": n_params}

    # The no-op path: everything sharded, one lookup per optimizer param.
    info = dsd._verify_options(model, optims, False)
    assert not backport._fsdp_reshard_needed(optims, info)
    number = max(1, 20000 // n_fsdp)
    noop = min(_time(lambda: backport._fsdp_reshard_needed(optims, info), number) for _ in range(5))
    result["noop_us"] = noop * 1e6
    result["noop_us_per_module"] = noop * 1e6 / n_fsdp
    # The alternative: reshard every FSDP module on every call.
    walk = min(_time(lambda: backport._reshard_fsdp_modules(model), max(1, number // 10)) for _ in range(5))
    result["always_reshard_us_per_module"] = walk * 1e6 / n_fsdp
    _log(f"N={n_fsdp}: no-op check {noop * 1e6:.1f} us ({noop * 1e6 / n_fsdp:.3f} us/module)")

    # Each call with nothing unsharded: with/without the fix, interleaved.
    osd = dsd.get_optimizer_state_dict(model, optim)
    per_call = {
        "get_optimizer_state_dict": lambda: dsd.get_optimizer_state_dict(model, optim),
        "set_optimizer_state_dict": lambda: dsd.set_optimizer_state_dict(model, optim, osd),
        "get_state_dict": lambda: dsd.get_state_dict(model, optim),
    }
    call_number = max(1, 200 // n_fsdp)
    result["calls"] = {}
    for name, fn in per_call.items():
        result["calls"][name] = _interleaved(fn, repeats, call_number)
        ratio = result["calls"][name]["ratio"]
        _log(f"N={n_fsdp}: {name} x{ratio['median']:.4f} [{ratio['p25']:.4f}, {ratio['p75']:.4f}]")
    result["overhead_ratio"] = {name: result["calls"][name]["ratio"] for name in per_call}
    get_ms = result["calls"]["get_optimizer_state_dict"]["without_fix_ms"]
    result["noop_fraction_of_get_optimizer_state_dict"] = noop * 1e3 / get_ms

    # After an evaluation: the reshard itself, and the all-gather the next forward pays.
    reshard, fwd_unsharded, fwd_resharded, get_after_eval = [], [], [], []
    backport.apply()
    for _ in range(eval_repeats):
        _eval_forward(model, inp)
        start = time.perf_counter()
        backport._reshard_fsdp_modules(model)
        reshard.append(time.perf_counter() - start)
        _eval_forward(model, inp)  # root unsharded again
        fwd_unsharded.append(_time(lambda: _eval_forward(model, inp), 1))
        backport._reshard_fsdp_modules(model)
        dist.barrier()
        start = time.perf_counter()
        _eval_forward(model, inp)  # the root all-gathers first
        fwd_resharded.append(time.perf_counter() - start)
        _eval_forward(model, inp)
        info = backport.get_original()(model, optims, True)
        assert backport._fsdp_reshard_needed(optims, info), "the eval left nothing unsharded"
        dist.barrier()
        start = time.perf_counter()
        dsd.get_optimizer_state_dict(model, optim)  # slow path: check, walk, rebuild
        get_after_eval.append(time.perf_counter() - start)
    backport.revert()
    result["after_eval"] = {
        "reshard_us": statistics.median(reshard) * 1e6,
        "reshard_us_per_module": statistics.median(reshard) * 1e6 / n_fsdp,
        "next_forward_us_root_unsharded": statistics.median(fwd_unsharded) * 1e6,
        "next_forward_us_after_reshard": statistics.median(fwd_resharded) * 1e6,
        "get_optimizer_state_dict_ms": statistics.median(get_after_eval) * 1e3,
        "get_optimizer_state_dict_ratio_to_noop_path": statistics.median(get_after_eval)
        * 1e3
        / result["calls"]["get_optimizer_state_dict"]["with_fix_ms"],
    }
    _log(f"N={n_fsdp}: after eval, reshard {result['after_eval']['reshard_us']:.0f} us")

    # A full checkpoint: get_state_dict + dcp.save, nothing unsharded.
    def checkpoint() -> None:
        msd, osd_ = dsd.get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd_}, checkpoint_id=ckpt_dir)

    result["checkpoint"] = _interleaved(checkpoint, ckpt_repeats, 1)
    result["overhead_ratio"]["checkpoint"] = result["checkpoint"]["ratio"]
    _log(f"N={n_fsdp}: checkpoint x{result['checkpoint']['ratio']['median']:.4f}")
    return result


def _worker(sizes, repeats, eval_repeats, ckpt_repeats, ckpt_dir) -> dict:
    return {
        f"N={n + 1}": _bench_size(n, repeats, eval_repeats, ckpt_repeats, f"{ckpt_dir}/{n}")
        for n in sizes
    }


def _markdown(report: dict) -> str:
    lines = [
        f"torch {report['torch']} | {report['status']}",
        f"command: `{report['command']}`",
        "",
        "| ranks | FSDP modules | no-op µs | no-op µs/module | no-op % of get_osd | always-reshard µs/module "
        "| get_osd × | set_osd × | get_state_dict × | checkpoint × | reshard after eval µs | next forward µs (unsharded → resharded) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(r: dict) -> str:
        return f"{r['median']:.3f} [{r['p25']:.3f}, {r['p75']:.3f}]"

    for ranks, sizes in report["results"].items():
        for res in sizes.values():
            o = res["overhead_ratio"]
            a = res["after_eval"]
            lines.append(
                f"| {ranks.split('=')[1]} | {res['fsdp_modules']} | {res['noop_us']:.1f} "
                f"| {res['noop_us_per_module']:.3f} | {100 * res['noop_fraction_of_get_optimizer_state_dict']:.2f}% "
                f"| {res['always_reshard_us_per_module']:.2f} "
                f"| {ratio(o['get_optimizer_state_dict'])} | {ratio(o['set_optimizer_state_dict'])} "
                f"| {ratio(o['get_state_dict'])} | {ratio(o['checkpoint'])} | {a['reshard_us']:.0f} "
                f"| {a['next_forward_us_root_unsharded']:.0f} → {a['next_forward_us_after_reshard']:.0f} |"
            )
    lines += [
        "",
        "× = median of per-pair ratios (with fix / without), quartiles in brackets; nothing unsharded.",
    ]
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ranks, sizes in report["results"].items():
        xs = [res["fsdp_modules"] for res in sizes.values()]
        ax.plot(xs, [100 * r["noop_fraction_of_get_optimizer_state_dict"] for r in sizes.values()],
                marker="o", label=f"no-op check / get_osd ({ranks})")
        for call in ("get_optimizer_state_dict", "set_optimizer_state_dict"):
            ys = [100 * (r["overhead_ratio"][call]["median"] - 1) for r in sizes.values()]
            ax.plot(xs, ys, marker=".", linestyle="--", label=f"{call} overhead ({ranks})")
    ax.axhline(1.0, color="red", linewidth=0.8, label="1% goal")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("FSDP modules")
    ax.set_ylabel("overhead of the fix, % (nothing unsharded)")
    ax.set_title(f"torch {report['torch']}, CPU gloo")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000],
                        help="FSDP-wrapped layers (the root adds one FSDP module)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--eval-repeats", type=int, default=5)
    parser.add_argument("--checkpoint-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    import torch

    report = {
        "torch": str(torch.__version__),
        "status": backport.status(),
        "command": " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "results": {},
    }
    print(f"torch {report['torch']}\n{report['status']}", flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for ranks in args.ranks:
            print(f"ranks={ranks}: sizes {args.sizes} ...", flush=True)
            report["results"][f"ranks={ranks}"] = run_ranks(
                ranks, _worker, args.sizes, args.repeats, args.eval_repeats,
                args.checkpoint_repeats, ckpt_dir,
                timeout=1800,
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
