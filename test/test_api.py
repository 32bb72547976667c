"""apply() / revert() / status() on the installed torch, in this process."""

import ast
import contextlib
import functools
import importlib.util
import re
import sys
import tempfile
import threading
import types
import unittest
import warnings
from collections import Counter
from pathlib import Path

import expecttest
import pytest
import torch
import torch.distributed.checkpoint.state_dict as dsd
from torch.torch_version import TorchVersion

import backport


pytestmark = pytest.mark.torch27


SOURCE = Path(backport.__file__)


def _render(line: str) -> str:
    return line.replace(str(torch.__version__), "<torch>").replace(
        backport.__version__, "<version>"
    )


class _RecordingModule(types.ModuleType):
    """A module that records the names assigned on it, in order."""

    def __setattr__(self, name: str, value: object) -> None:
        self.__dict__.setdefault("_test_writes", []).append(name)
        super().__setattr__(name, value)


def _check_concurrent_apply(
    test: unittest.TestCase, bp: types.ModuleType, threads: int = 8, rounds: int = 100
) -> None:
    """``threads`` threads enter ``bp.apply()`` together, ``rounds`` times.

    Each round, every function in ``bp._WRAPPERS`` must be assigned exactly once
    (one wrapper, around the exact original), every thread must see the wrappers
    that stay installed once its apply() returns, and ``bp.revert()`` must put
    back the exact original objects.
    """
    originals = {name: getattr(dsd, name) for name in bp._WRAPPERS}
    # Thread switches as often as the interpreter allows, so that a race shows.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    dsd.__class__ = _RecordingModule
    try:

        def race(start: threading.Barrier, seen: list) -> None:
            start.wait()
            bp.apply()
            seen.append({name: getattr(dsd, name) for name in bp._WRAPPERS})

        for _ in range(rounds):
            dsd.__dict__["_test_writes"] = []
            start = threading.Barrier(threads)
            seen = []
            workers = [
                threading.Thread(target=race, args=(start, seen)) for _ in range(threads)
            ]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            writes = dsd.__dict__.pop("_test_writes")
            installed = {name: getattr(dsd, name) for name in bp._WRAPPERS}
            test.assertEqual(
                Counter(writes), Counter(list(bp._WRAPPERS)), "assignments to torch in one round"
            )
            test.assertEqual(len(seen), threads)
            for view in seen:
                for name, wrapper in view.items():
                    test.assertIs(wrapper, installed[name], name)
            for name, wrapper in installed.items():
                test.assertIs(wrapper.__wrapped__, originals[name], name)
            bp.revert()
            for name, original in originals.items():
                test.assertIs(getattr(dsd, name), original, name)
    finally:
        dsd.__class__ = types.ModuleType
        dsd.__dict__.pop("_test_writes", None)
        sys.setswitchinterval(switch_interval)


def _check_revert_restores_everything(test: unittest.TestCase, bp: types.ModuleType) -> None:
    """``bp.apply()`` wraps every function in ``bp._WRAPPERS``; ``bp.revert()`` restores each."""
    originals = {name: getattr(dsd, name) for name in bp._WRAPPERS}
    bp.apply()
    for name, original in originals.items():
        wrapper = getattr(dsd, name)
        test.assertIsNot(wrapper, original, name)
        test.assertIs(wrapper.__wrapped__, original, name)
    line = bp.revert()
    for name, original in originals.items():
        test.assertIs(getattr(dsd, name), original, name)
    test.assertEqual(
        _render(line), "not applied: torch <torch> has the bug; call backport.apply()"
    )
    # Reverting again is a no-op.
    bp.revert()
    for name, original in originals.items():
        test.assertIs(getattr(dsd, name), original, name)


class ApplyRevertTest(expecttest.TestCase):
    def setUp(self) -> None:
        self.assertFalse(backport.is_applied(), "a previous test left the backport applied")
        self.original = dsd._verify_options
        self.originals = {name: getattr(dsd, name) for name in backport._WRAPPERS}

    def tearDown(self) -> None:
        backport.revert()
        for name, original in self.originals.items():
            self.assertIs(getattr(dsd, name), original, name)

    def test_import_changes_nothing(self) -> None:
        self.assertIs(backport.get_original(), dsd._verify_options)
        self.assertExpectedInline(
            _render(backport.status()),
            """not applied: torch <torch> has the bug; call backport.apply()""",
        )

    def test_apply_wraps_and_reports(self) -> None:
        line = backport.apply()
        self.assertExpectedInline(
            _render(line),
            """applied: torch <torch>, 4 functions of torch.distributed.checkpoint.state_dict wrapped (backport <version>)""",
        )
        self.assertEqual(line, backport.status())
        self.assertIsNot(dsd._verify_options, self.original)
        self.assertIs(dsd._verify_options.__wrapped__, self.original)
        self.assertIs(backport.get_original(), self.original)

    def test_apply_is_idempotent(self) -> None:
        backport.apply()
        wrapper = dsd._verify_options
        backport.apply()
        self.assertIs(dsd._verify_options, wrapper)
        self.assertIs(wrapper.__wrapped__, self.original)

    def test_apply_is_thread_safe(self) -> None:
        """Threads entering apply() together install one wrapper per function, once."""
        _check_concurrent_apply(self, backport)

    def test_revert_restores_every_original_object(self) -> None:
        """revert() puts back the exact original of every function apply() wrapped."""
        self.assertExpectedInline("\n".join(sorted(backport._WRAPPERS)), """\
_get_optim_state_dict
_init_optim_state
_load_optim_state_dict
_verify_options""")
        _check_revert_restores_everything(self, backport)

    def test_revert_leaves_a_foreign_wrapper_alone(self) -> None:
        """Whatever wraps the backport's wrapper stays, with a warning, and status() says so."""
        for idiom, wrap in FOREIGN_WRAPPERS.items():
            for name in backport._WRAPPERS:
                with self.subTest(idiom=idiom, name=name):
                    backport.apply()
                    ours = getattr(dsd, name)
                    foreign = wrap(ours)
                    setattr(dsd, name, foreign)
                    try:
                        # apply() sees its wrapper below the foreign one: no second one.
                        backport.apply()
                        self.assertIs(getattr(dsd, name), foreign)
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            line = backport.revert()
                        self.assertIs(getattr(dsd, name), foreign)
                        self.assertEqual(
                            [f"{w.category.__name__}: {w.message}" for w in caught],
                            [
                                (
                                    f"BackportWarning: {backport._TARGET_MODULE}.{name} is "
                                    "wrapped by something other than this backport; it was "
                                    f"left as it is. Remove the wrapper over {name} first."
                                )
                            ],
                        )
                        # The other three are reverted; calls to this one still go
                        # through the backport's wrapper below the foreign one, and
                        # the line says what to do first (not revert() again).
                        others = ", ".join(n for n in backport._WRAPPERS if n != name)
                        self.assertEqual(
                            _render(line),
                            f"partly applied: torch <torch>, {backport._TARGET_MODULE} has "
                            f"{name} wrapped but not {others}; remove the wrapper over "
                            f"{name} first, then call backport.revert(), or call "
                            "backport.apply() to wrap all 4",
                        )
                        self.assertFalse(backport.is_applied())
                        self.assertIs(backport.get_original(), self.original)
                    finally:
                        setattr(dsd, name, ours)
                        backport.revert()
                    self.assertFalse(backport.is_applied())

    def test_revert_under_foreign_wrappers_over_all_four(self) -> None:
        """With every wrapper covered, revert() only warns and status() still says applied."""
        backport.apply()
        ours = {name: getattr(dsd, name) for name in backport._WRAPPERS}
        try:
            for name, wrapper in ours.items():
                setattr(dsd, name, _wraps(wrapper))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                line = backport.revert()
            self.assertEqual(
                [w.category for w in caught], [backport.BackportWarning] * len(ours)
            )
            self.assertTrue(backport.is_applied())
            self.assertExpectedInline(
                _render(line),
                """applied: torch <torch>, 4 functions of torch.distributed.checkpoint.state_dict wrapped (backport <version>)""",
            )
        finally:
            for name, wrapper in ours.items():
                setattr(dsd, name, wrapper)
            backport.revert()
        self.assertFalse(backport.is_applied())

    def test_query_functions_follow_all_four_wrappers(self) -> None:
        """is_applied(), get_original() and status() see a function restored behind revert()'s back."""
        for name, original in self.originals.items():
            with self.subTest(name=name):
                backport.apply()
                setattr(dsd, name, original)
                self.assertFalse(backport.is_applied())
                self.assertIs(backport.get_original(), self.original)
                wrapped = ", ".join(n for n in backport._WRAPPERS if n != name)
                self.assertEqual(
                    _render(backport.status()),
                    f"partly applied: torch <torch>, {backport._TARGET_MODULE} has {wrapped} "
                    f"wrapped but not {name}; call backport.apply() to wrap all 4, or "
                    "backport.revert()",
                )
                # apply() completes a partial state, revert() undoes it all.
                self.assertTrue(backport.apply().startswith("applied: "))
                backport.revert()
        # Only one wrapped: the line names the three others.
        backport.apply()
        for name in ("_verify_options", "_get_optim_state_dict", "_load_optim_state_dict"):
            setattr(dsd, name, self.originals[name])
        self.assertIs(backport.get_original(), self.original)
        self.assertExpectedInline(
            _render(backport.status()),
            """partly applied: torch <torch>, torch.distributed.checkpoint.state_dict has _init_optim_state wrapped but not _verify_options, _get_optim_state_dict, _load_optim_state_dict; call backport.apply() to wrap all 4, or backport.revert()""",
        )


class _CallableWrapper:
    """A wrapper that is an object, not a function, as decorator libraries make."""

    def __init__(self, wrapped) -> None:
        functools.update_wrapper(self, wrapped)

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)


def _wraps(ours):
    @functools.wraps(ours)
    def foreign(*args, **kwargs):
        return ours(*args, **kwargs)

    return foreign


def _wrapped_by_hand(ours):
    def foreign(*args, **kwargs):
        return ours(*args, **kwargs)

    foreign.__wrapped__ = ours
    return foreign


# The ways another library wraps a function: functools.wraps copies the
# wrapper's __dict__, the backport's marker included.
FOREIGN_WRAPPERS = {
    "functools.wraps": _wraps,
    "__wrapped__ set by hand": _wrapped_by_hand,
    "callable object, functools.update_wrapper": _CallableWrapper,
}


def _one(nodes, what: str):
    found = list(nodes)
    if len(found) != 1:
        raise AssertionError(
            f"backport/__init__.py has {len(found)} {what}, the mutation expects one: "
            "update the mutation to the new code"
        )
    return found[0]


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return _one(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name),
        f"module-level def {name}()",
    )


def _without_apply_lock(tree: ast.Module, sleep: float) -> None:
    """apply() without its lock, sleeping ``sleep`` s before each assignment."""
    apply = _function(tree, "apply")
    locked = _one(
        (
            node
            for node in ast.walk(apply)
            if isinstance(node, ast.With)
            and [ast.unparse(item.context_expr) for item in node.items] == ["_lock"]
        ),
        "'with _lock:' in apply()",
    )
    locked.items = [
        ast.withitem(ast.parse("__import__('contextlib').nullcontext()").body[0].value)
    ]
    sleeps = 0
    for node in ast.walk(apply):
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            mutated = []
            for statement in statements:
                if sleep and ast.unparse(statement).startswith("setattr(module, name,"):
                    mutated.append(ast.parse(f"__import__('time').sleep({sleep})").body[0])
                    sleeps += 1
                mutated.append(statement)
            setattr(node, field, mutated)
    if sleep and sleeps != 1:
        raise AssertionError(
            f"backport/__init__.py has {sleeps} 'setattr(module, name, ...)' in apply(), "
            "the mutation expects one: update the mutation to the new code"
        )


def _revert_only(tree: ast.Module, names: str) -> None:
    """revert() restores only ``names`` (an expression), not every name in _WRAPPERS."""
    loop = _one(
        (
            node
            for node in ast.walk(_function(tree, "revert"))
            if isinstance(node, ast.For) and ast.unparse(node.iter) == "_WRAPPERS"
        ),
        "'for ... in _WRAPPERS:' in revert()",
    )
    loop.iter = ast.parse(names, mode="eval").body


class MutationTest(unittest.TestCase):
    """The two checks above fail on copies of backport/__init__.py with the bug they target."""

    def setUp(self) -> None:
        self.originals = {name: getattr(dsd, name) for name in backport._WRAPPERS}
        # A mutated copy may leave its wrappers installed.
        self.addCleanup(self._restore)
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = Path(tmp.name)

    def _restore(self) -> None:
        for name, original in self.originals.items():
            setattr(dsd, name, original)

    def _mutant(self, label: str, mutate) -> types.ModuleType:
        tree = ast.parse(SOURCE.read_text())
        mutate(tree)
        path = self.tmp / f"backport_{label}.py"
        path.write_text(ast.unparse(ast.fix_missing_locations(tree)))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def test_unmutated_copy_passes(self) -> None:
        """Loading a copy under another name does not by itself fail the checks."""
        copy = self._mutant("copy", lambda tree: None)
        _check_concurrent_apply(self, copy)
        _check_revert_restores_everything(self, copy)

    def test_apply_without_lock_fails_the_thread_check(self) -> None:
        """apply() without its lock, 50 ms between its check and its assignment."""
        unlocked = self._mutant("unlocked", lambda tree: _without_apply_lock(tree, 0.05))
        with self.assertRaises(AssertionError):
            _check_concurrent_apply(self, unlocked, rounds=5)

    def test_revert_of_one_function_fails_the_revert_check(self) -> None:
        """revert() that restores only _verify_options, or all but one function."""
        mutations = {
            "only_the_target": "(_TARGET_NAME,)",
            **{
                f"all_but{name}": f"[n for n in _WRAPPERS if n != {name!r}]"
                for name in backport._WRAPPERS
            },
        }
        for label, names in mutations.items():
            with self.subTest(label):
                partial = self._mutant(label, lambda tree, names=names: _revert_only(tree, names))
                with self.assertRaises(AssertionError):
                    _check_revert_restores_everything(self, partial)
                self._restore()


def _module_with(verify_options, **attrs) -> types.ModuleType:
    module = types.ModuleType("fake_state_dict")
    module._verify_options = verify_options
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


class SupportGateTest(expecttest.TestCase):
    """The version and shape gate, fed versions and modules other than the installed ones."""

    def _error(self, version: str, module: types.ModuleType) -> str:
        with self.assertRaises(backport.UnsupportedTorchError) as ctx:
            backport._why_no_patch_needed(version, module)
        return str(ctx.exception)

    def test_installed_torch_is_supported(self) -> None:
        self.assertIsNone(backport._why_no_patch_needed(torch.__version__, dsd))

    def test_source_build_version_is_supported(self) -> None:
        # "2.13.0a0+git..." sorts before "2.13.0" but is a 2.13 build.
        self.assertIsNone(backport._why_no_patch_needed("2.13.0a0+gitabc1234", dsd))

    def test_too_old(self) -> None:
        self.assertExpectedInline(
            self._error("2.6.0+cu124", dsd),
            """torch 2.6.0+cu124 is older than the releases this backport supports (2.7 to 2.15), so this backport cannot patch it safely; install a supported torch (pip install "torch>=2.7,<2.16"), or apply torch_patch/ to your torch, or remove backport.apply() if your torch fixes the bug (python -m backport tells).""",
        )

    def test_newer_release_with_the_same_shape_is_patched(self) -> None:
        # apply() warns on it (UpgradeBoundaryTest); the gate lets it through.
        for version in ("2.16.0", "3.0.0"):
            self.assertIsNone(backport._why_no_patch_needed(version, dsd), version)

    def test_unreadable_version(self) -> None:
        self.assertExpectedInline(
            self._error("nightly", dsd),
            """torch 'nightly' has a version this backport cannot read, so this backport cannot patch it safely; install a supported torch (pip install "torch>=2.7,<2.16"), or apply torch_patch/ to your torch, or remove backport.apply() if your torch fixes the bug (python -m backport tells).""",
        )

    def test_changed_signature(self) -> None:
        def _verify_options(model, optims, *, options=None):
            pass

        self.assertExpectedInline(
            self._error("2.13.0", _module_with(_verify_options)),
            """torch 2.13.0 changed torch.distributed.checkpoint.state_dict._verify_options (expected parameters ('model', 'optims', 'optim_only', 'submodules', 'options'), found ('model', 'optims', 'options')), so this backport cannot patch it safely; install a supported torch (pip install "torch>=2.7,<2.16"), or apply torch_patch/ to your torch, or remove backport.apply() if your torch fixes the bug (python -m backport tells).""",
        )

    def test_missing_function(self) -> None:
        module = types.ModuleType("fake_state_dict")
        self.assertExpectedInline(
            self._error("2.13.0", module),
            """torch 2.13.0 has no torch.distributed.checkpoint.state_dict._verify_options, so this backport cannot patch it safely; install a supported torch (pip install "torch>=2.7,<2.16"), or apply torch_patch/ to your torch, or remove backport.apply() if your torch fixes the bug (python -m backport tells).""",
        )

    def test_torch_with_the_fix_needs_nothing(self) -> None:
        def _verify_options(model, optims, optim_only, *, submodules=None, options=None):
            _reshard_fsdp2_modules(model)  # noqa: F821 - never called

        module = _module_with(_verify_options)
        for version in ("2.13.0", "2.16.0"):
            self.assertExpectedInline(
                backport._why_no_patch_needed(version, module).replace(version, "<v>"),
                """torch <v> already contains the fix; remove the backport""",
            )


@contextlib.contextmanager
def _torch_version(version: str):
    """torch.__version__ reads ``version`` inside the block (torch's functions untouched)."""
    installed = torch.__version__
    torch.__version__ = TorchVersion(version)
    try:
        yield
    finally:
        torch.__version__ = installed


def _fixed_verify_options(model, optims, optim_only, *, submodules=None, options=None):
    """What a torch carrying the fix has: _verify_options calls _reshard_fsdp2_modules."""
    _reshard_fsdp2_modules(model)  # noqa: F821 - never called


def _reshaped_verify_options(
    model, optims, optim_only, *, submodules=None, options=None, strict=True
):
    """_verify_options with one parameter more, as a later torch may have."""


def _caught(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [f"{w.category.__name__}: {w.message}" for w in caught]


class UpgradeBoundaryTest(expecttest.TestCase):
    """apply() and status() on a torch version other than the installed one.

    The version is faked by setting torch.__version__; a torch that carries the
    fix or changed shape by putting another function in place of _verify_options.
    """

    def setUp(self) -> None:
        self.originals = {name: getattr(dsd, name) for name in backport._WRAPPERS}
        self.addCleanup(self._restore)

    def _restore(self) -> None:
        backport.revert()
        for name, original in self.originals.items():
            setattr(dsd, name, original)

    def _unpatched(self) -> None:
        for name, original in self.originals.items():
            self.assertIs(getattr(dsd, name), original, name)

    def test_newer_torch_with_the_same_shape_is_patched_with_one_warning(self) -> None:
        with _torch_version("2.16.0"):
            self.assertExpectedInline(backport.status(), """not applied: torch 2.16.0 (untested: newer than 2.7 to 2.15); python -m backport tells whether it has the bug; backport.apply() patches it""")
            line, caught = _caught(backport.apply)
            self.assertExpectedInline("\n".join(caught), """UntestedTorchWarning: torch 2.16.0 is newer than the releases this backport supports (2.7 to 2.15) and was patched because the functions it wraps keep their shape; run `python -m backport` to check whether this torch still needs it.""")
            self.assertTrue(backport.is_applied())
            self.assertExpectedInline(line.replace(backport.__version__, "<version>"), """applied: torch 2.16.0 (untested: newer than 2.7 to 2.15), 4 functions of torch.distributed.checkpoint.state_dict wrapped (backport <version>)""")
            # The later, idempotent calls are silent.
            self.assertEqual(_caught(backport.apply), (line, []))

    def test_strict_mode_raises_and_leaves_torch_unpatched(self) -> None:
        with _torch_version("2.16.0"), warnings.catch_warnings():
            warnings.simplefilter("error", backport.UntestedTorchWarning)
            with self.assertRaises(backport.UntestedTorchWarning):
                backport.apply()
            self._unpatched()
            self.assertFalse(backport.is_applied())
            self.assertTrue(backport.status().startswith("not applied: torch 2.16.0 "))
        # The filter turns only that warning into an error: a tested torch patches.
        with warnings.catch_warnings():
            warnings.simplefilter("error", backport.UntestedTorchWarning)
            self.assertTrue(backport.apply().startswith("applied: "))

    def test_torch_with_the_fix_is_left_alone(self) -> None:
        dsd._verify_options = _fixed_verify_options
        for version in ("2.13.0", "2.16.0"):
            with self.subTest(version), _torch_version(version):
                line, caught = _caught(backport.apply)
                self.assertEqual(
                    caught,
                    [
                        (
                            f"BackportWarning: backport.apply() did nothing: torch {version} "
                            "already contains the fix; remove the backport."
                        )
                    ],
                )
                self.assertEqual(
                    line,
                    f"not needed: torch {version} already contains the fix; remove the backport",
                )
                self.assertEqual(backport.status(), line)
                self.assertIs(dsd._verify_options, _fixed_verify_options)
                self.assertEqual(backport._backport_wrappers_in(dsd), {})

    def test_older_torch_is_refused_with_the_remedy(self) -> None:
        with _torch_version("2.6.0"):
            with self.assertRaises(backport.UnsupportedTorchError) as ctx:
                backport.apply()
            self._unpatched()
            self.assertExpectedInline(str(ctx.exception), """torch 2.6.0 is older than the releases this backport supports (2.7 to 2.15), so this backport cannot patch it safely; install a supported torch (pip install "torch>=2.7,<2.16"), or apply torch_patch/ to your torch, or remove backport.apply() if your torch fixes the bug (python -m backport tells).""")
            self.assertEqual(backport.status(), f"unsupported: {ctx.exception}")

    def test_changed_shape_is_refused_with_the_remedy(self) -> None:
        dsd._verify_options = _reshaped_verify_options
        with _torch_version("2.16.0"), self.assertRaises(backport.UnsupportedTorchError) as ctx:
            backport.apply()
        self.assertIs(dsd._verify_options, _reshaped_verify_options)
        self.assertEqual(backport._backport_wrappers_in(dsd), {})
        self.assertExpectedInline(ctx.exception.reason, """torch 2.16.0 changed torch.distributed.checkpoint.state_dict._verify_options (expected parameters ('model', 'optims', 'optim_only', 'submodules', 'options'), found ('model', 'optims', 'optim_only', 'submodules', 'options', 'strict')), so this backport cannot patch it safely""")
        self.assertExpectedInline(ctx.exception.remedy, """install a supported torch (pip install "torch>=2.7,<2.16"), or apply torch_patch/ to your torch, or remove backport.apply() if your torch fixes the bug (python -m backport tells)""")


class SupportedRangeTest(unittest.TestCase):
    """``backport._SUPPORTED`` defines the range; what states it elsewhere follows it."""

    def test_statements_of_the_range_follow_supported(self) -> None:
        root = SOURCE.parent.parent
        (lo_major, lo_minor), (hi_major, hi_minor) = backport._SUPPORTED
        stated = f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"
        # The one install command, everywhere it is given.
        install = f'pip install "torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"'
        self.assertIn(install, (root / "README.md").read_text())
        from backport import _diagnose

        self.assertIn(install, _diagnose.__doc__)
        self.assertIn(f"Tested on torch {stated} (``_SUPPORTED``)", backport.__doc__)
        self.assertIn(f'"torch>={lo_major}.{lo_minor}"', (root / "pyproject.toml").read_text())
        # Every release the suite runs on is supported.
        noxfile = (root / "noxfile.py").read_text()
        tested = ast.literal_eval(re.search(r"^TORCH_VERSIONS = (.*)$", noxfile, re.MULTILINE).group(1))
        for version in tested:
            release = tuple(int(part) for part in version.split(".")[:2])
            self.assertTrue(backport._SUPPORTED[0] <= release <= backport._SUPPORTED[1], version)


if __name__ == "__main__":
    unittest.main()
