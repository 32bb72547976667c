"""The optimizer-state errors' types and messages, in one process (no ranks)."""

import traceback
import unittest

import expecttest
import torch
import torch.nn as nn

import backport
from _fsdp_cases import describe_error, get_optimizer_state_dict, unpatched_then_patched


def _kinds(err: BaseException) -> str:
    """Which of the two types a caller may catch the error is."""
    return "/".join(kind.__name__ for kind in (KeyError, ValueError) if isinstance(err, kind))


def _get_optim_outcome(model, optim) -> str:
    """'ok', or get_optimizer_state_dict's error with the types it can be caught as."""
    try:
        get_optimizer_state_dict(model, optim)
    except Exception as err:  # noqa: BLE001 - the message is what we pin
        return f"[{_kinds(err)}] {describe_error(err)}"
    return "ok"


class _NamedStateAdam(torch.optim.Adam):
    """An optimizer whose state_dict() keys its state by name, not by index."""

    def state_dict(self):
        osd = super().state_dict()
        osd["state"] = {f"param{key}": value for key, value in osd["state"].items()}
        return osd


def _state_keyed_by_name() -> str:
    model = nn.Linear(2, 2)
    optim = _NamedStateAdam(model.parameters(), lr=0.1)
    model(torch.ones(2)).sum().backward()
    optim.step()
    return _get_optim_outcome(model, optim)


class StateKeyNotAParamIndexTest(expecttest.TestCase):
    def test_state_keyed_by_name(self) -> None:
        results = unpatched_then_patched(lambda label: _state_keyed_by_name())
        self.assertExpectedInline(results["unpatched"], """[KeyError] KeyError: 'param0'""")
        self.assertExpectedInline(results["patched"], """[KeyError/ValueError] OptimizerParamNotInModelError: _NamedStateAdam.state_dict() holds state under the key 'param0', which is not the index of one of its parameters: these functions map the integer keys that torch.optim.Optimizer.state_dict() uses to FQNs.""")


def _render_choice(error_type: type) -> str:
    """What a caller written for stock torch sees of each error type."""
    message = "Adam holds a parameter that the model does not own: ..."
    lines = []
    for caught_type in (KeyError, ValueError, LookupError):
        try:
            raise error_type(message)
        except caught_type:
            caught = "caught"
        except Exception:  # noqa: BLE001 - what escapes is the result
            caught = "not caught"
        lines.append(f"except {caught_type.__name__}: {caught}")
    err = error_type(message)
    lines.append(f"str(): {err!s}")
    lines.append(f"traceback: {traceback.format_exception_only(err)[-1].strip()}")
    return "\n".join(lines)


class ErrorTypeChoiceTest(expecttest.TestCase):
    """Upstream raises a plain ValueError; the backport an error that is both."""

    def test_plain_value_error(self) -> None:
        self.assertExpectedInline(_render_choice(ValueError), """\
except KeyError: not caught
except ValueError: caught
except LookupError: not caught
str(): Adam holds a parameter that the model does not own: ...
traceback: ValueError: Adam holds a parameter that the model does not own: ...""")

    def test_value_and_key_error(self) -> None:
        self.assertExpectedInline(_render_choice(backport.OptimizerParamNotInModelError), """\
except KeyError: caught
except ValueError: caught
except LookupError: caught
str(): Adam holds a parameter that the model does not own: ...
traceback: backport.OptimizerParamNotInModelError: Adam holds a parameter that the model does not own: ...""")


    def test_value_and_key_error_without_str_override(self) -> None:
        # Why the backport's class sets __str__: KeyError's quotes its message.
        error_type = type("OptimizerParamNotInModelError", (ValueError, KeyError), {})
        self.assertExpectedInline(_render_choice(error_type).split("\n")[3], """str(): 'Adam holds a parameter that the model does not own: ...'""")


if __name__ == "__main__":
    unittest.main()
