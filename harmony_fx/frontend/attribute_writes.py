"""A forward that assigns a tensor to a module attribute (``self.last_attn = attn.detach()``, kept
for a plot; ``self.src_mask = mask``, a cache), or adds one to a list or dict there
(``self.features.append(h)``), does so once, while harmony captures it: the compiled
model then runs its graph, which assigns nothing, and torch.export puts the attribute back as it
was. Said in harmony's words (export's own warning asks to register a buffer, which would not help):
return the tensor as an output instead. Python numbers and flags a forward sets (a call counter,
Funnel's ``seq_len``) are not said: libraries set them as scratch state, and README says a forward's
Python side effects run once; nor is a weight ``weight_norm`` or ``spectral_norm`` computes each call,
nor a list of the module's own parameters (``nn.LSTM``/``nn.GRU``/``nn.RNN`` remake ``_flat_weights``
from their weights when they find them changed, as they are while export holds its own).

A registered buffer the forward replaces by a new tensor (``self.count = self.count + 1``; ConViT's
``self.rel_indices = ...``) is said too, apart: torch.export drops the assignment (no buffer
mutation in its graph), so the model's buffer keeps its value where eager's changes, and the advice
differs: a write in place (``self.count.add_(1)``, ``copy_``) is kept, as BatchNorm's statistics
are. Buffers are compared with what they were when the forward began (export has swapped them for
its own tensors by then); one the captured graph writes all the same (export keeps the root
module's assignment, as a ``copy_``) is not said."""
from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from typing import Iterator

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from harmony_fx.analysis.buffer_writes import written_buffers
from harmony_fx.user_frames import user_stacklevel

__all__ = ["new_tensors_taken_back", "tensor_attribute_writes_said"]

# export warns "The tensor attribute self.x was assigned during export. Such attributes must be
# registered as buffers": harmony says it instead
_EXPORTS_WARNING = r"The tensor attributes? .* (was|were) assigned during export"


_TOLD: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _derived_from_parameters(module: nn.Module, key: str) -> bool:
    """The weight ``weight_norm`` or ``spectral_norm`` computes from ``weight_g``/``weight_v`` or
    ``weight_orig`` in a forward pre-hook at every call: a value of each call, nothing kept."""
    return any(isinstance(getattr(module, key + suffix, None), nn.Parameter) for suffix in ("_orig", "_g", "_v"))


# what a forward appends to or sets an item of (``self.features.append(h)``, ``self.maps[name] = attn``)
_CONTAINERS = (list, dict, collections.deque)
# nn.Module's own dicts (parameters, buffers, hooks): export swaps the parameters in them for its own
_MODULES_OWN = frozenset(nn.Module().__dict__)


def _contents(container) -> list:
    return list(container.items()) if isinstance(container, dict) else list(container)


def _identity(container, item) -> tuple:
    """An item of ``container`` by identity: a dict's by its key and its value's identity (its
    items are new tuples at each read), a list's by its own."""
    return (item[0], id(item[1])) if isinstance(container, dict) else (id(item),)


def _only_own_parameters(module: nn.Module, container) -> bool:
    """Every tensor in ``container`` is one of ``module``'s own parameters: ``nn.RNNBase``'s
    ``_flat_weights``, which its forward remakes from the weights export swapped in. Nothing of a
    call's values is kept there (the model's own parameters are put back after the capture)."""
    own = {id(parameter) for parameter in module._parameters.values() if parameter is not None}
    tensors = [leaf for leaf in pytree.tree_leaves(_contents(container)) if isinstance(leaf, torch.Tensor)]
    return bool(tensors) and all(id(tensor) in own for tensor in tensors)


def _holds_new_tensors(container, before: list | None) -> bool:
    """A tensor in ``container`` that was not in it before the forward (by identity)."""
    known = {_identity(container, item) for item in before or ()}
    return any(_identity(container, item) not in known
               and any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(item))
               for item in _contents(container))


@contextlib.contextmanager
def new_tensors_taken_back(model: nn.Module) -> Iterator[None]:
    """Around one ``torch.export.export`` of ``model``: export puts back the attributes and buffers it
    swapped, but not a tensor the forward set where there was none: an attribute it made
    (``self.cache = ...``) or a buffer registered as ``None`` and filled on the first call
    (x-transformers' ``AlibiPositionalBias`` caches its bias so). That tensor is export's FakeTensor:
    left in the model, the next export (of a microbatch, or of the next call, whose key holds the
    buffers) reads it as the model's buffer, and the calls return FakeTensors for the loss and the
    gradients. Taken back after each export, so the model holds what it held before, as
    ``tensor_attribute_writes_said`` says."""
    before = {name: (set(module.__dict__), dict(module._buffers)) for name, module in model.named_modules()}
    try:
        yield
    finally:
        for name, module in model.named_modules():
            if name not in before:  # a module the forward made: nothing of the model's own
                continue
            attributes, held = before[name]
            for key in [key for key, value in module.__dict__.items()
                        if key not in attributes and isinstance(value, torch.Tensor)]:
                del module.__dict__[key]
            for key in [key for key, value in module._buffers.items()
                        if isinstance(value, torch.Tensor) and held.get(key) is None]:
                if key in held:
                    module._buffers[key] = None
                else:
                    del module._buffers[key]
                    module._non_persistent_buffers_set.discard(key)


class CapturedGraph:
    """What the capture made, handed back to ``tensor_attribute_writes_said`` (``gm``: ``None``
    until then): the buffers its graph writes need no word."""

    gm: fx.GraphModule | None = None


@contextlib.contextmanager
def tensor_attribute_writes_said(model: nn.Module) -> Iterator[CapturedGraph]:
    """Around the capture of ``model``: warns once naming each attribute its forward set to a tensor
    (the caller sets the yielded ``CapturedGraph``'s ``gm`` to what it captured)."""
    before = {name: dict(module.__dict__) for name, module in model.named_modules()}
    contents = {(name, key): _contents(value) for name, attributes in before.items()
                for key, value in attributes.items() if isinstance(value, _CONTAINERS) and key not in _MODULES_OWN}
    buffers_before: dict[str, dict[str, object]] = {}
    assigned: list[str] = []
    replaced: list[str] = []

    def before_forward(*_) -> None:
        buffers_before.clear()
        buffers_before.update({name: dict(module._buffers) for name, module in model.named_modules()})

    def keeps_a_tensor(name: str, module: nn.Module, key: str, value: object) -> bool:
        if isinstance(value, torch.Tensor):
            return before.get(name, {}).get(key) is not value and not _derived_from_parameters(module, key)
        return isinstance(value, _CONTAINERS) and key not in _MODULES_OWN and \
            _holds_new_tensors(value, contents.get((name, key))) and not _only_own_parameters(module, value)

    def after_forward(*_) -> None:
        for name, module in model.named_modules():
            assigned.extend(f"{name}.{key}" if name else key for key, value in module.__dict__.items()
                            if keeps_a_tensor(name, module, key, value))
            held = buffers_before.get(name, {})
            replaced.extend(f"{name}.{key}" if name else key for key, value in module._buffers.items()
                            if isinstance(value, torch.Tensor) and key in held and held[key] is not value)

    handles = [model.register_forward_pre_hook(before_forward), model.register_forward_hook(after_forward)]
    captured = CapturedGraph()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EXPORTS_WARNING)
            yield captured
    finally:
        for handle in handles:
            handle.remove()
    written = set() if captured.gm is None else written_buffers(captured.gm)
    replaced = [name for name in replaced if name not in written]
    if not (assigned or replaced) or model in _TOLD:
        return
    _TOLD.add(model)  # once a model: each capture (the whole batch, a microbatch) would say it again
    if replaced:
        warnings.warn(
            f"harmony_fx: the model's forward replaces its buffer {', '.join(sorted(set(replaced)))} by a new tensor "
            "(`self.buf = ...`) when called; the compiled model runs its graph, which does not, so the buffer keeps "
            "the value it had before compiling where eager's changes. Write into the buffer in place instead "
            "(`self.buf.copy_(...)`, `self.buf.add_(1)`), which harmony_fx keeps as it keeps BatchNorm's running "
            "statistics, or return the tensor as one of the model's outputs.", stacklevel=user_stacklevel())
    if assigned:
        warnings.warn(
            f"harmony_fx: the model's forward keeps a tensor in the attribute {', '.join(sorted(set(assigned)))} at "
            "each call (assigns it, or adds it to a list or dict there); the compiled model runs its graph, which "
            "does not (after a call the attribute holds what it held before compiling). Return the tensor as one of "
            "the model's outputs instead, or use torch.compile(model, backend='harmony'), which replays them.",
            stacklevel=user_stacklevel())
