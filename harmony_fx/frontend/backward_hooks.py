"""Backward hooks a captured graph cannot keep, refused at capture instead of silently dropped.

A hook on the backward of a module (``register_full_backward_hook``, its pre hook, the global
``register_module_full_backward_hook``) or on a tensor the forward makes (``h.register_hook(fn)``
inside ``forward``, a gradient clipped or scaled on its way) lives on autograd's graph of an eager
forward. Export traces the forward on fakes and keeps only the ops: the hooks never run, and the
gradients differ from eager's without any error. harmony_fx runs the backward pack by pack from
the captured graph, so it refuses such a model and says what works instead: hooks on the
parameters (``param.register_hook``, ``register_post_accumulate_grad_hook``) and on the model's
inputs and outputs run as in eager, since autograd hands harmony_fx's gradients to them.
"""
from __future__ import annotations

import contextlib
import os
import threading
import traceback

import torch
from torch import nn

__all__ = ["refuse_module_backward_hooks", "hooks_registered_in_forward", "refuse_tensor_hooks"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
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
        if threading.get_ident() == owner:
            lines.append(_model_line())
        return before(tensor, hook)

    torch.Tensor.register_hook = noted
    try:
        yield lines
    finally:
        torch.Tensor.register_hook = before


def refuse_tensor_hooks(lines: list[str]) -> None:
    if lines:
        raise ValueError(
            f"the model's forward registers a hook on a tensor it makes, at {lines[0]}: harmony_fx runs the backward "
            "pack by pack from the model's captured graph, which keeps the forward's ops but not the hook, so the "
            "gradients would differ from eager's without a word. Write what the hook does as an op of the "
            "forward (a torch.autograd.Function whose backward transforms the gradient keeps its own backward "
            f"under harmony_fx). {_WHAT_WORKS}")


def _model_line() -> str:
    """The innermost frame outside torch, harmony_fx and generated code: the model's code that
    registered the hook. A graph from ``torch.compile`` has none: it registers the hook through
    ``torch.ops.higher_order.register_hook``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith((_TORCH, _PACKAGE, "<")):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "a line of the graph torch.compile traced (torch.ops.higher_order.register_hook)"
