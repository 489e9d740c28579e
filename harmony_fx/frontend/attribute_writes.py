"""A forward that assigns a tensor to a module attribute (``self.last_attn = attn.detach()``, kept
for a plot; ``self.src_mask = mask``, a cache) does so once, while harmony captures it: the compiled
model then runs its graph, which assigns nothing, and torch.export puts the attribute back as it
was. Said in harmony's words (export's own warning asks to register a buffer, which would not help):
return the tensor as an output instead. Python numbers and flags a forward sets (a call counter,
Funnel's ``seq_len``) are not said: libraries set them as scratch state, and README says a forward's
Python side effects run once."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
from torch import nn

__all__ = ["tensor_attribute_writes_said"]

# export warns "The tensor attribute self.x was assigned during export. Such attributes must be
# registered as buffers": harmony says it instead
_EXPORTS_WARNING = r"The tensor attributes? .* (was|were) assigned during export"


@contextlib.contextmanager
def tensor_attribute_writes_said(model: nn.Module) -> Iterator[None]:
    """Around the capture of ``model``: warns once naming each attribute its forward set to a tensor."""
    before = {name: dict(module.__dict__) for name, module in model.named_modules()}
    assigned: list[str] = []

    def after_forward(*_) -> None:
        for name, module in model.named_modules():
            seen = before.get(name, {})
            assigned.extend(f"{name}.{key}" if name else key for key, value in module.__dict__.items()
                            if isinstance(value, torch.Tensor) and seen.get(key) is not value)

    handle = model.register_forward_hook(after_forward)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EXPORTS_WARNING)
            yield
    finally:
        handle.remove()
    if assigned:
        names = ", ".join(sorted(set(assigned)))
        warnings.warn(
            f"harmony_fx: the model's forward assigns a tensor to the attribute {names} at each call; the compiled "
            "model runs its "
            "graph, which does not (after a call it holds what it held before compiling). Return the tensor as one "
            "of the model's outputs instead, or use torch.compile(model, backend='harmony'), which replays such "
            "assignments.", stacklevel=4)
