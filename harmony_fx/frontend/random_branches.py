"""Branches on a uniform random draw whose outcome is certain, taken as eager takes them at capture.

Layer drop as some transformers versions write it draws a number in training even when its
probability is zero, and branches on it::

    if self.training and torch.rand([]) < self.layerdrop:  # layerdrop = 0.0: never true
        continue

``torch.export`` cannot trace ``bool()`` of a value it does not know (a data-dependent guard), so
such a model would not capture at all. A draw of ``torch.rand``/``torch.rand_like`` (or
``tensor.uniform_()`` on [0, 1)) lies in [0, 1): compared with a number outside (0, 1) its outcome is
the same every call, and ``bool()`` (or ``.item()``) of that comparison, or of an element of it (a
draw per layer, iterated), is answered here with it. The draw and the comparison stay in the
graph, so the program consumes the random numbers eager consumes (a dropout after it gets eager's
mask). A comparison whose outcome really is random (a layer drop of 0.3) cannot be a graph, whose
layers are the same every step: ``bool()`` of it raises ``RandomBranchError`` (the comparison and
the probability it was given), which the capture's refusal turns into what to set to 0.

``certain_random_branches(module)`` runs the module's forward under the mode that answers them;
it must run inside export's own tracing, above export's function modes, hence the forward itself
and not a mode around the ``export`` call. The capture uses it only on a second try, after a
data-dependent guard: other models pay nothing.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["certain_random_branches", "RandomBranchError"]

_DRAWS = (torch.rand, torch.rand_like)  # uniform on [0, 1)
# a comparison's outcome for every draw in [0, 1), from the number it is compared with (None:
# random); a draw of exactly 0 (one in 2**24 in float32) is taken as never drawn, so that
# ``rand > 0.0`` (PEFT's LoHa and LoKr with module_dropout=0: never dropped) is certain too
_OUTCOMES: dict[str, Callable[[float], bool | None]] = {
    "lt": lambda c: False if c <= 0 else True if c >= 1 else None,
    "le": lambda c: False if c <= 0 else True if c >= 1 else None,
    "gt": lambda c: True if c <= 0 else False if c >= 1 else None,
    "ge": lambda c: True if c <= 0 else False if c >= 1 else None,
}
_OUTCOMES.update({f"__{name}__": outcome for name, outcome in list(_OUTCOMES.items())})
_SYMBOLS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">="}


class RandomBranchError(RuntimeError):
    """The model branches in Python on a comparison of a uniform draw whose outcome is random:
    ``probability`` is the number the draw was compared with."""

    def __init__(self, comparison: str, probability: float) -> None:
        super().__init__(f"the model branches in Python on a random draw, torch.rand() {comparison} {probability!r}, "
                         "whose outcome changes from call to call")
        self.probability = probability


class _CertainDraws(TorchFunctionMode):
    """Remembers the tensors ``torch.rand`` gave and the comparisons of them (by ``id``, holding the
    tensor: a tensor's ``==`` is not identity); answers ``bool()`` or ``.item()`` of those whose
    outcome is certain with the outcome, and raises ``RandomBranchError`` for the others."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: dict[int, torch.Tensor] = {}
        self.compared: dict[int, tuple[torch.Tensor, bool | None, str, float]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in ("__bool__", "item") and args and (found := self._compared(args[0])) is not None:
            _, outcome, comparison, number = found
            if outcome is None:
                raise RandomBranchError(comparison, number)
            return outcome
        out = func(*args, **(kwargs or {}))
        if any(func is draw for draw in _DRAWS) or (func is torch.Tensor.uniform_ and _on_unit(args, kwargs)):
            self.draws[id(out)] = out
        elif name in _OUTCOMES and len(args) == 2 and self._is_draw(args[0]) and _is_number(args[1]):
            self.compared[id(out)] = (out, _OUTCOMES[name](args[1]), _SYMBOLS[name.strip("_")], args[1])
        elif name in ("__getitem__", "unbind") and args and self._compared(args[0]) is not None:
            # an element of a comparison (a draw per layer, iterated: CaiT's layer drop) has its outcome
            _, *facts = self._compared(args[0])
            for element in out if isinstance(out, tuple) else (out,):
                self.compared[id(element)] = (element, *facts)
        return out

    def _compared(self, value: object) -> tuple | None:
        found = self.compared.get(id(value))
        return found if found is not None and found[0] is value else None

    def _is_draw(self, value: object) -> bool:
        return isinstance(value, torch.Tensor) and self.draws.get(id(value)) is value


def _on_unit(args: tuple, kwargs: dict | None) -> bool:
    """``tensor.uniform_(from, to)`` draws on [0, 1) (its defaults)."""
    bounds = {"from": 0.0, "to": 1.0}
    bounds.update(zip(("from", "to"), args[1:]))
    bounds.update(kwargs or {})
    return bounds["from"] == 0 and bounds["to"] == 1


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@contextlib.contextmanager
def certain_random_branches(module: nn.Module) -> Iterator[None]:
    """``module``'s forward runs under ``_CertainDraws`` while this lasts; its own forward after."""
    own = module.__dict__.get("forward")  # an instance attribute of the user's, kept as it was
    forward = module.forward

    @functools.wraps(forward)
    def answered(*args, **kwargs):
        with _CertainDraws():
            return forward(*args, **kwargs)

    module.forward = answered
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
