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
which all six public state-dict functions call before anything else. The
wrapper first reshards every FSDP2 group that owns parameters of the module
passed in (``FSDPModule.reshard()`` on each FSDP module in it; for a plain
submodule inside a group, the state-dict pre-hook FSDP2 registered on it), with
no collective and as a no-op on sharded groups, then builds the mapping once.
An optimizer param the model does not own raises a ``ValueError`` that names it.

Targets torch 2.8 to 2.15 (``_SUPPORTED``). The same change is proposed
upstream (``torch_patch/`` in this project). Vendor as-is: this file needs only
the standard library and torch, and importing it changes nothing.

    import backport
    backport.apply()     # idempotent, thread-safe
    backport.status()    # "applied: ..." / "not applied: ..." / ...
    backport.revert()    # restores the original function object
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
_SUPPORTED = ((2, 8), (2, 15))
# Breakpoint: no torch release contains the fix yet. A torch carrying it (a
# release, or one with torch_patch/ applied) defines this helper in the target.
_FIX_ARTIFACT = "_reshard_fsdp2_modules"
# Set on the wrapper installed in torch, so every vendored copy agrees.
_MARKER = "_fsdp2_eval_reshard_backport"
_PARAMS = "params"

_lock = threading.Lock()


class UnsupportedTorchError(RuntimeError):
    """The installed torch is outside the supported range or changed shape."""


class BackportWarning(RuntimeWarning):
    """The backport did nothing, and the caller should know why."""


# The helpers below and the body of the wrapper are the upstream change in
# torch_patch/: test/test_patch_matches_backport.py fails if they drift apart.


def _reshard_fsdp2_modules(model: nn.Module) -> None:
    """Reshard the FSDP2 parameters of ``model`` that a forward left unsharded."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP

    # A forward without backward (e.g. an evaluation under torch.no_grad()) or
    # an explicit unshard() leaves groups with reshard_after_forward=False or an
    # int unsharded while the optimizers hold the sharded parameters. reshard()
    # is not recursive, issues no collective and is a no-op on a sharded group.
    outside: list[nn.Module] = [model]
    inside: list[nn.Module | None] = []
    while outside:
        module = outside.pop()
        if isinstance(module, FSDPModule):
            inside.append(module)
        elif isinstance(module, FSDP):
            # FSDP1 keeps its FlatParameters registered, and its state_dict
            # hooks issue collectives.
            continue
        elif module._state_dict_pre_hooks:
            # Parameters of a module outside every FSDPModule in ``model`` can
            # belong to the group of an FSDPModule above ``model``, which only
            # the state_dict pre-hook FSDP2 registers on the module reshards.
            module.state_dict(keep_vars=True)
        else:
            outside.extend(module.children())
    while inside:
        submodule = inside.pop()
        if submodule is None:
            continue
        if isinstance(submodule, FSDPModule):
            submodule.reshard()
        # _modules rather than children(): this loop visits every module.
        inside.extend(submodule._modules.values())


def _verify_optim_params_owned(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    fqn_param_mapping: dict[str | torch.Tensor, set[str] | torch.Tensor],
) -> None:
    """Raise a ValueError naming the first optimizer param ``model`` does not own."""
    for optim_idx, optim in enumerate(optims):
        for group_idx, param_group in enumerate(optim.param_groups):
            for param_idx, param in enumerate(param_group[_PARAMS]):
                if param in fqn_param_mapping:
                    continue
                raise ValueError(
                    f"Optimizer {optim_idx} ({type(optim).__name__}) holds a "
                    f"parameter that {type(model).__name__} does not own: "
                    f"param_groups[{group_idx}]['params'][{param_idx}], "
                    f"{type(param).__name__} of shape {tuple(param.shape)}. Build "
                    "the optimizer from this model's parameters after "
                    "fully_shard(), and pass the same model to the state_dict "
                    "functions."
                )


def _make_wrapper(verify_options: Callable) -> Callable:
    @functools.wraps(verify_options)
    def _verify_options(
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        optim_only: bool,
        *,
        submodules: set[nn.Module] | None = None,
        options: StateDictOptions | None = None,
    ) -> _StateDictInfo:
        _reshard_fsdp2_modules(model)
        info = verify_options(
            model, optims, optim_only, submodules=submodules, options=options
        )
        # FSDP1, whose optimizers hold FlatParameters, is left as it was.
        if not info.fsdp_modules:
            _verify_optim_params_owned(model, optims, info.fqn_param_mapping)
        return info

    setattr(_verify_options, _MARKER, __version__)
    return _verify_options


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
    if _applied_version(target) is None and hasattr(module, _FIX_ARTIFACT):
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
            current = getattr(module, _TARGET_NAME)
            if _applied_version(current) is None:
                setattr(module, _TARGET_NAME, _make_wrapper(current))
    if reason is not None:
        warnings.warn(f"backport.apply() did nothing: {reason}.", BackportWarning, stacklevel=2)
    return status()


def revert() -> str:
    """Restore the original ``_verify_options``. Returns the ``status()`` line.

    Leaves the attribute alone, with a BackportWarning, when something other
    than this backport's wrapper is installed there now.
    """
    _, module = _target_module()
    with _lock:
        current = getattr(module, _TARGET_NAME, None)
        if _applied_version(current) is not None:
            setattr(module, _TARGET_NAME, current.__wrapped__)
        elif getattr(current, "__wrapped__", None) is not None:
            warnings.warn(
                f"{_TARGET_MODULE}.{_TARGET_NAME} is wrapped by something other "
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
