"""apply() / revert() / status() on the installed torch, in this process."""

import threading
import types
import unittest
import warnings

import expecttest
import torch
import torch.distributed.checkpoint.state_dict as dsd

import backport


def _render(line: str) -> str:
    return line.replace(str(torch.__version__), "<torch>").replace(
        backport.__version__, "<version>"
    )


class ApplyRevertTest(expecttest.TestCase):
    def setUp(self) -> None:
        self.assertFalse(backport.is_applied(), "a previous test left the backport applied")
        self.original = dsd._verify_options

    def tearDown(self) -> None:
        backport.revert()
        self.assertIs(dsd._verify_options, self.original)

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
            """applied: torch <torch>, torch.distributed.checkpoint.state_dict._verify_options wrapped (backport <version>)""",
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
        start = threading.Barrier(8)

        def race() -> None:
            start.wait()
            backport.apply()

        threads = [threading.Thread(target=race) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # One layer of wrapping, whatever the interleaving.
        self.assertIs(dsd._verify_options.__wrapped__, self.original)

    def test_revert_restores_the_original_object(self) -> None:
        backport.apply()
        line = backport.revert()
        self.assertIs(dsd._verify_options, self.original)
        self.assertExpectedInline(
            _render(line), """not applied: torch <torch> has the bug; call backport.apply()"""
        )
        # Reverting again is a no-op.
        backport.revert()
        self.assertIs(dsd._verify_options, self.original)

    def test_revert_leaves_a_foreign_wrapper_alone(self) -> None:
        backport.apply()
        ours = dsd._verify_options

        def foreign(*args, **kwargs):
            return ours(*args, **kwargs)

        foreign.__wrapped__ = ours
        dsd._verify_options = foreign
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                backport.revert()
            self.assertIs(dsd._verify_options, foreign)
            self.assertExpectedInline(
                "\n".join(f"{w.category.__name__}: {w.message}" for w in caught),
                """BackportWarning: torch.distributed.checkpoint.state_dict._verify_options is wrapped by something other than this backport; it was left as it is. Revert that patch first.""",
            )
        finally:
            dsd._verify_options = ours


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
            backport._check_support(version, module)
        return str(ctx.exception)

    def test_installed_torch_is_supported(self) -> None:
        self.assertIsNone(backport._check_support(torch.__version__, dsd))

    def test_source_build_version_is_supported(self) -> None:
        # "2.13.0a0+git..." sorts before "2.13.0" but is a 2.13 build.
        self.assertIsNone(backport._check_support("2.13.0a0+gitabc1234", dsd))

    def test_too_old(self) -> None:
        self.assertExpectedInline(
            self._error("2.6.0+cu124", dsd),
            """torch 2.6.0+cu124 is not supported by this backport (supported: torch 2.7 to 2.15); install a supported torch, or check whether your torch already fixes FSDP2 optimizer state dicts after evaluation and drop the backport.""",
        )

    def test_too_new(self) -> None:
        self.assertExpectedInline(
            self._error("2.16.0", dsd),
            """torch 2.16.0 is not supported by this backport (supported: torch 2.7 to 2.15); install a supported torch, or check whether your torch already fixes FSDP2 optimizer state dicts after evaluation and drop the backport.""",
        )

    def test_changed_signature(self) -> None:
        def _verify_options(model, optims, *, options=None):
            pass

        self.assertExpectedInline(
            self._error("2.13.0", _module_with(_verify_options)),
            """torch 2.13.0 changed torch.distributed.checkpoint.state_dict._verify_options (expected parameters ('model', 'optims', 'optim_only', 'submodules', 'options'), found ('model', 'optims', 'options')); this backport supports torch 2.7 to 2.15 as released.""",
        )

    def test_missing_function(self) -> None:
        module = types.ModuleType("fake_state_dict")
        self.assertExpectedInline(
            self._error("2.13.0", module),
            """torch 2.13.0 has no torch.distributed.checkpoint.state_dict._verify_options; this backport supports torch 2.7 to 2.15 as released.""",
        )

    def test_torch_with_the_fix_needs_nothing(self) -> None:
        def _verify_options(model, optims, optim_only, *, submodules=None, options=None):
            _reshard_fsdp2_modules(model)  # noqa: F821 - never called

        module = _module_with(_verify_options)
        for version in ("2.13.0", "2.16.0"):
            self.assertExpectedInline(
                backport._check_support(version, module).replace(version, "<v>"),
                """torch <v> already contains the fix; remove the backport""",
            )


if __name__ == "__main__":
    unittest.main()
