"""The rules of the differential check (``fuzz_differential.py``): ``classify``
compares a configuration's three modes rank by rank; ``RULES`` are the
backport's documented changes, each a narrow named rule.
"""

from __future__ import annotations

import json
from typing import Any

from fuzz_configs import Config
from fuzz_runner import MODES


# ---------------------------------------------------------------- the check


def _failed(outcome: dict) -> bool:
    return outcome["status"] != "ok"


def _first_difference(actual: dict, expected: dict) -> int | None:
    """Index of the first record that differs, or None when identical.

    A run that died left no records: against it, a run's own failure (its last
    record) is where they differ.
    """
    if actual["status"] != expected["status"] and (
        actual["status"] in ("died", "hang") or expected["status"] in ("died", "hang")
    ):
        if actual["status"] == "raised":
            return len(actual["records"]) - 1
        return 0
    a, e = actual["records"], expected["records"]
    for idx in range(max(len(a), len(e))):
        if idx >= len(a) or idx >= len(e) or a[idx] != e[idx]:
            return idx
    return None


def _raised(outcome: dict, idx: int) -> str | None:
    records = outcome["records"]
    if idx < len(records) and records[idx][1] == "raised":
        return records[idx][2]
    return None


def _failing_event(config: Config, outcome: dict, idx: int) -> dict | None:
    """The event of record ``idx``; None for the final state (or wrapping, -1)."""
    records = outcome["records"]
    if idx < len(records) and 0 <= records[idx][0] < len(config["events"]):
        return config["events"][records[idx][0]]
    return None


def _optimizer_built_unsharded(config: Config) -> bool:
    """An evaluation, unshard(), or a backward under set_reshard_after_backward(False)
    left groups unsharded when the optimizers were built."""
    unsharded_by = {"eval", "unshard", "abort"}
    if "reshard_after_backward" in config.get("surface", {}):
        unsharded_by |= {"train", "accumulate"}
    for event in config["events"]:
        if event["do"] == "build_optims":
            return False
        if event["do"] in unsharded_by:
            return True
    return False


def _rule_optimizer_built_after_eval(config, baseline, fix, idx) -> bool:
    """README, "What changes": an optimizer built while groups were unsharded gets PR A's
    ValueError (or, once stepped and resharded, OptimizerParamNotInModelError)."""
    error = _raised(fix, idx)
    event = _failing_event(config, fix, idx)
    return (
        _optimizer_built_unsharded(config)
        and error is not None
        and event is not None
        and event["do"] == "call"
        and event["call"] in ("get_optim", "get_state", "set_optim", "set_state")
        and (
            "has no allocated storage" in error
            or "is an FSDP2 unsharded parameter" in error
            or error.startswith("OptimizerParamNotInModelError:")
            or "holds a parameter that the model does not own" in error
        )
    )


def _rule_unowned_param_error_type(config, baseline, fix, idx) -> bool:
    """README, "What changes": OptimizerParamNotInModelError (a KeyError) where torch
    raised a bare KeyError for an optimizer parameter outside the model."""
    error, base_error = _raised(fix, idx), _raised(baseline, idx)
    return (
        error is not None
        and base_error is not None
        and base_error.startswith("KeyError")
        and (
            error.startswith("OptimizerParamNotInModelError:")
            or "holds a parameter that the model does not own" in error
        )
    )


def _rule_tied_secondary(config, baseline, fix, idx) -> bool:
    """README, Limits: an optimizer call on the secondary module of tied weights
    (the head sharing the embedding's weight) while the group is unsharded
    cannot be fixed: the backport raises a clear error instead."""
    error = _raised(fix, idx)
    event = _failing_event(config, fix, idx)
    return (
        config["model"]["tied"]
        and error is not None
        and event is not None
        and event["do"] == "call"
        and event["target"] == "head"
        and ("tied" in error.lower() or "shared" in error.lower() or "shares" in error.lower())
    )


def _rule_tied_secondary_model_call(config, baseline, fix, idx) -> bool:
    """README, Limits: a model call on the secondary module of tied weights sees
    the group as FSDP2 left it, as with stock torch: while the group is
    unsharded, get_model_state_dict returns the unsharded parameter (a full
    tensor, in the compute dtype under mixed precision) and loading a sharded
    state dict into it fails."""
    event = _failing_event(config, fix, idx)
    if not (config["model"]["tied"] and event is not None and event["do"] == "call"
            and event["target"] == "head" and event["call"] in ("get_model", "set_model")):
        return False
    error = _raised(fix, idx)
    if error is not None:
        return error.startswith("RuntimeError: Error(s) in loading state_dict for Linear")
    record = fix["records"][idx]
    return record[1] == "get_model" and all(
        not leaf[1].startswith("DTensor") for leaf in record[2] if leaf[0].endswith("weight")
    )


def _group_paths(config: Config) -> list[list[str]]:
    """Each FSDP2 group's module paths, indexed as unshard events count them."""
    wrap = config["wrapping"]
    paths = [list(group["modules"]) for group in wrap["groups"]]
    if wrap["root"]["kind"] != "plain":
        paths.append([""])
    return paths


def _is_under(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _rule_group_outside_target(config, baseline, fix, idx) -> bool:
    """README "What it changes": a call on a submodule reshards the FSDP2 groups
    in it and the group owning its own parameters, not the rest of the model as
    the reference does: a tensor held from unshard() of another group stays
    allocated, as with stock torch."""
    records, base = fix["records"], baseline["records"]
    if idx >= len(records) or idx >= len(base) or records[idx][1] != "held":
        return False
    event = _failing_event(config, fix, idx)
    if event is None or event["do"] != "call" or event["target"] == "":
        return False
    target, paths = event["target"], _group_paths(config)
    owner = max(
        (p for group in paths for p in group if _is_under(target, p)), key=len, default=None
    )
    for got, want in zip(records[idx][2], base[idx][2]):
        if got == want:
            continue
        group = paths[int(got[0].split(":")[0]) % len(paths)]
        if not (got[0] == want[0] and got[1] > 0 and want[1] == 0):
            return False
        if any(_is_under(p, target) or p == owner for p in group):
            return False
    return len(records[idx][2]) == len(base[idx][2])


def _rule_stale_copy_outside_target(config, baseline, fix, idx) -> bool:
    """README "What it changes": a group kept unsharded across a step by
    ``set_reshard_after_backward(False)`` and outside the submodule a call was
    passed keeps stock's stale unsharded copy: the fix reshards only the groups
    in that submodule and the one owning its parameters, the reference every
    group, so the next training loss differs."""
    switch = config.get("surface", {}).get("reshard_after_backward")
    records, base = fix["records"], baseline["records"]
    if switch is None or idx >= len(records) or idx >= len(base):
        return False
    if records[idx][1] != "train" or base[idx][1] != "train":
        return False
    paths = _group_paths(config)
    switched = paths[switch["group"]]
    for event in config["events"][: records[idx][0]]:
        if event["do"] != "call" or event["target"] == "":
            continue
        target = event["target"]
        owner = max(
            (p for group in paths for p in group if _is_under(target, p)), key=len, default=None
        )
        if not any(_is_under(p, target) or p == owner for p in switched):
            return True
    return False


def _rule_aborted_forward_without_reset(config, baseline, fix, idx) -> bool:
    """backport's docstring, README "What it changes": a forward or backward that
    raised leaves its groups marked as running, and reshard() skips them until
    reset_iter_state() on the root (which 2.10 does not have). Accepted only
    where the baseline fails: FSDP2's state-dict hook, which the backport runs
    for a plain module passed in, reshards such a group all the same, so a
    call on a plain module can work there."""
    return _raised(baseline, idx) is not None and any(
        record[1] == "abort" and not record[2].endswith(", reset")
        for record in fix["records"][:idx]
    )


def _rule_rank_local_reshard(config, baseline, fix, idx) -> bool:
    """README "What it changes": the reshard is rank-local; a call on a subset of
    ranks after a forward without backward fails at the next forward (gloo aborts
    with "collective mismatch"), where stock torch did not."""
    rank_local = [
        at for at, event in enumerate(config["events"]) if event.get("ranks") == "first"
    ]
    if not rank_local:
        return False
    if fix["status"] in ("died", "hang"):
        at_event = fix.get("at_event")
        return at_event is not None and at_event > rank_local[0]
    error = _raised(fix, idx)
    at = fix["records"][idx][0] if idx < len(fix["records"]) else -1
    return error is not None and at > rank_local[0] and "mismatch" in error.lower()


RULES = {
    "optimizer built after an evaluation": _rule_optimizer_built_after_eval,
    "OptimizerParamNotInModelError for a bare KeyError": _rule_unowned_param_error_type,
    "tied secondary module (Limits)": _rule_tied_secondary,
    "tied secondary module, model call (Limits)": _rule_tied_secondary_model_call,
    "a group outside the submodule passed in": _rule_group_outside_target,
    "stale unsharded copy outside the submodule passed in": _rule_stale_copy_outside_target,
    "forward aborted without reset_iter_state()": _rule_aborted_forward_without_reset,
    "rank-local reshard (a call on rank 0 alone)": _rule_rank_local_reshard,
}


def _forgive_freed_held_tensors(fix: dict, baseline: dict) -> tuple[dict, bool]:
    """README "What it changes": a tensor taken from the model after unshard() is
    invalid after any DSD call (its storage is freed). Returns the fix's outcome
    with each "held" record that differs from the baseline's only by freed
    storage replaced by the baseline's, and whether there was one; every other
    record is still compared."""
    records = list(fix["records"])
    forgiven = False
    for pos, (got, want) in enumerate(zip(records, baseline["records"])):
        if got == want or got[1] != "held" or want[1] != "held" or got[0] != want[0]:
            continue
        if len(got[2]) == len(want[2]) and all(
            g == w or (g[0] == w[0] and g[1] == 0 and w[1] > 0)
            for g, w in zip(got[2], want[2])
        ):
            records[pos] = want
            forgiven = True
    return dict(fix, records=records), forgiven


HELD_TENSOR_RULE = "a tensor held from unshard() freed by the call"
STALE_COPY_RULE = "stale unsharded copy replaced (set_reshard_after_backward(False))"


def _stale_copy_replaced(config: Config, reference: dict, fix: dict) -> bool:
    """README "What it changes": where a group stays unsharded across an optimizer
    step (``set_reshard_after_backward(False)``), stock's next forward uses the
    stale unsharded copy; the fix's reshard makes the next forward all-gather the
    stepped shards. Accepted only where the fix equals the reference exactly."""
    return (
        "reshard_after_backward" in config.get("surface", {})
        and _first_difference(fix, reference) is None
    )


def classify(config: Config, outcomes: dict[str, list[dict]]) -> dict[str, Any]:
    """Compare the three modes rank by rank.

    Returns {"kind": "control" | "bug" | "both fail", "verdict": "same" |
    "documented: <rule>" | "divergence", "rank", "at", "detail"}.
    """
    stock, reference, fix = (outcomes[mode] for mode in MODES)
    world_size = len(stock)
    if not any(_failed(o) for o in stock):
        kind, baselines = "control", ["stock"]
    elif not any(_failed(o) for o in reference):
        kind, baselines = "bug", ["reference"]
    else:
        kind, baselines = "both fail", ["reference", "stock"]
    verdicts = []
    for rank in range(world_size):
        best = None
        for name in baselines:
            baseline = outcomes[name][rank]
            fix_rank, forgiven = _forgive_freed_held_tensors(fix[rank], baseline)
            idx = _first_difference(fix_rank, baseline)
            if idx is None:
                best = (f"documented: {HELD_TENSOR_RULE}" if forgiven else "same", name, None, "")
                break
            rule = next(
                (label for label, fn in RULES.items() if fn(config, baseline, fix_rank, idx)),
                None,
            )
            if rule is None and kind == "control" and _stale_copy_replaced(
                config, outcomes["reference"][rank], fix_rank
            ):
                rule = STALE_COPY_RULE
            if rule is not None:
                candidate = (f"documented: {rule}", name, idx, "")
            elif fix[rank]["status"] in ("died", "hang"):
                died = f"fix {fix[rank]['status']}: {fix[rank].get('detail', '')}"
                candidate = ("divergence", name, idx, died)
            else:
                got = fix_rank["records"][idx] if idx < len(fix_rank["records"]) else None
                want = baseline["records"][idx] if idx < len(baseline["records"]) else None
                candidate = ("divergence", name, idx,
                             f"fix {_short(got)} != {name} {_short(want)}")
            if best is None or (best[0] == "divergence" and candidate[0] != "divergence"):
                best = candidate
        verdicts.append((rank, *best))
    worst = next((v for v in verdicts if v[1] == "divergence"), None)
    worst = worst or next((v for v in verdicts if v[1] != "same"), verdicts[0])
    rank, verdict, against, at, detail = worst
    return {"kind": kind, "verdict": verdict, "rank": rank, "against": against, "at": at,
            "detail": detail}


def _short(record: Any) -> str:
    text = json.dumps(record)
    return text if len(text) < 400 else text[:400] + "..."

