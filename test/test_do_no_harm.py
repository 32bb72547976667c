"""Setups that work on stock torch work identically with the fix, on 2 ranks.

Each worker runs its setups on torch as installed and again after
``backport.apply()``. Controls must give the same rendering both times; the bug
cases ("after eval") must fail on stock torch and pass with the fix.
"""

import functools
import unittest
from collections.abc import Callable
from typing import Any

import expecttest
import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import _patch_model_state_dict

from _fsdp_cases import (
    CALLS,
    CASES,
    Case,
    StateDictOptions,
    TinyLM,
    build,
    clone,
    describe_error,
    differences,
    evaluate,
    flat,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    optimizer_state_summary,
    outcome_of,
    run_agreed,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
    train_step,
    unpatched_then_patched,
)


pytestmark = pytest.mark.ranks


class PlainRoot(nn.Module):
    """A plain wrapper module around the model, as user code and libraries add."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def _plain_root(fsdp2: bool) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """TinyLM in a plain root; with ``fsdp2``, sharded below that root."""
    if fsdp2:
        model, optims, _ = build(CASES["root_none"])
    else:
        torch.manual_seed(0)
        model = TinyLM()
        optims = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    root = PlainRoot(model)
    train_step(root, optims, 0)
    return root, optims


def _patched_state_dict_outcomes(fsdp2: bool, after_eval: bool) -> str:
    """DSD's own _patch_model_state_dict on a plain root that carries a pre-hook."""
    root, optims = _plain_root(fsdp2)
    root.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)
    _patch_model_state_dict(root)
    outcomes = []
    for name, call in (
        ("state_dict", lambda: root.state_dict()),
        ("get_model", lambda: get_model_state_dict(root)),
        ("get_optim", lambda: get_optimizer_state_dict(root, optims)),
    ):
        if after_eval:
            evaluate(root)
        outcomes.append(f"{name} {outcome_of(call)}")
    return ", ".join(outcomes)


def patched_state_dict_worker() -> dict[str, str]:
    setups = {
        "plain model": {"fsdp2": False, "after_eval": False},
        "plain root over FSDP2": {"fsdp2": True, "after_eval": False},
        "plain root over FSDP2, after eval": {"fsdp2": True, "after_eval": True},
    }
    return unpatched_then_patched(
        lambda _label: "\n".join(
            f"{name}: {_patched_state_dict_outcomes(**kwargs)}" for name, kwargs in setups.items()
        )
    )


class HookCounter:
    """Counts the calls of a user's state-dict hooks on one module."""

    def __init__(self, module: nn.Module) -> None:
        self.counts = {"pre": 0, "post": 0, "load_pre": 0}
        module.register_state_dict_pre_hook(self._hook("pre"))
        module.register_state_dict_post_hook(self._hook("post"))
        module.register_load_state_dict_pre_hook(self._hook("load_pre"))

    def _hook(self, kind: str):
        def hook(*args, **kwargs) -> None:
            self.counts[kind] += 1

        return hook

    def take(self) -> str:
        taken = " ".join(f"{kind}={count}" for kind, count in self.counts.items())
        self.counts = dict.fromkeys(self.counts, 0)
        return taken


def _hook_counts(fsdp2: bool) -> str:
    """A user's hooks on the plain root and on a leaf: calls per DSD call."""
    lines = []
    for call_name, call in CALLS.items():
        root, optims = _plain_root(fsdp2)
        ref = {
            "model": clone(get_model_state_dict(root)),
            "optim": clone(get_optimizer_state_dict(root, optims)),
        }
        counters = {"root": HookCounter(root), "head": HookCounter(root.model.head)}
        outcome = outcome_of(functools.partial(call, root, optims, StateDictOptions(), ref))
        counts = ", ".join(f"{name} {counter.take()}" for name, counter in counters.items())
        lines.append(f"{call_name} {outcome}: {counts}")
    return "\n".join(lines)


def hook_counts_worker() -> dict[str, dict[str, str]]:
    return unpatched_then_patched(
        lambda _label: {
            "plain model": _hook_counts(fsdp2=False),
            "plain root over FSDP2": _hook_counts(fsdp2=True),
        }
    )


def _int_keyed_load(fsdp2: bool) -> str:
    """optim.state_dict() (int keys) loaded back with a param outside the model."""
    root, optims = _plain_root(fsdp2)
    # A learnable loss temperature: optimized, but not a parameter of the model.
    temperature = nn.Parameter(torch.ones(()))
    optims[0].add_param_group({"params": [temperature]})
    temperature.grad = torch.ones(())
    optims[0].step()
    saved = clone(optims[0].state_dict())
    with torch.no_grad():
        for state in optims[0].state.values():
            state["exp_avg"].add_(1.0)
    outcome = outcome_of(lambda: set_optimizer_state_dict(root, optims, clone(saved)))
    if outcome != "ok":
        return outcome
    diffs = differences(optims[0].state_dict(), saved)
    return f"ok, restored {'exactly' if not diffs else f'with differences at {diffs[:3]}'}"


def int_keyed_worker() -> dict[str, str]:
    return unpatched_then_patched(
        lambda _label: "\n".join(
            f"{name}: {_int_keyed_load(fsdp2)}"
            for name, fsdp2 in (("plain model", False), ("FSDP2 model", True))
        )
    )


def optim_built_after_eval_worker() -> dict[str, str]:
    """The optimizer captures the root group's unsharded params after an evaluation."""

    def run_case(trained: bool, evaluated: bool) -> str:
        model, optims, _ = build(CASES["root_none"])
        saved = clone(get_optimizer_state_dict(model, optims))
        evaluate(model)
        optims = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
        if trained:
            # The backward reshards the root: its unsharded params get no state.
            train_step(model, optims, 0)
            if evaluated:
                evaluate(model)
        get = optimizer_state_summary(model, optims)
        # Never stepped, DSD's zero-grad step() would write to freed parameters.
        load = outcome_of(lambda: set_optimizer_state_dict(model, optims, clone(saved)))
        int_keyed = clone(optims[0].state_dict())
        load_int_keyed = outcome_of(
            lambda: set_optimizer_state_dict(model, optims, int_keyed)
        )
        return f"get: {get}\nset: {load}\nset int-keyed: {load_int_keyed}"

    variants = {
        "never stepped": (False, False),
        "trained": (True, False),
        "trained, evaluated": (True, True),
    }
    return unpatched_then_patched(
        lambda _label: "\n".join(
            f"{name}: {run_case(*variant)}" for name, variant in variants.items()
        )
    )


def _render_storageless(tree: Any) -> tuple[str, str]:
    """(every value, exactly; a summary to pin) of a state dict with sparse tensors.

    The summary names tensors and their non-strided layouts and the params of
    each param group, leaving out values and hyperparameters, which differ
    between torch releases.
    """
    exact, summary = [], []
    for path, value in sorted(flat(tree).items()):
        if isinstance(value, torch.Tensor):
            layout = str(value.layout).removeprefix("torch.")
            dense = value.to_dense() if value.layout != torch.strided else value
            exact.append(f"{path}: {layout} {dense.tolist()}")
            summary.append(path if value.layout == torch.strided else f"{path} {layout}")
        else:
            exact.append(f"{path}: {value!r}")
            if "/params[" in path:
                summary.append(f"{path}={value}")
    return "; ".join(exact), ", ".join(summary)


class SparseGraphModel(nn.Module):
    """A frozen CSR adjacency matrix, a trainable COO embedding, a dense layer."""

    def __init__(self, coo_trainable: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.adj = nn.Parameter(torch.eye(3).to_sparse_csr(), requires_grad=False)
        self.coo = nn.Parameter(
            torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,)), requires_grad=coo_trainable
        )
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.sparse.mm(self.adj, x))


def _storageless_setup(name: str):
    """(model, optimizer, FQN-keyed optimizer state to load) for one setup."""
    if name == "sparse COO param, fresh SGD":
        model = SparseGraphModel(coo_trainable=True)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        # SGD without momentum keeps no state: the FQN-keyed form has only params.
        saved = {"state": {}, "param_groups": [
            {**optim.param_groups[0], "params": [fqn for fqn, _ in model.named_parameters()]}
        ]}
        return model, optim, saved
    if name == "frozen sparse params, resumed into a fresh Adam":
        trained = SparseGraphModel(coo_trainable=False)
        optim = torch.optim.Adam(trained.parameters(), lr=0.1)
        trained(torch.ones(3, 3)).sum().backward()
        optim.step()
        saved = clone(get_optimizer_state_dict(trained, optim))
        model = SparseGraphModel(coo_trainable=False)
        return model, torch.optim.Adam(model.parameters(), lr=0.1), saved
    # Stateless SGD keeps no state, so DSD steps it on every call.
    model = SparseGraphModel(coo_trainable=False)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(3, 3)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim, clone(get_optimizer_state_dict(model, optim))


STORAGELESS_SETUPS = (
    "sparse COO param, fresh SGD",
    "frozen sparse params, resumed into a fresh Adam",
    "stateless SGD after zero_grad(set_to_none=True)",
)


# The six calls, each on (model, optimizers, model state to load, optimizer state to load).
STORAGELESS_CALLS: dict[str, Callable[..., Any]] = {
    "get_model": lambda model, optims, msd, osd: get_model_state_dict(model),
    "get_optim": lambda model, optims, msd, osd: get_optimizer_state_dict(model, optims),
    "get_state": lambda model, optims, msd, osd: get_state_dict(model, optims),
    "set_model": lambda model, optims, msd, osd: set_model_state_dict(model, msd),
    "set_optim": lambda model, optims, msd, osd: set_optimizer_state_dict(model, optims, osd),
    "set_state": lambda model, optims, msd, osd: set_state_dict(
        model, optims, model_state_dict=msd, optim_state_dict=osd
    ),
}


def _storageless_outcomes(name: str) -> list[str]:
    """The six calls on one setup: each result rendered, or its error."""
    lines = []
    for call_name, call in STORAGELESS_CALLS.items():
        model, optim, saved_optim = _storageless_setup(name)
        saved_model = clone(model.state_dict())
        try:
            result = call(model, [optim], saved_model, saved_optim)
        except Exception as err:  # noqa: BLE001 - compared with stock torch
            lines.append(f"{call_name}: {describe_error(err, first_line=True)}")
            continue
        if call_name.startswith("set_"):
            result = (model.state_dict(), optim.state_dict())
        exact, summary = _render_storageless(result)
        lines.append(f"{call_name}: ok, {summary}\n    exact: {exact}")
    return lines


def storageless_params_worker() -> dict[str, dict[str, list[str]]]:
    return unpatched_then_patched(
        lambda _label: {name: _storageless_outcomes(name) for name in STORAGELESS_SETUPS}
    )


def held_tensor_worker() -> dict[str, str]:
    """A group holding no optimizer parameter, unshard()ed on purpose, and a tensor taken from it."""

    def run(_label: str) -> str:
        # The root group holds only the frozen embedding; the optimizer the rest.
        model, optims, _ = build(Case(frozen=True, tail=True))
        train_step(model, optims, 0)
        model.unshard()  # the root group only: unshard() is not recursive
        held = model.embed.weight
        before = held.untyped_storage().nbytes()
        outcome = outcome_of(lambda: get_optimizer_state_dict(model, optims))
        # Reading a tensor whose storage was freed crashes: only its size is read.
        return (
            f"get_optimizer_state_dict {outcome}; the held embed.weight ({type(held).__name__}) "
            f"storage {before} -> {held.untyped_storage().nbytes()} bytes; model.embed.weight "
            f"is now a {type(model.embed.weight).__name__}"
        )

    return unpatched_then_patched(run)


class DoNoHarmTest(expecttest.TestCase):
    def test_patched_state_dict_on_a_hooked_plain_root(self) -> None:
        result = run_agreed(2, patched_state_dict_worker)
        self.assertExpectedInline(result["unpatched"], """\
plain model: state_dict ok, get_model ok, get_optim ok
plain root over FSDP2: state_dict ok, get_model ok, get_optim ok
plain root over FSDP2, after eval: state_dict ok, get_model ok, get_optim KeyError: 0""")
        self.assertExpectedInline(result["patched"], """\
plain model: state_dict ok, get_model ok, get_optim ok
plain root over FSDP2: state_dict ok, get_model ok, get_optim ok
plain root over FSDP2, after eval: state_dict ok, get_model ok, get_optim ok""")

    def test_user_hook_call_counts(self) -> None:
        result = run_agreed(2, hook_counts_worker)
        self.assertEqual(result["patched"], result["unpatched"])
        self.assertExpectedInline(result["unpatched"]["plain model"], """\
get_model ok: root pre=1 post=1 load_pre=0, head pre=1 post=1 load_pre=0
get_optim ok: root pre=0 post=0 load_pre=0, head pre=0 post=0 load_pre=0
get_state ok: root pre=1 post=1 load_pre=0, head pre=1 post=1 load_pre=0
set_model ok: root pre=1 post=1 load_pre=1, head pre=1 post=1 load_pre=1
set_optim ok: root pre=0 post=0 load_pre=0, head pre=0 post=0 load_pre=0
set_state ok: root pre=1 post=1 load_pre=1, head pre=1 post=1 load_pre=1""")
        # A plain root over FSDP2 sees exactly the calls a plain model sees.
        self.assertEqual(
            result["unpatched"]["plain root over FSDP2"], result["unpatched"]["plain model"]
        )

    def test_int_keyed_optimizer_state_dict_with_a_param_outside_the_model(self) -> None:
        result = run_agreed(2, int_keyed_worker)
        self.assertEqual(result["patched"], result["unpatched"])
        self.assertExpectedInline(result["unpatched"], """\
plain model: ok, restored exactly
FSDP2 model: ok, restored exactly""")

    def test_sparse_parameters(self) -> None:
        result = run_agreed(2, storageless_params_worker)
        self.assertEqual(result["patched"], result["unpatched"])
        self.assertExpectedInline(
            "\n".join(
                f"{name}:\n  " + "\n  ".join(line.split("\n")[0] for line in lines)
                for name, lines in result["unpatched"].items()
            ),
            """\
sparse COO param, fresh SGD:
  get_model: ok, /adj sparse_csr, /coo sparse_coo, /lin.bias, /lin.weight
  get_optim: ok, /param_groups[0]/params[0]=adj, /param_groups[0]/params[1]=coo, /param_groups[0]/params[2]=lin.weight, /param_groups[0]/params[3]=lin.bias
  get_state: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=adj, [1]/param_groups[0]/params[1]=coo, [1]/param_groups[0]/params[2]=lin.weight, [1]/param_groups[0]/params[3]=lin.bias
  set_model: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3
  set_optim: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3
  set_state: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3
frozen sparse params, resumed into a fresh Adam:
  get_model: ok, /adj sparse_csr, /coo sparse_coo, /lin.bias, /lin.weight
  get_optim: ok, /param_groups[0]/params[0]=adj, /param_groups[0]/params[1]=coo, /param_groups[0]/params[2]=lin.weight, /param_groups[0]/params[3]=lin.bias, /state/lin.bias/exp_avg, /state/lin.bias/exp_avg_sq, /state/lin.bias/step, /state/lin.weight/exp_avg, /state/lin.weight/exp_avg_sq, /state/lin.weight/step
  get_state: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=adj, [1]/param_groups[0]/params[1]=coo, [1]/param_groups[0]/params[2]=lin.weight, [1]/param_groups[0]/params[3]=lin.bias, [1]/state/lin.bias/exp_avg, [1]/state/lin.bias/exp_avg_sq, [1]/state/lin.bias/step, [1]/state/lin.weight/exp_avg, [1]/state/lin.weight/exp_avg_sq, [1]/state/lin.weight/step
  set_model: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3
  set_optim: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3, [1]/state/2/exp_avg, [1]/state/2/exp_avg_sq, [1]/state/2/step, [1]/state/3/exp_avg, [1]/state/3/exp_avg_sq, [1]/state/3/step
  set_state: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3, [1]/state/2/exp_avg, [1]/state/2/exp_avg_sq, [1]/state/2/step, [1]/state/3/exp_avg, [1]/state/3/exp_avg_sq, [1]/state/3/step
stateless SGD after zero_grad(set_to_none=True):
  get_model: ok, /adj sparse_csr, /coo sparse_coo, /lin.bias, /lin.weight
  get_optim: ok, /param_groups[0]/params[0]=adj, /param_groups[0]/params[1]=coo, /param_groups[0]/params[2]=lin.weight, /param_groups[0]/params[3]=lin.bias
  get_state: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=adj, [1]/param_groups[0]/params[1]=coo, [1]/param_groups[0]/params[2]=lin.weight, [1]/param_groups[0]/params[3]=lin.bias
  set_model: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3
  set_optim: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3
  set_state: ok, [0]/adj sparse_csr, [0]/coo sparse_coo, [0]/lin.bias, [0]/lin.weight, [1]/param_groups[0]/params[0]=0, [1]/param_groups[0]/params[1]=1, [1]/param_groups[0]/params[2]=2, [1]/param_groups[0]/params[3]=3""",
        )

    def test_tensor_held_across_an_optimizer_call(self) -> None:
        # The price of the fix, in its BC note: the optimizer calls reshard, as
        # get_model_state_dict already does, and free what unshard() allocated.
        result = run_agreed(2, held_tensor_worker)
        self.assertExpectedInline(result["unpatched"], """get_optimizer_state_dict ok; the held embed.weight (Parameter) storage 512 -> 512 bytes; model.embed.weight is now a Parameter""")
        self.assertExpectedInline(result["patched"], """get_optimizer_state_dict ok; the held embed.weight (Parameter) storage 512 -> 0 bytes; model.embed.weight is now a DTensor""")

    def test_optimizer_built_after_an_evaluation(self) -> None:
        result = run_agreed(2, optim_built_after_eval_worker)
        self.assertExpectedInline(result["unpatched"], """\
never stepped: get: ok, state for 12 of 12 optimizer params
set: ok
set int-keyed: ok
trained: get: KeyError: 0
set: KeyError: <Parameter>
set int-keyed: ok
trained, evaluated: get: ok, state for 8 of 12 optimizer params
set: ok
set int-keyed: ok""")
        self.assertExpectedInline(result["patched"], """\
never stepped: get: ValueError: AdamW param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
set: ValueError: AdamW param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
set int-keyed: ValueError: AdamW param_groups[0]['params'][0] (shape (16, 8)) has no allocated storage, e.g. an FSDP2 unsharded parameter freed by reshard(), so the optimizer cannot be stepped to initialize its state. Build the optimizer from model.parameters() right after fully_shard().
trained: get: ValueError: AdamW holds a parameter that the model does not own: param_groups[0]['params'][0] (Parameter of shape (16, 8)). Pass the model that owns every parameter of the optimizer. The model holds a DTensor of that shape instead ('embed.weight', 'head.weight') and this parameter's storage is freed: the optimizer was built while FSDP2 modules were unsharded. Build it from model.parameters() right after fully_shard().
set: OptimizerParamNotInModelError: AdamW holds a parameter that the model does not own: param_groups[0]['params'][0] (Parameter of shape (16, 8)). Pass the model that owns every parameter of the optimizer. The model holds a DTensor of that shape instead ('embed.weight', 'head.weight') and this parameter's storage is freed: the optimizer was built while FSDP2 modules were unsharded. Build it from model.parameters() right after fully_shard().
set int-keyed: ok
trained, evaluated: get: ValueError: AdamW param_groups[0]['params'][0] (shape (16, 8)) is an FSDP2 unsharded parameter: the optimizer was built while FSDP2 modules were unsharded (e.g. after a forward without backward) and does not hold the sharded parameters that training updates. Build the optimizer from model.parameters() right after fully_shard().
set: OptimizerParamNotInModelError: AdamW holds a parameter that the model does not own: param_groups[0]['params'][0] (Parameter of shape (16, 8)). Pass the model that owns every parameter of the optimizer. The model holds a DTensor of that shape instead ('embed.weight', 'head.weight') and this parameter's storage is freed: the optimizer was built while FSDP2 modules were unsharded. Build it from model.parameters() right after fully_shard().
set int-keyed: ok""")


if __name__ == "__main__":
    unittest.main()
