"""Make DCP optimizer state dicts work after an FSDP2 evaluation forward.

An FSDP2 group with ``reshard_after_forward=False`` (the root's default) or an
``int`` stays unsharded after a forward that has no backward, for example an
evaluation under ``torch.no_grad()``. The model then holds the unsharded
parameters while the optimizer holds the sharded DTensors, and
``torch.distributed.checkpoint.state_dict`` fails to map optimizer params to
FQNs: ``get_optimizer_state_dict`` raises ``KeyError: 0``,
``set_optimizer_state_dict`` / ``set_state_dict`` raise ``KeyError: DTensor(...)``,
and a full ``set_model_state_dict`` mixes Tensors and DTensors.

``apply()`` wraps ``torch.distributed.checkpoint.state_dict._verify_options``,
which all six public state-dict functions call before anything else. Once the
options are valid, the wrapper calls ``FSDPModule.reshard()`` on every FSDP2
module in the module passed in (no collective, a no-op on sharded groups) and,
for a plain module passed in, FSDP2's own state-dict pre-hook on the modules
below it, which reshards a group owned by an FSDP module above it. Nothing else
runs: no other hook, no ``state_dict()``. Four more functions are wrapped so
that where torch raises a bare ``KeyError`` for an optimizer parameter the model
does not own, a ``ValueError`` names it and its likely cause instead, and so
that the same error, not a crash, meets a never-stepped optimizer whose
parameters' memory FSDP2 has freed.

Targets torch 2.7 to 2.15 (``_SUPPORTED``). The same change is proposed
upstream (``torch_patch/`` in this project). Vendor as-is: this file needs only
the standard library and torch, and importing it changes nothing.

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
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable


if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        _StateDictInfo,
    )


__all__ = [
    "BackportWarning",
    "UnsupportedTorchError",
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
# Releases measured to have the bug and the function shape patched here.
_SUPPORTED = ((2, 7), (2, 15))
# Breakpoint: no torch release contains the fix yet. In a torch carrying it (a
# release, or one with torch_patch/ applied) _verify_options calls reshard().
_FIX_ARTIFACT = "reshard"
# Set on the wrapper installed in torch, so every vendored copy agrees.
_MARKER = "_fsdp2_eval_reshard_backport"
_PARAMS = "params"

_lock = threading.Lock()


class UnsupportedTorchError(RuntimeError):
    """The installed torch is outside the supported range or changed shape."""


class BackportWarning(RuntimeWarning):
    """The backport did nothing, and the caller should know why."""


# The helpers below are the upstream change in torch_patch/, statement for
# statement: test/test_patch_matches_backport.py fails if they drift apart.

# The state_dict pre-hook that FSDP2 registers on each module holding its params.
_FSDP2_TO_SHARDED_HOOK = (
    "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"
)


def _reshard_fsdp2_modules(model: nn.Module) -> None:
    """What 0001 and 0002 add to ``_verify_options`` once the options are valid."""
    from torch.distributed.fsdp import FSDPModule

    # A forward without backward (e.g. an evaluation under torch.no_grad()) or
    # FSDPModule.unshard() leaves FSDP2 parameters unsharded while optimizers
    # hold the sharded ones. reshard() issues no collective.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    if not isinstance(model, FSDPModule):
        # A submodule passed in can hold parameters of an FSDPModule above it,
        # which only FSDP2's state_dict pre-hook on the submodule reaches.
        for module in model.modules():
            for hook in module._state_dict_pre_hooks.values():
                if getattr(hook, "__qualname__", None) == _FSDP2_TO_SHARDED_HOOK:
                    hook(module, "", True)


def _unowned_optim_param_error(
    optim: torch.optim.Optimizer, param: torch.Tensor
) -> ValueError:
    """Return the error for an optimizer parameter that the model does not own."""
    where = next(
        f"param_groups[{group_idx}]['params'][{param_idx}]"
        for group_idx, param_group in enumerate(optim.param_groups)
        for param_idx, group_param in enumerate(param_group[_PARAMS])
        if group_param is param
    )
    return ValueError(
        f"{type(optim).__name__} holds a parameter that the model does not own: "
        f"{where}, {type(param).__name__} of shape {tuple(param.shape)}. Likely "
        "causes: the optimizer was built while FSDP2 modules were unsharded "
        "(after a forward without backward, or FSDPModule.unshard()), so it "
        "holds parameters that FSDP2 has replaced since; or the parameter "
        "belongs to another module. Build the optimizer from model.parameters() "
        "right after fully_shard(), and pass the model that owns all of its "
        "parameters."
    )


def _verify_optim_params_allocated(optim: torch.optim.Optimizer) -> None:
    """Raise if ``optim`` holds a parameter whose memory has been freed.

    An optimizer built while FSDP2 modules were unsharded holds their unsharded
    parameters, whose memory ``reshard()`` frees: ``step()`` on one crashes.
    """
    for param_group in optim.param_groups:
        for param in param_group[_PARAMS]:
            freed = param.numel() > 0 and param.untyped_storage().size() == 0
            if param.requires_grad and freed:
                raise _unowned_optim_param_error(optim, param)


def _options_are_valid(
    optims: tuple[torch.optim.Optimizer, ...],
    optim_only: bool,
    options: StateDictOptions | None,
) -> bool:
    """Whether ``_verify_options`` accepts these; it raises its own error if not."""
    if optim_only and not optims:
        return False
    return not (
        options is not None and options.broadcast_from_rank0 and not options.full_state_dict
    )


def _wrap_verify_options(verify_options: Callable) -> Callable:
    @functools.wraps(verify_options)
    def _verify_options(
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        optim_only: bool,
        *,
        submodules: set[nn.Module] | None = None,
        options: StateDictOptions | None = None,
    ) -> _StateDictInfo:
        # 0001 reshards after the option checks: an invalid call changes nothing.
        if _options_are_valid(optims, optim_only, options):
            _reshard_fsdp2_modules(model)
        return verify_options(
            model, optims, optim_only, submodules=submodules, options=options
        )

    return _verify_options


def _wrap_get_optim_state_dict(get_optim_state_dict: Callable) -> Callable:
    # 0003 raises where this function's pid -> FQN lookup raises KeyError(pid).
    @functools.wraps(get_optim_state_dict)
    def _get_optim_state_dict(model, optimizers, info):
        try:
            return get_optim_state_dict(model, optimizers, info)
        except KeyError as err:
            pid = err.args[0] if len(err.args) == 1 else None
            if info.fsdp_modules or not isinstance(pid, int):
                raise
            owned = {id(param) for _, param in model.named_parameters()}
            for optim in optimizers:
                params = [p for group in optim.param_groups for p in group[_PARAMS]]
                if 0 <= pid < len(params) and id(params[pid]) not in owned:
                    raise _unowned_optim_param_error(optim, params[pid]) from err
            raise

    return _get_optim_state_dict


def _wrap_param_to_fqns(split_or_unflatten: Callable, optim_arg: int) -> Callable:
    # 0003 raises where info.fqn_param_mapping[param] raises KeyError(param).
    @functools.wraps(split_or_unflatten)
    def wrapper(*args):
        try:
            return split_or_unflatten(*args)
        except KeyError as err:
            optim, info = args[optim_arg], args[-1]
            params = (p for group in optim.param_groups for p in group[_PARAMS])
            unowned = next((p for p in params if p not in info.fqn_param_mapping), None)
            if unowned is None or len(err.args) != 1 or err.args[0] is not unowned:
                raise
            raise _unowned_optim_param_error(optim, unowned) from err

    return wrapper


def _wrap_init_optim_state(init_optim_state: Callable) -> Callable:
    # 0003 checks right before the zero-grad step(), after the early returns.
    @functools.wraps(init_optim_state)
    def _init_optim_state(optim):
        if not optim.state and all(
            param.grad is None for group in optim.param_groups for param in group[_PARAMS]
        ):
            _verify_optim_params_allocated(optim)
        return init_optim_state(optim)

    return _init_optim_state


# name in the target module -> wrapper factory for the function found there
_WRAPPERS: dict[str, Callable[[Callable], Callable]] = {
    _TARGET_NAME: _wrap_verify_options,
    "_get_optim_state_dict": _wrap_get_optim_state_dict,
    "_split_optim_state_dict": lambda fn: _wrap_param_to_fqns(fn, optim_arg=1),
    "_unflatten_optim_state_dict": lambda fn: _wrap_param_to_fqns(fn, optim_arg=0),
    "_init_optim_state": _wrap_init_optim_state,
}


def _make_wrapper(name: str, original: Callable) -> Callable:
    wrapper = _WRAPPERS[name](original)
    setattr(wrapper, _MARKER, __version__)
    return wrapper


def _applied_version(obj: object) -> str | None:
    """The backport version that made the wrapper ``obj``, or None for anything else."""
    return getattr(obj, _MARKER, None)


def _torch_release(version: str) -> tuple[int, int] | None:
    # "2.13.0a0+git1234" is a 2.13 source build: compare major.minor only.
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def _supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = _SUPPORTED
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def _check_support(version: str, module: ModuleType) -> str | None:
    """Return why ``module`` of torch ``version`` needs no patch, or None.

    Raises UnsupportedTorchError when it can be neither patched nor skipped.
    """
    target = getattr(module, _TARGET_NAME, None)
    if _applied_version(target) is None and _FIX_ARTIFACT in getattr(
        getattr(target, "__code__", None), "co_names", ()
    ):
        return f"torch {version} already contains the fix; remove the backport"
    release = _torch_release(version)
    if release is None or not _SUPPORTED[0] <= release <= _SUPPORTED[1]:
        raise UnsupportedTorchError(
            f"torch {version} is not supported by this backport (supported: "
            f"torch {_supported_range()}); install a supported torch, or check "
            "whether your torch already fixes FSDP2 optimizer state dicts "
            "after evaluation and drop the backport."
        )
    if target is None:
        raise UnsupportedTorchError(
            f"torch {version} has no {_TARGET_MODULE}.{_TARGET_NAME}; this backport "
            f"supports torch {_supported_range()} as released."
        )
    original = getattr(target, "__wrapped__", target)
    code = getattr(original, "__code__", None)
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] if code else ()
    if tuple(names) != _TARGET_PARAMS:
        raise UnsupportedTorchError(
            f"torch {version} changed {_TARGET_MODULE}.{_TARGET_NAME} (expected "
            f"parameters {_TARGET_PARAMS}, found {tuple(names) or repr(target)}); this "
            f"backport supports torch {_supported_range()} as released."
        )
    missing = [name for name in _WRAPPERS if not callable(getattr(module, name, None))]
    if missing:
        raise UnsupportedTorchError(
            f"torch {version} has no {_TARGET_MODULE}.{missing[0]}; this backport "
            f"supports torch {_supported_range()} as released."
        )
    return None


def _target_module() -> tuple[ModuleType, ModuleType]:
    import torch
    import torch.distributed.checkpoint.state_dict as state_dict_module

    return torch, state_dict_module


def apply() -> str:
    """Patch the installed torch so DCP state dicts work after an FSDP2 evaluation.

    Idempotent and thread-safe. Returns the ``status()`` line.

    Raises:
        UnsupportedTorchError: torch is outside the supported range, or its
            ``_verify_options`` no longer has the shape this backport wraps.
    """
    torch, module = _target_module()
    with _lock:
        reason = _check_support(torch.__version__, module)
        if reason is None:
            for name in _WRAPPERS:
                current = getattr(module, name)
                if _applied_version(current) is None:
                    setattr(module, name, _make_wrapper(name, current))
    if reason is not None:
        warnings.warn(f"backport.apply() did nothing: {reason}.", BackportWarning, stacklevel=2)
    return status()


def revert() -> str:
    """Restore the original functions. Returns the ``status()`` line.

    Leaves an attribute alone, with a BackportWarning, when something else has
    wrapped this backport's wrapper there since.
    """
    _, module = _target_module()
    with _lock:
        for name in _WRAPPERS:
            current = getattr(module, name, None)
            if _applied_version(current) is not None:
                setattr(module, name, current.__wrapped__)
            elif _applied_version(getattr(current, "__wrapped__", None)) is not None:
                warnings.warn(
                    f"{_TARGET_MODULE}.{name} is wrapped by something other "
                    "than this backport; it was left as it is. Revert that patch first.",
                    BackportWarning,
                    stacklevel=2,
                )
    return status()


def is_applied() -> bool:
    """Whether this backport's wrapper is installed in torch now."""
    _, module = _target_module()
    return _applied_version(getattr(module, _TARGET_NAME, None)) is not None


def get_original() -> Any:
    """The unpatched ``_verify_options`` (the live one when nothing is applied)."""
    _, module = _target_module()
    current = getattr(module, _TARGET_NAME)
    if _applied_version(current) is not None:
        return current.__wrapped__
    return current


def status() -> str:
    """One line: ``applied``, ``not applied``, ``not needed`` or ``unsupported``."""
    torch, module = _target_module()
    where = f"{_TARGET_MODULE}.{_TARGET_NAME}"
    current = getattr(module, _TARGET_NAME, None)
    applied_version = _applied_version(current)
    if applied_version is not None:
        return f"applied: torch {torch.__version__}, {where} wrapped (backport {applied_version})"
    try:
        reason = _check_support(torch.__version__, module)
    except UnsupportedTorchError as err:
        return f"unsupported: {err}"
    if reason is not None:
        return f"not needed: {reason}"
    return f"not applied: torch {torch.__version__} has the bug; call backport.apply()"
