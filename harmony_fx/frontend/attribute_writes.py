"""A forward that assigns a tensor to a module attribute (``self.last_attn = attn.detach()``, kept
for a plot; ``self.src_mask = mask``, a cache), or adds one to a list or dict there
(``self.features.append(h)``), does so once, while harmony captures it: the compiled
model then runs its graph, which assigns nothing, and torch.export puts the attribute back as it
was. Said in harmony's words (export's own warning asks to register a buffer, which would not help):
return the tensor as an output instead. Python numbers and flags a forward sets (a call counter,
Funnel's ``seq_len``) are not said: libraries set them as scratch state, and README says a forward's
Python side effects run once; nor is a weight ``weight_norm`` or ``spectral_norm`` computes each call."""
from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from typing import Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["tensor_attribute_writes_said"]

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


def _holds_new_tensors(container, before: list | None) -> bool:
    """A tensor in ``container`` that was not in it before the forward (by identity)."""
    known = {id(item) for item in before or ()}
    return any(id(item) not in known and any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(item))
               for item in _contents(container))


@contextlib.contextmanager
def tensor_attribute_writes_said(model: nn.Module) -> Iterator[None]:
    """Around the capture of ``model``: warns once naming each attribute its forward set to a tensor."""
    before = {name: dict(module.__dict__) for name, module in model.named_modules()}
    contents = {(name, key): _contents(value) for name, attributes in before.items()
                for key, value in attributes.items() if isinstance(value, _CONTAINERS) and key not in _MODULES_OWN}
    assigned: list[str] = []

    def after_forward(*_) -> None:
        for name, module in model.named_modules():
            seen = before.get(name, {})
            assigned.extend(f"{name}.{key}" if name else key for key, value in module.__dict__.items()
                            if isinstance(value, torch.Tensor) and seen.get(key) is not value
                            and not _derived_from_parameters(module, key))
            assigned.extend(f"{name}.{key}" if name else key for key, value in module.__dict__.items()
                            if isinstance(value, _CONTAINERS) and key not in _MODULES_OWN
                            and _holds_new_tensors(value, contents.get((name, key))))

    handle = model.register_forward_hook(after_forward)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EXPORTS_WARNING)
            yield
    finally:
        handle.remove()
    if assigned and model not in _TOLD:
        _TOLD.add(model)  # once a model: each capture (the whole batch, a microbatch) would say it again
        names = ", ".join(sorted(set(assigned)))
        warnings.warn(
            f"harmony_fx: the model's forward keeps a tensor in the attribute {names} at each call (assigns it, or "
            "adds it to a list or dict there); the compiled model runs its graph, which does not (after a call the "
            "attribute holds what it held before compiling). Return the tensor as one of the model's outputs "
            "instead, or use torch.compile(model, backend='harmony'), which replays them.", stacklevel=4)
