"""What a captured graph bakes in, as a key computed on every call (the way Dynamo keeps guards).

A graph captured from ``model(*args, **kwargs)`` holds, besides the batch size:

- each submodule's ``training`` flag (dropout on or off, BatchNorm's batch or running statistics);
- grad mode and inference mode (a call under ``no_grad`` runs a forward-only program);
- the autocast state (its dtypes are in the graph's values, its casts are not: ``runtime.ambient``);
- each parameter's and buffer's identity, dtype and shape, and each parameter's ``requires_grad``
  (freezing a layer, a parameter replaced by assignment, ``load_state_dict(assign=True)``);
- the inputs' structure, each tensor's shape, dtype, device and ``requires_grad``, and the value
  of every other input (a flag such as ``use_cache=False`` is baked in as a constant).

``CallKey.of(model, args, kwargs)`` reads all of it; ``HarmonyModule`` keeps one compiled program
per key, so a change captures and plans again once, and switching back finds the earlier program.
Reading the key walks the module tree (no ``named_modules`` bookkeeping): about 0.1 ms for a model
of a hundred parameters, measured in ``benchmarks/test_guards.py``.

What cannot be seen from here: a Python attribute the forward reads that is neither a module, a
parameter nor a buffer (``model.scale = 2.0`` after compiling), and in-place changes to a tensor a
module holds as a plain attribute. Those are baked in at capture, as in ``torch.export``.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils import _pytree as pytree

from harmony_fx.runtime.ambient import Autocast

__all__ = ["CallKey"]


@dataclasses.dataclass(frozen=True)
class CallKey:
    grad: bool            # grad mode on (off: ``no_grad``, or inside ``inference_mode``)
    inference: bool       # inside ``inference_mode``
    autocast: Autocast
    module_state: tuple   # per module, depth first: training, then (id, dtype, shape[, requires_grad]) per tensor
    inputs: tuple         # the inputs' structure, then per leaf its facts (tensors) or its value

    @classmethod
    def of(cls, model: nn.Module, args: tuple, kwargs: dict) -> "CallKey":
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), Autocast.current(),
                   module_state(model), input_facts(args, kwargs))

    def same_but_shapes(self, other: "CallKey") -> bool:
        """The same state and input structure, with only tensor shapes different (or none)."""
        if (self.grad, self.inference, self.autocast, self.module_state) != (
                other.grad, other.inference, other.autocast, other.module_state):
            return False
        if len(self.inputs) != len(other.inputs) or self.inputs[0] != other.inputs[0]:
            return False
        return all(_without_shape(a) == _without_shape(b) for a, b in zip(self.inputs[1:], other.inputs[1:]))

    def changes_from(self, other: "CallKey", model: nn.Module) -> list[str]:
        """What differs from ``other``, in words a person reads (for the compile log)."""
        changes = []
        if self.grad != other.grad or self.inference != other.inference:
            changes.append(_mode(self))
        if self.autocast != other.autocast:
            changes.append(self.autocast.describe())
        if self.module_state != other.module_state:
            training = {m.training for m in model.modules()}
            changes.append("train mode" if training == {True} else "eval mode" if training == {False}
                           else "the modules' training flags, parameters or buffers")
        if self.inputs != other.inputs:
            changes.append("the inputs' shapes, dtypes or structure")
        return changes


def _without_shape(fact: object) -> object:
    if isinstance(fact, tuple) and len(fact) == 4 and isinstance(fact[0], torch.Size):
        return (len(fact[0]),) + fact[1:]  # a tensor's: its number of dims, dtype, device, requires_grad
    return fact


def _mode(key: CallKey) -> str:
    return "inference_mode" if key.inference else "grad enabled" if key.grad else "no_grad"


def module_state(model: nn.Module) -> tuple:
    facts: list = []
    stack = [model]
    while stack:
        module = stack.pop()
        facts.append(module.training)
        for param in module._parameters.values():
            if param is not None:
                try:
                    facts.append((id(param), param.dtype, param.shape, param.requires_grad))
                except RuntimeError:  # a lazy module's parameter before its first call: no shape yet
                    facts.append((id(param), "uninitialized"))
        for buffer in module._buffers.values():
            if buffer is not None:
                try:
                    facts.append((id(buffer), buffer.dtype, buffer.shape))
                except RuntimeError:
                    facts.append((id(buffer), "uninitialized"))
        stack.extend(module._modules.values())
    return tuple(facts)


def input_facts(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    facts: list = [spec]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            facts.append((leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
            except TypeError:
                leaf = (type(leaf), id(leaf))  # unhashable: the same object, as Dynamo's ID_MATCH
            facts.append(leaf)
    return tuple(facts)
