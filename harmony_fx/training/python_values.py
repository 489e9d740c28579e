"""The plain Python values a loss function reads, which its captured graph holds as constants.

``Trainer`` captures ``loss_fn(model(*inputs), target)`` once; a number the loss reads from Python
(an annealed aux-loss weight in a schedule dict, ``config.WEIGHT``, a class attribute, a
``functools.partial`` keyword, an ``nn.Module`` criterion's ``label_smoothing``) is baked into the
graph. ``python_values(loss_fn)`` reads those values again, at every step (``frontend.guards``
keys the call on them: a change compiles again), following what the code names:

- a function's defaults, its closure's cells, and the globals its code (and the code of the
  functions, lambdas and comprehensions inside it) names;
- of each object reached (a module, a class, an instance, a closure's object), the attributes
  whose names the code uses (``run.w`` is read, ``run.step``, which the code does not name, is
  not: an unrelated counter does not compile the step again), through methods and helper
  functions of the user's own code (not torch's, numpy's, or Python's), a few levels deep;
- an ``nn.Module`` (the loss itself, or one the loss calls): its modules' plain attributes, and what
  its ``forward`` reads;
- a tensor by its identity: an in-place change is read by the graph at every call, a tensor put in
  its place is another.

Each fact is ``(what, value)``, ``what`` naming the read (``cfg.WEIGHT``), for the compile log.
Containers are read up to 64 items; anything else by its type.
"""
from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable

import torch
from torch import nn

from harmony_fx.frontend.guards import attribute_facts

__all__ = ["python_values"]

_ITEMS = 64       # a container is read this far: a schedule, not a dataset
_DEPTH = 4        # functions and objects followed this deep
_LIBRARIES = ("torch", "numpy", "math", "builtins", "functools", "operator", "collections", "typing", "harmony_fx",
              "transformers", "lightning", "pytorch_lightning", "accelerate", "peft", "einops", "_operator",
              "_functools", "_collections")
_MISSING = object()


def python_values(loss_fn: Callable | None) -> tuple:
    if loss_fn is None:
        return ()
    facts: list = []
    _read_callable(loss_fn, "loss_fn", facts, _DEPTH, set())
    return tuple(facts)


def _read_callable(fn: Any, what: str, facts: list, depth: int, seen: set) -> None:
    if depth == 0 or id(fn) in seen:
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        facts.append((f"{what}'s bound arguments", _value((fn.args, fn.keywords))))
        _read_callable(fn.func, what, facts, depth - 1, seen)
        return
    if isinstance(fn, nn.Module):  # its modules' plain attributes, as a capture of it is keyed on them
        facts.append((f"{what}'s attributes", attribute_facts(fn)))
        _read_callable(fn.forward, what, facts, depth - 1, seen)
        return
    owner, function = (fn.__self__, fn.__func__) if isinstance(fn, types.MethodType) else (None, fn)
    code = getattr(function, "__code__", None)
    if code is None:  # a callable object: its __call__, reading its own attributes
        call = getattr(type(fn), "__call__", None)
        if isinstance(call, types.FunctionType) and not _library(call):
            _read_callable(types.MethodType(call, fn), what, facts, depth, seen)
        return
    if _library(function):
        return
    names = _names(code)
    facts.append((f"{what}'s defaults", _value((function.__defaults__, function.__kwdefaults__))))
    reached = [] if owner is None else [(what.rsplit(".", 1)[0] if "." in what else "self", owner)]
    for name, cell in zip(code.co_freevars, function.__closure__ or ()):
        try:
            reached.append((name, cell.cell_contents))
        except ValueError:  # a cell not assigned yet
            continue
    reached += [(name, function.__globals__[name]) for name in sorted(names) if name in function.__globals__]
    for name, value in reached:
        _read_value(value, name, names, facts, depth - 1, seen)


def _read_value(value: Any, what: str, names: set, facts: list, depth: int, seen: set) -> None:
    if _plain(value):
        facts.append((what, _value(value)))
    elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial, nn.Module)):
        _read_callable(value, what, facts, depth, seen)
    elif depth > 0 and id(value) not in seen and not _library(value):
        seen.add(id(value))  # a module, a class, an object: the attributes the code names
        for name in sorted(names):
            attribute = inspect.getattr_static(value, name, _MISSING)
            if attribute is _MISSING or isinstance(attribute, (property, types.MemberDescriptorType)):
                continue
            if isinstance(attribute, (staticmethod, classmethod)):
                attribute = getattr(value, name)
            elif isinstance(attribute, types.FunctionType) and not isinstance(value, (type, types.ModuleType)):
                attribute = getattr(value, name)  # a method, bound
            _read_value(attribute, f"{what}.{name}", names, facts, depth - 1, seen)


def _names(code: types.CodeType) -> set:
    """Every name ``code`` and the code inside it (lambdas, comprehensions, nested functions) loads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _library(value: Any) -> bool:
    module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    if module is None and not isinstance(value, type):
        module = getattr(type(value), "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in _LIBRARIES


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.Tensor, dict, list, tuple,
                                               torch.dtype, torch.device))


def _value(value: Any, depth: int = 3) -> Any:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if depth and isinstance(value, dict):
        return tuple((_value(k, 0), _value(v, depth - 1)) for k, v in list(value.items())[:_ITEMS])
    if depth and isinstance(value, (list, tuple)):
        return tuple(_value(v, depth - 1) for v in value[:_ITEMS])
    return type(value).__name__
