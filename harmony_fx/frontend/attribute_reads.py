"""The plain Python attributes of the model's modules that its forward reads while it is captured.

The graph holds each such value as a constant: a flag (PEFT's ``_disable_adapters`` and
``merged_adapters``, timm's ``grad_checkpointing``), a number (``self.scale``, a BatchNorm's
``momentum``), a string or a function. ``frontend.guards`` keys every call on their values, so a
change captures again, as Dynamo guards what it read. (A value read from a plain object the module
holds, such as a Hugging Face config, is not followed: only the modules' own attributes.)

``reads_recorded(model)`` records, while it is open, each read of a module's own attribute (one in
its ``__dict__``): ``nn.Module`` has no ``__getattribute__`` of its own, so one set on it for the
capture sees every read of every module class that does not define its own, and is removed after.
What ``nn.Module`` itself keeps (hooks, the parameter and submodule dicts, ``training``) is keyed
elsewhere. Of what was read, ``Reads.values()`` keeps the reads whose value is plain (numbers,
strings, flags, enums, dtypes, functions, and tuples, lists, sets and dicts of those).
"""
from __future__ import annotations

import contextlib
import enum
import types
import weakref

import torch
from torch import nn

__all__ = ["Reads", "note_clone", "reads_recorded"]

_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"forward", "__dict__", "__class__"}
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size, enum.Enum, types.FunctionType, types.BuiltinFunctionType, type)
_ITEMS = 64  # a longer container is not a flag or a setting: not keyed


class Reads:
    """The (module, attribute name) pairs a capture read, whose values are plain; each module held
    weakly (a capture kept for the next compile must not keep its model alive: ``compiler.capture_cache``)."""

    def __init__(self, pairs: tuple[tuple[weakref.ref, str], ...] = ()) -> None:
        self.pairs = pairs

    def values(self) -> tuple:
        """Each read's value now (``_MISSING`` for an attribute deleted since), as a key compares them."""
        return tuple(_fact(_attribute(module, name)) for module, name in self.pairs)

    def describe(self, index: int) -> str:
        module, name = self.pairs[index]
        return f"{type(module()).__name__}.{name}"


_MISSING = ("missing",)


def _attribute(module: weakref.ref, name: str) -> object:
    alive = module()
    return _MISSING if alive is None else alive.__dict__.get(name, _MISSING)


def _fact(value: object) -> object:
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, types.MethodType):
        return ("method", value.__func__, id(value.__self__))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_fact(item) for item in value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_fact(item) for item in value))
    if isinstance(value, dict):
        return (type(value), tuple((_fact(k), _fact(v)) for k, v in value.items()))
    return value


def _is_plain(value: object, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN + (types.MethodType,)):
        return True
    if depth < 2 and isinstance(value, (tuple, list, set, frozenset)) and len(value) <= _ITEMS:
        return all(_is_plain(item, depth + 1) for item in value)
    if depth < 2 and isinstance(value, dict) and len(value) <= _ITEMS:
        return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


_recording: dict[int, nn.Module] | None = None  # while reads_recorded is open: the modules it records, by id


def note_clone(clone: nn.Module, original: nn.Module) -> None:
    """A capture that traces a clone of a module (``frontend.compute_dtype``'s twin in another dtype,
    which shares its ``__dict__``'s values): its reads are the original's."""
    if _recording is not None and id(original) in _recording:
        _recording[id(clone)] = _recording[id(original)]


@contextlib.contextmanager
def reads_recorded(model: nn.Module):
    """Yields a ``Reads``, filled when the block ends with what the block read of ``model``'s modules."""
    global _recording
    modules = {id(module): module for module in model.modules()}
    read: dict[tuple[int, str], None] = {}  # in the order first read

    def recording(self, name):
        value = object.__getattribute__(self, name)
        if name not in _MODULE_INTERNALS and id(self) in modules and name in object.__getattribute__(self, "__dict__"):
            read[id(self), name] = None
        return value

    reads = Reads()
    assert _recording is None and "__getattribute__" not in vars(nn.Module), "reads_recorded is not reentrant"
    _recording = modules
    nn.Module.__getattribute__ = recording
    try:
        yield reads
    finally:
        del nn.Module.__getattribute__
        _recording = None
        pairs = dict.fromkeys((modules[key], name) for key, name in read)  # a clone's and its original's: one
        reads.pairs = tuple((weakref.ref(module), name) for module, name in pairs
                            if _is_plain(module.__dict__.get(name, _MISSING)))
