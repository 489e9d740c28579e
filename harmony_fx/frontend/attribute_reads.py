"""The plain Python attributes of the model's modules that its forward reads while it is captured.

The graph holds each such value as a constant: a flag (PEFT's ``_disable_adapters`` and
``merged_adapters``, timm's ``grad_checkpointing``), a number (``self.scale``, a BatchNorm's
``momentum``), a string or a function. ``frontend.guards`` keys every call on their values, so a
change captures again, as Dynamo guards what it read.

``reads_recorded(model)`` records, while it is open, each read of a module's own attribute (one in
its ``__dict__``, or a plain class-level default its class holds and the instance does not override,
as transformers' ``GradientCheckpointingLayer.gradient_checkpointing``): ``nn.Module`` has no
``__getattribute__`` of its own, so one set on it for the capture sees every read of every module
class that does not define its own, and is removed after.
What ``nn.Module`` itself keeps (hooks, the parameter and submodule dicts, ``training``) is keyed
elsewhere. A plain object a module holds (a Hugging Face config, a dataclass of settings, with
``__slots__`` or a ``__dict__``) is
followed the same way (a ``types.SimpleNamespace``, whose C class cannot record, is read whole):
its class gets a recording ``__getattribute__`` for the capture, and a read
of ``self.config.output_hidden_states`` is kept as the path from the module, read again through the
module (a config replaced by another is read anew). Of what was read, ``Reads.values()`` keeps the
reads whose value is plain (numbers, strings, flags, enums, dtypes, functions, and tuples, lists,
sets and dicts of those).
"""
from __future__ import annotations

import contextlib
import enum
import threading
import types
import weakref

import torch
from torch import nn

__all__ = ["Reads", "note_clone", "reads_recorded"]

_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"forward", "__dict__", "__class__"}
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size, enum.Enum, types.FunctionType, types.BuiltinFunctionType, type)
_ITEMS = 64  # a longer container is not a flag or a setting: not keyed
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python, whose __getattribute__ can be set


class Reads:
    """The (module, attribute path) pairs a capture read, whose values are plain: a path of one name
    is the module's own attribute, a longer one goes on through the plain objects it holds
    (``("config", "use_cache")``). Each module is held weakly (a capture kept for the next compile
    must not keep its model alive: ``compiler.capture_cache``)."""

    def __init__(self, pairs: tuple[tuple[weakref.ref, tuple[str, ...]], ...] = ()) -> None:
        self.pairs = pairs

    def values(self) -> tuple:
        """Each read's value now (``_MISSING`` for an attribute deleted since), as a key compares them."""
        return tuple(_fact(_attribute(module, path)) for module, path in self.pairs)

    def describe(self, index: int) -> str:
        module, path = self.pairs[index]
        return ".".join((type(module()).__name__,) + path)


_MISSING = ("missing",)


def _attribute(module: weakref.ref, path: tuple[str, ...]) -> object:
    alive = module()
    value = _MISSING if alive is None else alive.__dict__.get(path[0], _MISSING)
    if value is _MISSING and alive is not None:  # a class-level default the instance does not override
        value = _class_value(type(alive), path[0])
    for name in path[1:]:
        value = _MISSING if value is _MISSING else getattr(value, name, _MISSING)
    return value


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


def _is_held_object(value: object) -> bool:
    """A plain object whose attributes a forward may read as settings: an instance of a Python class
    with a ``__dict__`` or ``__slots__`` (``@dataclass(slots=True)``), not torch's own (a tensor, a
    module, an fx graph) and not a container."""
    cls = type(value)
    return (bool(cls.__flags__ & _HEAP_TYPE) and (cls.__dictoffset__ != 0 or _has_slots(cls))
            and not cls.__module__.startswith("torch")
            and not isinstance(value, (nn.Module, torch.Tensor, type, enum.Enum, BaseException, types.FunctionType,
                                       types.MethodType, tuple, list, dict, set, frozenset)))


def _has_slots(cls: type) -> bool:
    return any("__slots__" in vars(klass) for klass in cls.__mro__[:-1])  # object itself has none


def _class_attribute(cls: type, name: str, stop: type | None = None) -> object:
    """What ``cls`` (or the first class of its MRO before ``stop`` that has it) holds as ``name``,
    else ``_MISSING``."""
    for klass in cls.__mro__:
        if klass is stop:
            break
        if name in klass.__dict__:
            return klass.__dict__[name]
    return _MISSING


def _is_descriptor(value: object) -> bool:
    return value is not _MISSING and hasattr(type(value), "__get__")


def _class_value(cls: type, name: str) -> object:
    """A plain value ``cls`` holds as ``name`` (a class-level default, ``negate = False``, read through
    an instance that does not set its own), else ``_MISSING``: not a method, property or other
    descriptor, and not ``nn.Module``'s own (``dump_patches``, ``_version``)."""
    value = _class_attribute(cls, name, stop=nn.Module)
    return _MISSING if _is_descriptor(value) else value


def _is_computed(cls: type, name: str) -> bool:
    """``name`` is a property or method of ``cls`` (what it reads inside is recorded as it reads it);
    a slot (``__slots__``' member descriptor) holds a value, as a ``__dict__`` entry does."""
    attribute = _class_attribute(cls, name)
    return _is_descriptor(attribute) and not isinstance(attribute, types.MemberDescriptorType)


_recording: dict[int, nn.Module] | None = None  # while reads_recorded is open: the modules it records, by id
# one capture records at a time: the patched ``__getattribute__``s are global, so another thread's
# capture waits for this one's to end (the thread that holds it: ``_owner``)
_one_at_a_time = threading.Lock()
_owner: int | None = None


def note_clone(clone: nn.Module, original: nn.Module) -> None:
    """A capture that traces a clone of a module (``frontend.compute_dtype``'s twin in another dtype,
    which shares its ``__dict__``'s values): its reads are the original's."""
    if _recording is not None and id(original) in _recording:
        _recording[id(clone)] = _recording[id(original)]


@contextlib.contextmanager
def reads_recorded(model: nn.Module):
    """Yields a ``Reads``, filled when the block ends with what the block read of ``model``'s modules
    and of the plain objects they hold."""
    global _recording, _owner
    modules = {id(module): module for module in model.modules()}
    read: dict[tuple[int, tuple[str, ...]], None] = {}  # in the order first read
    held: dict[int, tuple[object, int, tuple[str, ...]]] = {}  # id -> (object, module id, path to it)
    patched: list[tuple[type, object]] = []  # each class given a recording __getattribute__, and its own before
    followed: dict[tuple[int, tuple[str, ...]], object] = {}  # each read recorded -> the value it followed
    class_defaults: dict[tuple[type, str], bool] = {}  # (class, name) -> whether it is a plain class-level default

    def follow(value: object, module: int, path: tuple[str, ...]) -> None:
        if type(value) is types.SimpleNamespace:  # a C class, whose reads cannot be recorded: all of it
            read.update(dict.fromkeys((module, path + (name,)) for name in vars(value)))
            return
        if id(value) in held or not _is_held_object(value):
            return
        held[id(value)] = (value, module, path)  # the object kept: its id stays its own while recording
        cls = type(value)
        if getattr(cls.__getattribute__, "_records_reads", False):
            return
        own, original = cls.__dict__.get("__getattribute__"), cls.__getattribute__

        def recording_held(self, name, original=original):
            value = original(self, name)
            entry = held.get(id(self))
            if entry is not None and not name.startswith("__") and not _is_computed(type(self), name):
                read[entry[1], entry[2] + (name,)] = None
                follow(value, entry[1], entry[2] + (name,))
            return value

        recording_held._records_reads = True
        try:
            cls.__getattribute__ = recording_held
        except (TypeError, AttributeError):  # a class that refuses new attributes: its reads are not followed
            return
        patched.append((cls, own))

    def recording(self, name):
        # every attribute read of every module during the export (about 100,000 for 59 GPT-2 blocks)
        # comes here: what was recorded and followed once is not again
        value = object.__getattribute__(self, name)
        if name in _MODULE_INTERNALS or id(self) not in modules:
            return value
        key = (id(self), (name,))
        if followed.get(key, _MISSING) is value:
            return value
        if name not in object.__getattribute__(self, "__dict__"):
            cls = type(self)
            default = class_defaults.get((cls, name))
            if default is None:
                default = class_defaults[cls, name] = _class_value(cls, name) is not _MISSING
            if not default:
                return value
        read[key] = None
        followed[key] = value
        follow(value, id(self), (name,))
        return value

    reads = Reads()
    assert _owner != threading.get_ident(), "reads_recorded is not reentrant"
    with _one_at_a_time:
        assert _recording is None and "__getattribute__" not in vars(nn.Module)
        _owner, _recording = threading.get_ident(), modules
        nn.Module.__getattribute__ = recording
        try:
            yield reads
        finally:
            _restore(patched)
            _recording = _owner = None
    pairs = dict.fromkeys((modules[key], path) for key, path in read)  # a clone's and its original's: one
    reads.pairs = tuple((weakref.ref(module), path) for module, path in pairs
                        if _is_plain(_attribute(weakref.ref(module), path)))


def _restore(patched: list[tuple[type, object]]) -> None:
    """``nn.Module`` and each class patched, as they were: its own ``__getattribute__`` or none."""
    del nn.Module.__getattribute__
    for cls, own in reversed(patched):
        if own is None:
            del cls.__getattribute__
        else:
            cls.__getattribute__ = own
