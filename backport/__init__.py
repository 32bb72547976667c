# SPDX-License-Identifier: BSD-3-Clause
# backport/__init__.py of fsdp2-dcp-eval-backport 0.1.0: this one file is the whole
# backport; copies keep these lines.
"""Make DCP optimizer state dicts work after an FSDP2 evaluation forward.

After a forward without backward, FSDP2 groups with ``reshard_after_forward=False``
(the root's default) or an ``int`` stay unsharded and
``torch.distributed.checkpoint.state_dict`` fails: ``KeyError`` for the optimizer,
mixed Tensors and DTensors in a full ``set_model_state_dict``.

``apply()`` wraps ``torch.distributed.checkpoint.state_dict._verify_options``, which
all six public state-dict functions call first, to call ``FSDPModule.reshard()`` on
every FSDP2 module in the module passed in (no collective; a no-op on sharded
groups), as ``torch_patch/`` proposes upstream. What else changes (in full:
docs/design.md):

- An optimizer holding a parameter this reshard unregistered, built while its group
  was unsharded, raises a ``ValueError``; so does (``_init_optim_state`` wrapped) a
  never-stepped one holding a parameter whose storage FSDP2 freed, not crashing.
- An optimizer parameter the model does not own raises
  ``OptimizerParamNotInModelError`` (a ``ValueError`` and a ``KeyError``) where torch
  raises a bare ``KeyError``, naming it and, where FSDP2 left a sign, the state the
  optimizer missed (``_get_optim_state_dict`` and ``_load_optim_state_dict`` wrapped).
- The reshard is rank-local and the next forward all-gathers: call the state-dict
  functions on every rank of each FSDP mesh, or on none. After an exception in
  forward or backward, call ``FSDPModule.reset_iter_state()`` on the root first.
- The backport's own, not in ``torch_patch/``: for a plain module passed in, FSDP2's
  state-dict pre-hook on the modules below it reshards a group that an FSDP module
  above it owns (no other hook and no ``state_dict()`` runs;
  upstream/lightning_patch/ fixes that caller), and ``get_state_dict`` and
  ``set_state_dict`` raise the error above before their model part.

Tested on torch 2.7 to 2.15 (``_SUPPORTED``). A newer torch whose wrapped functions
keep their shape is patched with an ``UntestedTorchWarning``; ``apply()`` raises
``UnsupportedTorchError`` only where it cannot patch safely. Vendor as-is: this file
needs only the standard library and torch, and importing it changes nothing.

    import backport
    backport.apply()     # idempotent, thread-safe
    backport.status()    # "applied: ..." / "not applied: ..." / ...
    backport.revert()    # restores the original function objects
"""

from __future__ import annotations

import functools
import re
import threading
import warnings
from collections.abc import Callable
from itertools import chain
from types import ModuleType
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        _StateDictInfo,
    )


__all__ = [
    "BackportWarning",
    "OptimizerParamNotInModelError",
    "UnsupportedTorchError",
    "UntestedTorchWarning",
    "apply",
    "get_original",
    "is_applied",
    "revert",
    "status",
]

__version__ = "0.1.0"

_TARGET_MODULE = "torch.distributed.checkpoint.state_dict"
_TARGET_NAME = "_verify_options"
_TARGET_PARAMS = ("model", "optims", "optim_only", "submodules", "options")
# Releases measured to have the bug and the function shape patched here. A
# newer torch is patched where the functions keep their shape, with a warning.
_SUPPORTED = ((2, 7), (2, 15))
# Breakpoint: no torch release contains the fix yet. In a torch carrying it (a
# release, or one with torch_patch/ applied) _verify_options calls this helper.
_FIX_ARTIFACT = "_reshard_fsdp2_modules"
# Set on each wrapper installed in torch, naming that wrapper: every vendored
# copy recognises the installed wrappers by identity, not by a copied attribute.
_MARKER = "_fsdp2_eval_reshard_backport"
_PARAMS = "params"

_lock = threading.Lock()


class UnsupportedTorchError(RuntimeError):
    """``apply()`` cannot patch this torch safely; ``reason`` says why."""

    def __init__(self, reason: str, remedy: str) -> None:
        super().__init__(reason, remedy)
        self.reason = reason
        self.remedy = remedy

    def __str__(self) -> str:
        return f"{self.reason}; {self.remedy}."


class BackportWarning(RuntimeWarning):
    """The backport did nothing, or patched a torch it was not tested on."""


class UntestedTorchWarning(BackportWarning):
    """``apply()`` patched a torch newer than the releases it supports."""


class OptimizerParamNotInModelError(ValueError, KeyError):
    """An optimizer holds a parameter that the model passed in does not own.

    A ``ValueError``, as the upstream change raises, and a ``KeyError``, which
    torch raises for these inputs: code that catches ``KeyError`` around a DSD
    call keeps catching it once ``apply()`` is switched on.
    """

    # KeyError's str() is the repr of its argument: show the message as is.
    __str__ = BaseException.__str__


# The helpers below are torch_patch/'s 0001 (PR A) and 0002 (PR B), statement
# for statement: test/test_patch_matches_backport.py fails if they drift apart.


def _reshard_fsdp2_modules(
    model: nn.Module, optims: tuple[torch.optim.Optimizer, ...]
) -> None:
    """
    Reshard every FSDP2 module in ``model`` and check ``optims`` against it.
    """
    from torch.distributed.fsdp import FSDPModule

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        return
    params_before = set(model.parameters()) if optims else set()
    # A forward without backward leaves modules with reshard_after_forward=False
    # or an int unsharded. reshard() issues no collective: the next forward
    # all-gathers a resharded group, so every rank of its mesh reshards it or none.
    for module in fsdp_modules:
        module.reshard()
    if not optims:
        return
    # The parameters the reshard unregistered are unsharded ones: an optimizer
    # holding one was built while its group was unsharded. Raise before any
    # step(), whether or not reshard() freed their storage.
    unsharded_params = params_before.difference(model.parameters())
    if not unsharded_params:
        return
    for optim in optims:
        for group_idx, param_group in enumerate(optim.param_groups):
            for param_idx, param in enumerate(param_group[_PARAMS]):
                if param in unsharded_params:
                    raise ValueError(
                        f"{type(optim).__name__} param_groups[{group_idx}]['params']"
                        f"[{param_idx}] (shape {tuple(param.shape)}) is an FSDP2 "
                        "unsharded parameter: the optimizer was built while FSDP2 "
                        "modules were unsharded (e.g. after a forward without "
                        "backward) and does not hold the sharded parameters that "
                        "training updates. Build the optimizer from "
                        "model.parameters() right after fully_shard()."
                    )


def _verify_optim_params_allocated(optim: torch.optim.Optimizer) -> None:
    """
    Raise if ``optim`` holds a parameter whose storage has been freed.
    """
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for group_idx, param_group in enumerate(optim.param_groups):
        for param_idx, param in enumerate(param_group[_PARAMS]):
            if not param.requires_grad:
                continue
            tensors = [param]
            while tensors:
                tensor = tensors.pop()
                # A traceable wrapper subclass (a DTensor under TP, a quantized or
                # float8 training tensor) keeps its data in the tensors it names.
                if is_traceable_wrapper_subclass(tensor):
                    inner_names, _ = tensor.__tensor_flatten__()
                    # DTensor also names its (non-tensor) device_mesh.
                    inner = (getattr(tensor, name) for name in inner_names)
                    tensors.extend(t for t in inner if isinstance(t, torch.Tensor))
                    continue
                # An optimizer built while FSDP2 modules were unsharded holds
                # parameters that a later reshard() freed; step() on one writes
                # to freed memory. Tensors without storage (sparse, mkldnn) pass.
                if (
                    torch._C._has_storage(tensor)
                    and tensor.numel() > 0
                    and tensor.untyped_storage().size() == 0
                ):
                    raise ValueError(
                        f"{type(optim).__name__} param_groups[{group_idx}]['params']"
                        f"[{param_idx}] (shape {tuple(param.shape)}) has no allocated "
                        "storage, e.g. an FSDP2 unsharded parameter freed by reshard(), "
                        "so the optimizer cannot be stepped to initialize its state. "
                        "Build the optimizer from model.parameters() right after "
                        "fully_shard()."
                    )


def _unowned_optim_param_error(
    optim: torch.optim.Optimizer,
    key: torch.Tensor | int | str,
    info: _StateDictInfo,
) -> OptimizerParamNotInModelError:
    """
    Return the error for an optimizer parameter that the model does not own.
    """
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    params = list(chain.from_iterable(g[_PARAMS] for g in optim.param_groups))
    # ``key`` is the parameter, or the optim.state_dict() key that maps to none.
    if isinstance(key, torch.Tensor):
        param = key
    elif isinstance(key, int) and 0 <= key < len(params):
        param = params[key]
    else:
        return OptimizerParamNotInModelError(
            f"{type(optim).__name__}.state_dict() holds state under the key "
            f"{key!r}, which is not the index of one of its parameters: these "
            "functions map the integer keys that torch.optim.Optimizer.state_dict() "
            "uses to FQNs."
        )
    where = next(
        (
            f"param_groups[{group_idx}]['params'][{param_idx}]"
            for group_idx, param_group in enumerate(optim.param_groups)
            for param_idx, group_param in enumerate(param_group[_PARAMS])
            if group_param is param
        ),
        "<unknown>",
    )
    msg = (
        f"{type(optim).__name__} holds a parameter that the model does not own: "
        f"{where} ({type(param).__name__} of shape {tuple(param.shape)}). Pass "
        "the model that owns every parameter of the optimizer."
    )
    # FSDP2 registers the unsharded parameter (a plain tensor) or the sharded
    # one (a DTensor of the same global shape): the one the model holds in
    # place of ``param`` tells which state the optimizer missed. With an int
    # reshard_after_forward (a DTensor on the post-forward mesh) or under TP
    # both forms are DTensors, so those setups get no hint.
    is_dtensor = isinstance(param, DTensor)
    counterparts = [
        repr(fqn)
        for fqn, model_param in info.fqn_param_mapping.items()
        if isinstance(fqn, str)
        and isinstance(model_param, nn.Parameter)
        and isinstance(model_param, DTensor) != is_dtensor
        and model_param.shape == param.shape
    ]
    names = ", ".join(counterparts[:3]) + (", ..." if len(counterparts) > 3 else "")
    if counterparts and is_dtensor:
        msg += (
            f" The model holds a plain tensor of that shape instead ({names}): if "
            "it uses fully_shard, the group that owns the parameter may be "
            "unsharded, e.g. after a forward without backward. Call reshard() on "
            "the model's FSDP modules on every rank (after an exception in "
            "forward, reset_iter_state() on the root first), or pass the root module."
        )
    # A plain tensor of the same shape may be any parameter outside the model;
    # only storage that reshard() freed marks an unsharded FSDP2 parameter.
    elif (
        counterparts
        and torch._C._has_storage(param)
        and param.untyped_storage().size() == 0
    ):
        msg += (
            f" The model holds a DTensor of that shape instead ({names}) and this "
            "parameter's storage is freed: the optimizer was built while FSDP2 "
            "modules were unsharded. Build it from model.parameters() right after "
            "fully_shard()."
        )
    return OptimizerParamNotInModelError(msg)


# The helpers below are the backport's own, in no patch. Its reshard of a plain
# module's groups calls FSDP2's private hook, which DSD must not depend on; the
# Lightning change in upstream/lightning_patch/ fixes that caller instead.


# The state_dict pre-hook that FSDP2 registers on each module holding its params.
_FSDP2_TO_SHARDED_HOOK = (
    "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"
)


def _optim_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Return ``optim``'s parameters in the order its ``state_dict()`` numbers them."""
    return [param for group in optim.param_groups for param in group[_PARAMS]]


def _has_fsdp2_module(model: nn.Module) -> bool:
    """Return whether ``model`` or a module below it is an FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def _reshard_fsdp2_groups_of_plain_module(model: nn.Module) -> None:
    """Reshard the FSDP2 groups above a plain ``model`` that own its parameters."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return
    # E.g. Lightning Fabric's full load passes leaves of the root's group. FSDP2's
    # pre-hook on a module reshards the group owning its parameters, with no
    # collective; no other hook runs.
    for module in model.modules():
        for hook in module._state_dict_pre_hooks.values():
            if getattr(hook, "__qualname__", None) == _FSDP2_TO_SHARDED_HOOK:
                # keep_vars is unused by the hook; True skips nothing.
                hook(module, "", True)


def _unowned_param_error_with_cause(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    key: torch.Tensor | int | str,
    info: _StateDictInfo,
    has_fsdp2_module: bool | None = None,
) -> OptimizerParamNotInModelError:
    """Return 0002's error, with the cause for a DTensor that no FSDP module reaches."""
    from torch.distributed.tensor import DTensor

    error = _unowned_optim_param_error(optim, key, info)
    if not isinstance(key, DTensor):
        return error
    # None: the caller has not scanned ``model``.
    if has_fsdp2_module is None:
        has_fsdp2_module = _has_fsdp2_module(model)
    # A DTensor that a model without FSDP modules does not show is in a group that
    # an FSDP module outside it owns, and that FSDP2's hook did not reshard: FSDP2
    # hooks only the first module holding a shared parameter (tied weights).
    if has_fsdp2_module:
        return error
    return OptimizerParamNotInModelError(
        f"{error} The module passed in ({type(model).__name__}) contains no FSDP "
        "module: an FSDP module outside it owns the group, and FSDP2 registers "
        "the state-dict hook that reshards a shared parameter only on the first "
        "module holding it (e.g. the embedding, not an lm_head tied to it), so "
        "it stays unsharded here."
    )


def _raise_unowned_before_model_part(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    info: _StateDictInfo,
) -> None:
    """Raise the error for an unowned DTensor before the model part of a call."""
    from torch.distributed.tensor import DTensor

    if info.fsdp_modules:
        return
    for optim in optims:
        for param in _optim_params(optim):
            if isinstance(param, DTensor) and param not in info.fqn_param_mapping:
                # Scanned only on this error path, not on every call.
                has_fsdp2_module = _has_fsdp2_module(model)
                if has_fsdp2_module:
                    return
                raise _unowned_param_error_with_cause(
                    model, optim, param, info, has_fsdp2_module
                )


def _wrap_verify_options(verify_options: Callable) -> Callable:
    """Return ``_verify_options`` resharding FSDP2 modules first, as 0001 does."""

    @functools.wraps(verify_options)
    def _verify_options(
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        optim_only: bool,
        *,
        submodules: set[nn.Module] | None = None,
        options: StateDictOptions | None = None,
    ) -> _StateDictInfo:
        # 0001 reshards after the original's check that optim_only has optims.
        if optims or not optim_only:
            _reshard_fsdp2_modules(model, optims)
            _reshard_fsdp2_groups_of_plain_module(model)
        info = verify_options(
            model, optims, optim_only, submodules=submodules, options=options
        )
        # get_state_dict and set_state_dict handle the model first: for the tied
        # secondary module, torch's Tensor/DTensor mismatch there names no cause.
        if optims and not optim_only:
            _raise_unowned_before_model_part(model, optims, info)
        return info

    return _verify_options


def _wrap_get_optim_state_dict(get_optim_state_dict: Callable) -> Callable:
    """Return ``_get_optim_state_dict`` raising 0002's error for an unowned param."""
    # 0002 raises where this function's state-key -> FQN lookups raise
    # KeyError(key): for a key that is not an index of the optimizer's
    # parameters, or one whose parameter the model does not own.
    @functools.wraps(get_optim_state_dict)
    def _get_optim_state_dict(model, optimizers, info):
        try:
            return get_optim_state_dict(model, optimizers, info)
        except KeyError as err:
            key = err.args[0] if len(err.args) == 1 else None
            if info.fsdp_modules or not isinstance(key, (int, str)):
                raise
            owned = {id(param) for _, param in model.named_parameters()}
            for optim in optimizers:
                params = _optim_params(optim)
                if isinstance(key, int) and 0 <= key < len(params):
                    # The parameter itself: 0002's error names it as for its index.
                    unowned = None if id(params[key]) in owned else params[key]
                else:
                    osd = optim.state_dict()
                    in_osd = key in osd["state"] or any(
                        key in group[_PARAMS] for group in osd["param_groups"]
                    )
                    unowned = key if in_osd else None
                if unowned is not None:
                    raise _unowned_param_error_with_cause(model, optim, unowned, info) from err
            raise

    return _get_optim_state_dict


def _wrap_load_optim_state_dict(load_optim_state_dict: Callable) -> Callable:
    """Return ``_load_optim_state_dict`` raising 0002's error for an unowned param."""
    # 0002 raises where _split_optim_state_dict and _unflatten_optim_state_dict,
    # called from here, look a param up in info.fqn_param_mapping: KeyError(param).
    @functools.wraps(load_optim_state_dict)
    def _load_optim_state_dict(model, optimizers, state_dict, info):
        try:
            return load_optim_state_dict(model, optimizers, state_dict, info)
        except KeyError as err:
            missing = err.args[0] if len(err.args) == 1 else None
            for optim in optimizers:
                unowned = next(
                    (p for p in _optim_params(optim) if p not in info.fqn_param_mapping),
                    None,
                )
                if unowned is not None and missing is unowned:
                    raise _unowned_param_error_with_cause(model, optim, unowned, info) from err
            raise

    return _load_optim_state_dict


def _wrap_init_optim_state(init_optim_state: Callable) -> Callable:
    """Return ``_init_optim_state`` checking the params' storage first, as 0001 does."""
    # 0001 checks right before the zero-grad step(), after the early returns.
    @functools.wraps(init_optim_state)
    def _init_optim_state(optim):
        if not optim.state and all(param.grad is None for param in _optim_params(optim)):
            _verify_optim_params_allocated(optim)
        return init_optim_state(optim)

    return _init_optim_state


# name in the target module -> wrapper factory for the function found there
_WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    _TARGET_NAME: _wrap_verify_options,
    "_init_optim_state": _wrap_init_optim_state,
    "_get_optim_state_dict": _wrap_get_optim_state_dict,
    "_load_optim_state_dict": _wrap_load_optim_state_dict,
}


def _make_wrapper(name: str, original: Callable) -> Callable:
    """Return the backport's wrapper for ``original``, the function ``name``."""
    wrapper = _WRAPPERS[name](original)
    # The marker names the wrapper it is set on: functools.wraps copies
    # __dict__, so a wrapper that something else puts over this one carries
    # the marker too, but naming this one, not itself.
    setattr(wrapper, _MARKER, (__version__, wrapper))
    return wrapper


def _applied_version(obj: object) -> str | None:
    """The backport version that made the wrapper ``obj``, or None for anything else."""
    mark = getattr(obj, _MARKER, None)
    if isinstance(mark, tuple) and len(mark) == 2 and mark[1] is obj:
        return mark[0]
    return None


def _backport_wrapper_in(obj: object) -> Callable | None:
    """This backport's wrapper: ``obj``, or one ``obj`` wraps (``__wrapped__``), or None."""
    seen = set()
    while obj is not None and id(obj) not in seen:
        if _applied_version(obj) is not None:
            return obj
        seen.add(id(obj))
        obj = getattr(obj, "__wrapped__", None)
    return None


def _torch_release(version: str) -> tuple[int, int] | None:
    """Return the (major, minor) release of torch ``version``, or None."""
    # "2.13.0a0+git1234" is a 2.13 source build: compare major.minor only.
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def _supported_range() -> str:
    """Return the supported releases as text, e.g. "2.7 to 2.15"."""
    (lo_major, lo_minor), (hi_major, hi_minor) = _SUPPORTED
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def _install_command() -> str:
    """Return the pip command that installs a supported torch."""
    (lo_major, lo_minor), (hi_major, hi_minor) = _SUPPORTED
    return f'pip install "torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"'


def _is_untested(version: str) -> bool:
    """Whether torch ``version`` is newer than the supported releases (``_SUPPORTED``)."""
    release = _torch_release(version)
    return release is not None and release > _SUPPORTED[1]


def _remedy(first: str) -> str:
    """Return the remedy of an ``UnsupportedTorchError``, ``first`` first."""
    return (
        f"{first}, or apply torch_patch/ to your torch, or remove backport.apply() "
        "if your torch fixes the bug (python -m backport tells)"
    )


def _why_no_patch_needed(version: str, module: ModuleType) -> str | None:
    """Return why ``module`` needs no patch, or None; raise if it cannot be patched."""
    target = getattr(module, _TARGET_NAME, None)
    # The fix artifact first, whatever the version says.
    if _applied_version(target) is None and _FIX_ARTIFACT in getattr(
        getattr(target, "__code__", None), "co_names", ()
    ):
        return f"torch {version} already contains the fix; remove the backport"
    cannot = "so this backport cannot patch it safely"
    install = _remedy(f"install a supported torch ({_install_command()})")
    release = _torch_release(version)
    if release is None:
        raise UnsupportedTorchError(
            f"torch {version!r} has a version this backport cannot read, {cannot}", install
        )
    if release < _SUPPORTED[0]:
        raise UnsupportedTorchError(
            f"torch {version} is older than the releases this backport supports "
            f"({_supported_range()}), {cannot}",
            install,
        )
    if target is None:
        raise UnsupportedTorchError(
            f"torch {version} has no {_TARGET_MODULE}.{_TARGET_NAME}, {cannot}",
            install,
        )
    original = getattr(target, "__wrapped__", target)
    code = getattr(original, "__code__", None)
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] if code else ()
    if tuple(names) != _TARGET_PARAMS:
        raise UnsupportedTorchError(
            f"torch {version} changed {_TARGET_MODULE}.{_TARGET_NAME} (expected "
            f"parameters {_TARGET_PARAMS}, found {tuple(names) or repr(target)}), {cannot}",
            install,
        )
    missing = [name for name in _WRAPPERS if not callable(getattr(module, name, None))]
    if missing:
        raise UnsupportedTorchError(
            f"torch {version} has no {_TARGET_MODULE}.{missing[0]}, {cannot}", install
        )
    return None


def _torch_and_state_dict_module() -> tuple[ModuleType, ModuleType]:
    """Import and return torch and the module whose functions the backport wraps."""
    import torch
    import torch.distributed.checkpoint.state_dict as state_dict_module

    return torch, state_dict_module


def apply() -> str:
    """Patch the installed torch so DCP state dicts work after an FSDP2 evaluation.

    Idempotent and thread-safe. Returns the ``status()`` line. Call it on every
    rank: with it applied the state-dict functions may reshard FSDP2 modules
    on the calling rank only, so call them on every rank of each FSDP mesh, or
    on none. After an exception in forward or backward, call
    ``FSDPModule.reset_iter_state()`` on the root module first.

    On a torch newer than the supported releases whose wrapped functions keep
    their shape, the call that installs the wrappers first warns
    ``UntestedTorchWarning``: ``warnings.simplefilter("error",
    UntestedTorchWarning)`` makes that an exception, with nothing patched. On a
    torch that carries the fix it does nothing and warns ``BackportWarning``.

    Raises:
        UnsupportedTorchError: torch is older than the supported releases, its
            version cannot be read, or the functions wrapped changed shape.
    """
    torch, module = _torch_and_state_dict_module()
    version = torch.__version__
    with _lock:
        reason = _why_no_patch_needed(version, module)
        if reason is None:
            todo = [n for n in _WRAPPERS if _backport_wrapper_in(getattr(module, n)) is None]
            # Before the first wrapper goes in: an error filter leaves torch unpatched.
            if todo and _is_untested(version):
                warnings.warn(
                    f"torch {version} is newer than the releases this backport "
                    f"supports ({_supported_range()}) and was patched because the "
                    "functions it wraps keep their shape; run `python -m backport` to "
                    "check whether this torch still needs it.",
                    UntestedTorchWarning,
                    stacklevel=2,
                )
            for name in todo:
                setattr(module, name, _make_wrapper(name, getattr(module, name)))
    if reason is not None:
        warnings.warn(f"backport.apply() did nothing: {reason}.", BackportWarning, stacklevel=2)
    return status()


def revert() -> str:
    """Restore the original functions. Returns the ``status()`` line.

    Leaves an attribute alone, with a BackportWarning, when something else has
    wrapped this backport's wrapper there since: ``status()`` then says
    ``partly applied`` and to remove the wrapper over that function first, or
    still ``applied`` when something else wraps all four.
    """
    _, module = _torch_and_state_dict_module()
    with _lock:
        for name in _WRAPPERS:
            current = getattr(module, name, None)
            if _applied_version(current) is not None:
                setattr(module, name, current.__wrapped__)
            elif _backport_wrapper_in(current) is not None:
                warnings.warn(
                    f"{_TARGET_MODULE}.{name} is wrapped by something other "
                    "than this backport; it was left as it is. Remove the wrapper "
                    f"over {name} first.",
                    BackportWarning,
                    stacklevel=2,
                )
    return status()


def _backport_wrappers_in(module: ModuleType) -> dict[str, Callable]:
    """Name -> this backport's wrapper, for each function where calls go through it."""
    found = {name: _backport_wrapper_in(getattr(module, name, None)) for name in _WRAPPERS}
    return {name: wrapper for name, wrapper in found.items() if wrapper is not None}


def is_applied() -> bool:
    """Whether calls to every function the backport wraps go through its wrapper now."""
    _, module = _torch_and_state_dict_module()
    return len(_backport_wrappers_in(module)) == len(_WRAPPERS)


def get_original() -> Any:
    """The unpatched ``_verify_options`` (the live one when the backport is not in it)."""
    _, module = _torch_and_state_dict_module()
    current = getattr(module, _TARGET_NAME)
    wrapper = _backport_wrapper_in(current)
    return current if wrapper is None else wrapper.__wrapped__


def status() -> str:
    """One line: ``applied``, ``partly applied``, ``not applied``, ``not needed``, ``unsupported``."""
    torch, module = _torch_and_state_dict_module()
    version = torch.__version__
    untested = (
        f" (untested: newer than {_supported_range()})" if _is_untested(version) else ""
    )
    wrapped = _backport_wrappers_in(module)
    if len(wrapped) == len(_WRAPPERS):
        applied = _applied_version(wrapped[_TARGET_NAME])
        return (
            f"applied: torch {version}{untested}, {len(_WRAPPERS)} functions of "
            f"{_TARGET_MODULE} wrapped (backport {applied})"
        )
    if wrapped:
        missing = [name for name in _WRAPPERS if name not in wrapped]
        line = (
            f"partly applied: torch {version}, {_TARGET_MODULE} has "
            f"{', '.join(wrapped)} wrapped but not {', '.join(missing)}; "
        )
        # Something else wraps the backport's wrapper: revert() cannot remove it.
        covered = [name for name, ours in wrapped.items() if getattr(module, name) is not ours]
        if covered:
            return line + (
                f"remove the wrapper over {', '.join(covered)} first, then call "
                f"backport.revert(), or call backport.apply() to wrap all {len(_WRAPPERS)}"
            )
        return line + f"call backport.apply() to wrap all {len(_WRAPPERS)}, or backport.revert()"
    try:
        reason = _why_no_patch_needed(version, module)
    except UnsupportedTorchError as err:
        return f"unsupported: {err}"
    if reason is not None:
        return f"not needed: {reason}"
    if untested:
        return (
            f"not applied: torch {version}{untested}; python -m backport tells whether "
            "it has the bug; backport.apply() patches it"
        )
    return f"not applied: torch {version} has the bug; call backport.apply()"
