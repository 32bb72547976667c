"""Randomized differential check of ``backport.apply()`` on real ranks.

Each configuration of ``fuzz_configs.py`` runs three times on every rank, from
the same seeded initial state:

- ``stock``: torch as installed;
- ``reference``: torch as installed, with every FSDP2 module of the whole model
  resharded (``FSDPModule.reshard()``) right before each state-dict call;
- ``fix``: after ``backport.apply()`` (``revert()`` after it).

Every outcome is recorded: each loss, each evaluation's output, each returned
state dict leaf by leaf (the rank's local shard, its type, placements, dtype,
shape and a SHA-256 of its bytes), each exception's type and first line, and at
the end every parameter and optimizer state. Where stock works, the fix must
give exactly stock's outcome; where stock fails (raises, dies or hangs) and the
reference works, the fix must give exactly the reference's outcome; where both
fail, the fix must give one of theirs. Only the documented changes of the
backport (``RULES``) are accepted otherwise, each as a narrow named rule.

This file is the command line and the report; ``fuzz_runner.py`` builds and
runs the configurations on ranks and records them, with the clone, leaf walk,
error text and meshes of ``_fsdp_cases.py``; ``fuzz_rules.py`` holds
``classify`` and ``RULES``.

    python test/fuzz_differential.py --seeds 0-3 --n 20       # 4 x 20 configurations
    python test/fuzz_differential.py --repro 2:7               # a standalone script for one
    python test/fuzz_differential.py --seeds 0 --n 20 --broken skip_apply   # negative control

A configuration that kills or hangs a rank ends its world: the ranks log every
finished run to a file, and the batch goes on in a fresh world after the run
that died, recorded as ``died`` (or ``hang``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from typing import Any


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuzz_configs import make_config

# The check's API as before the split: the repro scripts call these by this name.
from fuzz_rules import RULES, classify  # noqa: F401
from fuzz_runner import BROKEN_FIXES, MODES, run_configs  # noqa: F401


# ---------------------------------------------------------------- reports


def check(
    pairs: list[tuple[int, int]], world_size: int = 2, broken: str | None = None,
    batch: int = 40, out=sys.stdout, surface: bool = True,
) -> dict[str, Any]:
    """Run and classify configurations (seed, index); print a line per finding and the counts.

    ``surface=False`` draws them without ``fuzz_surface.py``'s axes.
    """
    start = time.monotonic()
    findings = []
    counts: Counter = Counter()
    for first in range(0, len(pairs), batch):
        chunk = pairs[first:first + batch]
        configs = [make_config(seed, index, world_size, surface) for seed, index in chunk]
        results = run_configs(configs, world_size, broken)
        for seed, index in chunk:
            config = make_config(seed, index, world_size, surface)
            verdict = classify(config, results[(seed, index)])
            counts["configurations"] += 1
            counts[f"kind {verdict['kind']}"] += 1
            statuses = {o["status"] for o in results[(seed, index)]["stock"]}
            if statuses & {"died", "hang"}:
                counts["stock died or hung"] += 1
            if verdict["kind"] == "both fail":
                counts[f"reference fails: {_failure_of(results[(seed, index)]['reference'][0])}"] += 1
            for axis in config["surface"] if surface else ():
                counts[f"axis {axis}"] += 1
                counts[f"axis {axis}: {verdict['kind']}"] += 1
                if verdict["verdict"] == "divergence":
                    counts[f"axis {axis}: divergences"] += 1
            if verdict["verdict"] == "divergence":
                counts["divergences"] += 1
                findings.append((seed, index, verdict))
            elif verdict["verdict"].startswith("documented"):
                counts["documented outcomes"] += 1
                counts[verdict["verdict"]] += 1
            if verdict["verdict"] != "same":
                print(f"{seed}:{index} {verdict['kind']}: {verdict['verdict']} "
                      f"(rank {verdict['rank']}, record {verdict['at']} vs "
                      f"{verdict['against']}) {verdict['detail']}", file=out, flush=True)
    elapsed = time.monotonic() - start
    print(render_counts(counts, elapsed, world_size, broken), file=out, flush=True)
    if findings:
        print("reproduce one: python test/fuzz_differential.py --repro "
              f"{findings[0][0]}:{findings[0][1]} --world {world_size} > repro.py", file=out)
    return {"counts": counts, "findings": findings, "seconds": elapsed}


def _failure_of(outcome: dict) -> str:
    if outcome["status"] != "raised":
        return outcome["status"]
    return outcome["records"][-1][2][:90]


def render_counts(counts: Counter, elapsed: float, world_size: int, broken: str | None) -> str:
    lines = [
        f"world size {world_size}" + (f", broken fix {broken!r}" if broken else "")
        + f": {counts['configurations']} configurations in {elapsed:.0f} s",
        f"  stock fails (bug cases, reference works): {counts['kind bug']}",
        f"  stock works (controls): {counts['kind control']}",
        f"  stock died or hung: {counts['stock died or hung']}",
        f"  stock and reference both fail: {counts['kind both fail']}",
        f"  documented outcomes: {counts['documented outcomes']}",
    ]
    lines += [f"    {key}: {value}" for key, value in sorted(counts.items())
              if key.startswith("documented: ")]
    lines += [f"    {key}: {value}" for key, value in sorted(counts.items())
              if key.startswith("reference fails: ")]
    lines.append(f"  divergences: {counts['divergences']}")
    axes = [key[len("axis "):] for key in counts if key.startswith("axis ") and ":" not in key]
    if axes:
        lines.append("  FSDP2 surface axes (configurations: bug / control / both fail, divergences):")
    for axis in sorted(axes):
        lines.append(
            f"    {axis}: {counts[f'axis {axis}']}: {counts[f'axis {axis}: bug']} / "
            f"{counts[f'axis {axis}: control']} / {counts[f'axis {axis}: both fail']}, "
            f"{counts[f'axis {axis}: divergences']}"
        )
    return "\n".join(lines)


_REPRO = '''\
"""Configuration {seed}:{index} of test/fuzz_differential.py, on {world_size} ranks.

Run from the repository root: python this_file.py
Prints each mode's outcome on rank 0 and the verdict. Edit CONFIG to shrink it.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "test"))
sys.path.insert(0, os.getcwd())

import fuzz_differential

CONFIG = {config}


def main() -> None:
    results = fuzz_differential.run_configs([CONFIG], {world_size})
    outcomes = results[(CONFIG["seed"], CONFIG["index"])]
    for mode, by_rank in outcomes.items():
        print(f"--- {{mode}} (rank 0): {{by_rank[0]['status']}}")
        for record in by_rank[0]["records"]:
            print("   ", json.dumps(record)[:300])
    print(fuzz_differential.classify(CONFIG, outcomes))


if __name__ == "__main__":
    main()
'''


def repro_script(seed: int, index: int, world_size: int, surface: bool = True) -> str:
    """A script that runs configuration ``seed:index`` alone, its config written out."""
    import pprint

    config = make_config(seed, index, world_size, surface)
    return _REPRO.format(
        seed=seed, index=index, world_size=world_size,
        config=pprint.pformat(config, width=100, sort_dicts=False),
    )


def _parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="A-B (inclusive) or A,B,C")
    parser.add_argument("--n", type=int, default=20, help="configurations per seed")
    parser.add_argument("--world", type=int, default=2, help="ranks (2 or 4)")
    parser.add_argument("--batch", type=int, default=40, help="configurations per world of ranks")
    parser.add_argument("--broken", choices=BROKEN_FIXES, help="a deliberately broken fix")
    parser.add_argument("--repro", metavar="SEED:INDEX", help="print a standalone script for one")
    parser.add_argument("--without-surface", action="store_true",
                        help="without fuzz_surface.py's axes, as runs before them drew")
    args = parser.parse_args(argv)
    if args.repro:
        seed, index = (int(part) for part in args.repro.split(":"))
        print(repro_script(seed, index, args.world, not args.without_surface))
        return 0
    pairs = [(seed, index) for seed in _parse_seeds(args.seeds) for index in range(args.n)]
    report = check(pairs, args.world, args.broken, args.batch, surface=not args.without_surface)
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
