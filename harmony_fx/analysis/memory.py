"""What eager training needs: the reference that memory budgets are set against."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from harmony_fx.ir.tracking import AllocationTracker

__all__ = ["eager_training_bytes"]


def eager_training_bytes(model: nn.Module, args: tuple, loss_fn: Callable[[object], torch.Tensor],
                         kwargs: dict | None = None) -> int:
    """Peak bytes of one eager training step (``loss_fn(model(*args, **kwargs)).backward()``) with the
    whole model on one device: parameters and buffers, their gradients, activations and temporaries,
    each storage once (a view of a weight, ``weight.t()`` in every Linear, is the weight's bytes).
    Runs on a copy of the model, so the original's gradients and buffers are untouched."""
    model = copy.deepcopy(model)
    tracker = AllocationTracker()
    for tensor in list(model.parameters()) + list(model.buffers()):
        tracker.register(tensor)  # resident from the start; their views add nothing
    with torch.random.fork_rng(devices=[]), tracker.mode():
        loss = loss_fn(model(*args, **(kwargs or {})))
        loss.backward()
        del loss
    return tracker.peak
