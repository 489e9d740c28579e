"""A model's own activation checkpointing (``torch.utils.checkpoint``, non-reentrant: Hugging Face's
``gradient_checkpointing_enable()``, timm's ``set_grad_checkpointing()``) runs as a plain call while
the model is captured.

harmony_fx recomputes every pack in its backward already, so a checkpointed region inside a pack
saves nothing the pack's recompute does not. And ``torch.export`` mis-captures a checkpoint inside a
checkpoint (transformers' Swin: a checkpointed block inside a checkpointed stage, torch 2.11-2.13):
the inner region's bookkeeping leaves grad mode off for the rest of the graph, which then computes
without gradients (``loss.backward()`` failed: "element 0 of tensors does not require grad").
Run as a plain call, the region is traced as the forward it is; eager's numbers are the same (the
region's forward is what eager computes first; its recompute would compute it again).

The patch is torch's per-call hook, ``_checkpoint_without_reentrant_generator``, which ``checkpoint``
looks up on each call (so ``functools.partial(checkpoint, ...)`` bound before the capture, as
transformers binds it, is covered too): made to yield once and do nothing. Where torch has no such
function, nothing is patched.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch.utils import checkpoint

__all__ = ["checkpoints_as_plain_calls"]

_HOOK = "_checkpoint_without_reentrant_generator"


def _plain_call(*args, **kwargs) -> Iterator[None]:
    yield  # before the region's forward; the forward then runs as it is, and nothing follows


@contextlib.contextmanager
def checkpoints_as_plain_calls() -> Iterator[None]:
    original = getattr(checkpoint, _HOOK, None)
    if original is None:
        yield
        return
    setattr(checkpoint, _HOOK, _plain_call)
    try:
        yield
    finally:
        setattr(checkpoint, _HOOK, original)
