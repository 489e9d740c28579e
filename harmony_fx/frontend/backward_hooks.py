"""Backward hooks a captured graph cannot keep, refused at capture instead of silently dropped.

A hook on the backward of a module (``register_full_backward_hook``, its pre hook, the global
``register_module_full_backward_hook``) or on a tensor the forward makes (``h.register_hook(fn)``
inside ``forward``, a gradient clipped or scaled on its way) lives on autograd's graph of an eager
forward. Export traces the forward on fakes and keeps only the ops: the hooks never run, and the
gradients differ from eager's without any error. harmony_fx runs the backward pack by pack from
the captured graph, so it refuses such a model and says what works instead: hooks on the
parameters (``param.register_hook``, ``register_post_accumulate_grad_hook``) and on the model's
inputs and outputs run as in eager, since autograd hands harmony_fx's gradients to them.

Two kinds of tensor hooks are not refused. A compile for calls with no backward after them (under
``no_grad``: an eval loop, Lightning's model summary) captures with grad on, so a forward that
registers a hook where its tensor requires grad does so only in the capture: no backward will run,
the hook is moot (``without_a_backward``). And the hooks ``torch.utils.module_tracker.ModuleTracker``
(``FlopCounterMode``'s) registers on every module's output only note which module the backward is
in: they never touch a gradient, and under harmony_fx the backward's flops count under no module.

A forward hook runs its tensor ops in the graph, but its Python side effects happen once, when the
model is captured, on FakeTensors: a hook that keeps a module's output (``features[name] = out``:
feature extraction, Grad-CAM, a perceptual loss) leaves a FakeTensor where the caller looks for the
call's activation, silently. ``refuse_forward_hooks_keeping_tensors`` looks, after a capture, in
what each forward hook holds (its closure, defaults, bound object, the globals it names) for one.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import threading
import traceback
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["refuse_module_backward_hooks", "hooks_registered_in_forward", "refuse_tensor_hooks", "without_a_backward",
           "refuse_forward_hooks_keeping_tensors"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
# hooks that only observe: ModuleTracker's note the module a backward is in (FlopCounterMode's)
_OBSERVERS = (os.path.join(_TORCH, "utils", "module_tracker.py"),)
# a compile for calls with no backward after them (``without_a_backward``)
_NO_BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("harmony_fx_no_backward", default=False)
_WHAT_WORKS = ("Hooks on parameters (param.register_hook, register_post_accumulate_grad_hook) and on the "
               "model's inputs and outputs run as in eager; read a module's gradients after backward from its "
               "parameters' .grad.")


def refuse_module_backward_hooks(model: nn.Module) -> None:
    """A ``ValueError`` naming the first module with a backward hook (or the global one)."""
    hooks = torch.nn.modules.module
    if hooks._global_backward_hooks or hooks._global_backward_pre_hooks:
        _refuse_module("every module (torch.nn.modules.module.register_module_full_backward_hook)")
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            _refuse_module(f"the module {name or type(model).__name__!r} ({type(module).__name__})")


def _refuse_module(which: str) -> None:
    raise ValueError(
        f"{which} has a backward hook (register_full_backward_hook or its pre hook): harmony_fx runs the backward "
        "pack by pack from the model's captured graph, which keeps the forward's ops but not the hooks autograd "
        f"would call, so the gradients would differ from eager's without a word. Remove the hook. {_WHAT_WORKS}")


@contextlib.contextmanager
def hooks_registered_in_forward():
    """Within it, on this thread, every ``Tensor.register_hook`` call is noted (the model's line
    that made it) and carried out; yields the list of lines. ``register_hook`` is put back after."""
    lines: list[str] = []
    before = torch.Tensor.__dict__["register_hook"]
    owner = threading.get_ident()

    def noted(tensor: torch.Tensor, hook):
        if threading.get_ident() == owner and not _registered_by_an_observer():
            lines.append(_model_line())
        return before(tensor, hook)

    torch.Tensor.register_hook = noted
    try:
        yield lines
    finally:
        torch.Tensor.register_hook = before


@contextlib.contextmanager
def without_a_backward(on: bool = True):
    """Within it (``on``), a compile for calls with no backward after them: the hooks a forward
    registers on its tensors are moot, not refused (``refuse_tensor_hooks``)."""
    token = _NO_BACKWARD.set(on)
    try:
        yield
    finally:
        _NO_BACKWARD.reset(token)


def refuse_tensor_hooks(lines: list[str] | tuple[str, ...]) -> None:
    """A ``ValueError`` naming the first line that registered a hook, unless no backward follows."""
    if lines and not _NO_BACKWARD.get():
        raise ValueError(
            f"the model's forward registers a hook on a tensor it makes, at {lines[0]}: harmony_fx runs the backward "
            "pack by pack from the model's captured graph, which keeps the forward's ops but not the hook, so the "
            "gradients would differ from eager's without a word. Write what the hook does as an op of the "
            "forward (a torch.autograd.Function whose backward transforms the gradient keeps its own backward "
            f"under harmony_fx). {_WHAT_WORKS}")


def refuse_forward_hooks_keeping_tensors(model: nn.Module) -> None:
    """A ``ValueError`` naming the first forward hook (or pre hook) that holds a FakeTensor after a
    capture: the tensor it kept from the forward it saw, which no call will replace."""
    hooks = torch.nn.modules.module
    owners = [("every module (a global forward hook)", hooks._global_forward_hooks, hooks._global_forward_pre_hooks)]
    owners += [(f"the module {name or type(model).__name__!r} ({type(module).__name__})", module._forward_hooks,
                module._forward_pre_hooks) for name, module in model.named_modules()
               if module._forward_hooks or module._forward_pre_hooks]
    for which, *dicts in owners:
        for hook in (hook for hook_dict in dicts for hook in hook_dict.values()):
            if any(_holds_a_fake(value, 3) for value in _held_by(hook)):
                raise ValueError(
                    f"a forward hook on {which}, {getattr(hook, '__qualname__', type(hook).__name__)}, keeps a tensor "
                    "of the forward (features[name] = output): under harmony_fx a hook's Python runs once, when the "
                    "model is captured, on FakeTensors, so what it kept is one of those and no call replaces it. "
                    "Return the tensor from the model instead (torchvision.models.feature_extraction."
                    "create_feature_extractor, timm's features_only=True or forward_intermediates), or keep the hook "
                    "on an eager model.")


def _held_by(hook: Any) -> list:
    """What a hook holds that it can write to: its closure's cells, defaults, bound object's
    attributes, a partial's arguments, and the module globals its code names."""
    held: list = []
    if isinstance(hook, functools.partial):
        held += [*hook.args, *hook.keywords.values()]
        hook = hook.func
    owner = getattr(hook, "__self__", None)
    if owner is not None and not isinstance(owner, nn.Module):
        held.append(vars(owner) if hasattr(owner, "__dict__") else owner)
    function = getattr(hook, "__func__", hook)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    held += [*(getattr(function, "__defaults__", None) or ()),
             *(getattr(function, "__kwdefaults__", None) or {}).values()]
    code, names = getattr(function, "__code__", None), getattr(function, "__globals__", {})
    if code is not None:
        held += [names[name] for name in code.co_names if name in names and not isinstance(names[name], type(os))]
    return held


def _holds_a_fake(value: Any, depth: int) -> bool:
    if isinstance(value, FakeTensor):
        return True
    if depth == 0:
        return False
    if isinstance(value, dict):
        values = list(value.values())
    elif isinstance(value, (list, tuple, set)):
        values = list(value)
    else:
        return False
    return any(_holds_a_fake(item, depth - 1) for item in values[:256])


def _registered_by_an_observer() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _OBSERVERS:
            return True
        frame = frame.f_back
    return False


def _model_line() -> str:
    """The innermost frame outside torch, harmony_fx and generated code: the model's code that
    registered the hook. A graph from ``torch.compile`` has none: it registers the hook through
    ``torch.ops.higher_order.register_hook``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith((_TORCH, _PACKAGE, "<")):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "a line of the graph torch.compile traced (torch.ops.higher_order.register_hook)"
