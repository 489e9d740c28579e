"""What a captured graph bakes in, as a key computed on every call (the way Dynamo keeps guards).

A graph captured from ``model(*args, **kwargs)`` holds, besides the batch size:

- each submodule's ``training`` flag (dropout on or off, BatchNorm's batch or running statistics);
- grad mode and inference mode (a call under ``no_grad`` runs a forward-only program);
- the autocast state (its dtypes are in the graph's values, its casts are not: ``runtime.ambient``);
- each parameter's and buffer's identity, dtype and shape, and each parameter's ``requires_grad``
  (freezing a layer, a parameter replaced by assignment, ``load_state_dict(assign=True)``);
- the inputs' structure, each tensor's shape, dtype, device and ``requires_grad``, and the value
  of every other input (a flag such as ``use_cache=False`` is baked in as a constant);
- each module's forward and backward hooks and torch's global ones (a hook added after compiling,
  to read a layer's output, or PEFT's hook that makes the embeddings' output require grad, runs
  in the forward the graph was captured from; a backward hook is refused at capture), and a
  ``forward`` set on the instance (accelerate's ``prepare`` wraps it in autocast);
- the default dtype, which every factory without a dtype makes (``torch.arange(1.0)``, ``ones``);
- what the module itself says its graph bakes in (``_harmony_guarded_values()``): the Trainer's
  loss function's plain Python values (an annealed loss weight in a schedule dict);
- the values of the modules' plain attributes the forward read while it was captured, and of the
  plain objects they hold (``frontend.attribute_reads``: ``self.scale``, PEFT's ``merged_adapters``,
  a Hugging Face config's ``output_hidden_states``), given as ``reads``.

``CallKey.of(model, args, kwargs)`` reads all of it; ``HarmonyModule`` keeps one compiled program
per key, so a change captures and plans again once, and switching back finds the earlier program.
Reading the key walks the module tree (no ``named_modules`` bookkeeping): about 0.1 ms for a model
of a hundred parameters, measured in ``benchmarks/test_guards.py``.

What cannot be seen from here: an attribute the first capture did not read (a branch it did not
take), or one read from an object held in a container (a dict of configs) or from one whose reads
cannot be recorded (``__slots__`` without ``__dict__``, torch's own objects): it is baked in at
capture, as in ``torch.export``. (A tensor held as a plain attribute is not: export
lifts it to a placeholder, read at every call, so an in-place change to it is seen.) Reading every
attribute on every call would cost milliseconds, and walk whatever a module holds (a Lightning
module's trainer, whose counters move every step): only what the capture read is read again (about
0.3 ms a call for the thousand reads of a 59-block GPT-2).

``attribute_facts(model)`` reads those too, once per compile rather than per call (about 10 ms for
a 59-block GPT-2): every submodule's class and its plain attributes, following plain objects it
holds (a Hugging Face config) a few levels deep. ``compiler.capture_cache`` keys a capture on it
with ``CallKey``, so that a compile of the same model in the same state takes the graph captured
before, and a compile after such a change captures again.
"""
from __future__ import annotations

import dataclasses
import enum
import types

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.module_tracker import ModuleTracker

from harmony_fx.frontend.attribute_reads import Reads
from harmony_fx.runtime.ambient import Autocast

__all__ = ["CallKey", "attribute_facts"]


@dataclasses.dataclass(frozen=True)
class CallKey:
    grad: bool            # grad mode on (off: ``no_grad``, or inside ``inference_mode``)
    inference: bool       # inside ``inference_mode``
    autocast: Autocast
    module_state: tuple   # per module, depth first: training, then (id, dtype, shape[, requires_grad]) per tensor
    inputs: tuple         # the inputs' structure, then per leaf its facts (tensors) or its value
    default_dtype: torch.dtype = torch.float32  # what torch.arange(1.0), torch.ones(n), ... make
    # what else the module says its graph bakes in (``_harmony_guarded_values()``: the Trainer's loss
    # function's Python values, ``training.python_values``)
    guarded_values: tuple = ()
    # the values of the modules' plain attributes the capture read (``frontend.attribute_reads``)
    attributes: tuple = ()

    @classmethod
    def of(cls, model: nn.Module, args: tuple, kwargs: dict, reads: Reads | None = None) -> "CallKey":
        guarded = getattr(model, "_harmony_guarded_values", None)
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), Autocast.current(),
                   module_state(model), input_facts(args, kwargs), torch.get_default_dtype(),
                   guarded() if guarded is not None else (), reads.values() if reads is not None else ())

    def same_but_shapes(self, other: "CallKey") -> bool:
        """The same state and input structure, with only tensor shapes different (or none)."""
        if (self.grad, self.inference, self.autocast, self.module_state, self.default_dtype, self.guarded_values,
                self.attributes) != (other.grad, other.inference, other.autocast, other.module_state,
                                     other.default_dtype, other.guarded_values, other.attributes):
            return False
        if len(self.inputs) != len(other.inputs) or self.inputs[0] != other.inputs[0]:
            return False
        return all(_without_shape(a) == _without_shape(b) for a, b in zip(self.inputs[1:], other.inputs[1:]))

    def values_changed(self, other: "CallKey") -> bool:
        """A Python value the graph holds as a constant differs from ``other``'s: an input that is
        not a tensor, or a module attribute the forward read."""
        if self.attributes != other.attributes:
            return True
        return self.inputs[0] == other.inputs[0] and any(
            a != b for a, b in zip(self.inputs[1:], other.inputs[1:]) if not _is_tensor_fact(a))

    def changes_from(self, other: "CallKey", model: nn.Module, reads: Reads | None = None) -> list[str]:
        """What differs from ``other``, in words a person reads (for the compile log); ``reads``:
        what ``attributes`` were read from."""
        changes = []
        if self.grad != other.grad or self.inference != other.inference:
            changes.append(_mode(self))
        if self.autocast != other.autocast:
            changes.append(self.autocast.describe())
        if self.module_state != other.module_state:
            if _training_flags(self.module_state) != _training_flags(other.module_state):
                training = {m.training for m in model.modules()}
                changes.append("train mode" if training == {True} else "eval mode" if training == {False}
                               else "the modules' training flags")
            else:
                changes.append("the modules' parameters, buffers or hooks")
        if self.inputs != other.inputs:
            values = [(a, b) for a, b in zip(self.inputs[1:], other.inputs[1:]) if a != b]
            tensors = [fact for pair in values for fact in pair if _is_tensor_fact(fact)]
            if self.inputs[0] == other.inputs[0] and values and not tensors:
                changes.append(f"the value of an input that is not a tensor ({values[0][1]!r} -> {values[0][0]!r}; "
                               "the graph holds it as a constant: pass a number that changes every call as a "
                               "0-dim tensor)")
            else:
                changes.append("the inputs' shapes, dtypes or structure")
        if self.default_dtype != other.default_dtype:
            changes.append(f"the default dtype ({self.default_dtype})")
        if self.guarded_values != other.guarded_values:
            named = next((f"{now[0]}: {_short(was[1])} -> {_short(now[1])}" for now, was in zip(self.guarded_values,
                                                                                                other.guarded_values)
                          if now != was and isinstance(now, tuple) and len(now) == 2), "")
            changes.append(f"a Python value the loss function reads ({named or 'its reads'}; the graph holds it as a "
                           "constant: a number that changes every step is cheaper as a tensor, updated in place)")
        if self.attributes != other.attributes:
            changed = [i for i, (now, was) in enumerate(zip(self.attributes, other.attributes)) if now != was]
            named = (f"{reads.describe(changed[0])}: {_short(other.attributes[changed[0]][-1])} -> "
                     f"{_short(self.attributes[changed[0]][-1])}") if changed and reads is not None else "one of them"
            number = bool(changed) and self.attributes[changed[0]][0] in (int, float)
            changes.append(f"a module attribute the forward reads ({named}; the graph holds it as a constant"
                           + (": a number that changes every step is cheaper as a tensor, a buffer updated in place, "
                              "or read outside the forward)" if number else ")"))
        return changes


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _training_flags(module_state: tuple) -> tuple:
    """The modules' ``training`` flags of a ``module_state`` (its only plain bools)."""
    return tuple(fact for fact in module_state if fact is True or fact is False)


def _is_tensor_fact(fact: object) -> bool:
    return isinstance(fact, tuple) and len(fact) == 4 and isinstance(fact[0], torch.Size)


def _without_shape(fact: object) -> object:
    if _is_tensor_fact(fact):
        return (len(fact[0]),) + fact[1:]  # a tensor's: its number of dims, dtype, device, requires_grad
    return fact


def _mode(key: CallKey) -> str:
    return "inference_mode" if key.inference else "grad enabled" if key.grad else "no_grad"


def module_state(model: nn.Module) -> tuple:
    hooks = torch.nn.modules.module
    facts: list = [_hook_ids(hooks._global_forward_hooks, hooks._global_forward_pre_hooks,
                             hooks._global_backward_hooks, hooks._global_backward_pre_hooks)]
    stack, seen = [model], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:  # a module reached twice (shared, or a cycle: a compiled module set on its model)
            continue
        seen.add(id(module))
        facts.append(module.training)
        forward = module.__dict__.get("forward")  # the instance's own (accelerate's autocast wrapper)
        if forward is not None:
            facts.append(("forward", id(forward)))
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
            own = _hook_ids(module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                            module._backward_pre_hooks)
            if any(own):
                facts.append(own)
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
        stack.extend(child for child in module._modules.values() if child is not None)  # None: a slot left empty
    return tuple(facts)


def _observes(hook: object) -> bool:
    """A hook that changes nothing the graph holds, so not keyed: a global module hook of torch's
    ``ModuleTracker`` (``FlopCounterMode``'s, entered anew for each count: Lightning's model summary),
    which notes which module runs (keyed, each new counter compiled again); and transformers'
    output-capturing hook, installed on the first call that asks for hidden states or attentions and
    never removed, which does nothing unless the call asks (the config flags that ask are keyed:
    turning them off again compiled a third time)."""
    return (isinstance(getattr(hook, "__self__", None), ModuleTracker)
            or getattr(hook, "__qualname__", "").endswith("install_output_capuring_hook.<locals>.output_capturing_hook"))


def _hook_ids(*hook_dicts: dict) -> tuple:
    """The hooks registered, by their handles' ids (a hook added or removed changes them), less
    those that change nothing the graph holds (``_observes``)."""
    return tuple(tuple(key for key, hook in hooks.items() if not _observes(hook)) for hooks in hook_dicts)


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


# nn.Module's own bookkeeping: the tree, parameters, buffers and hooks are ``module_state``'s
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
           torch.memory_format, torch.Size, enum.Enum)
_DEPTH = 4          # how far into plain objects (module -> config -> its dicts -> their items)
_ITEMS = 256        # a longer list or dict is known by its identity only


def attribute_facts(model: nn.Module) -> tuple:
    """What a capture bakes in beyond ``CallKey``: per module, depth first, its class, the class's
    ``forward`` and every plain attribute (numbers, strings, flags; tensors held as attributes by
    identity, dtype and shape; functions by identity; plain objects by their own attributes); and
    torch's default dtype."""
    memo: dict[tuple[int, int], object] = {}
    facts: list = [torch.get_default_dtype()]
    stack, seen = [model], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        facts.append((type(module), getattr(type(module), "forward", None)))
        facts.extend((name, _fact(value, 1, memo)) for name, value in vars(module).items()
                     if name not in _MODULE_INTERNALS)
        stack.extend(child for child in module._modules.values() if child is not None)
    return tuple(facts)


def _fact(value: object, depth: int, memo: dict[tuple[int, int], object]) -> object:
    if isinstance(value, _VALUES):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        # export lifts a tensor attribute to a placeholder, its values read at every call: only which
        # tensor it is, and its dtype and shape, are in the graph
        return ("tensor", id(value), value.dtype, value.shape)
    # functions are held, not their ids: a lambda replaced by another may be given the freed one's id
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return ("function", value)
    if isinstance(value, types.MethodType):
        return ("method", value.__func__, id(value.__self__))
    if isinstance(value, nn.Module):  # held as a plain attribute, not a submodule: its identity
        return ("module", id(value))
    if (id(value), depth) in memo:  # a config every module holds is read once
        return memo[id(value), depth]
    fact: object = ("identity", type(value), id(value))
    try:
        attributes = vars(value)
    except Exception:  # noqa: BLE001 - no __dict__ (slots, a C type), or one that cannot be read: its identity
        attributes = None
    if depth < _DEPTH:
        if isinstance(value, (set, frozenset)) and len(value) <= _ITEMS:
            fact = (type(value), frozenset(_fact(item, depth + 1, memo) for item in value))
        elif isinstance(value, (tuple, list)) and len(value) <= _ITEMS:
            fact = (type(value), tuple(_fact(item, depth + 1, memo) for item in value))
        elif isinstance(value, dict) and len(value) <= _ITEMS:
            fact = (type(value), tuple((_fact(k, depth + 1, memo), _fact(v, depth + 1, memo)) for k, v in value.items()))
        elif isinstance(attributes, dict) and len(attributes) <= _ITEMS:
            fact = (type(value), id(value), tuple((name, _fact(item, depth + 1, memo))
                                                  for name, item in attributes.items()))
    memo[id(value), depth] = fact
    return fact
