"""``nn.Transformer``'s question "is this mask causal?", answered "no" while capturing.

``nn.TransformerEncoder`` and ``nn.TransformerDecoder``, given a mask and no ``is_causal``, compare
the mask's values with a causal mask of its size (``_detect_is_causal_mask``) to pick a faster
kernel. A capture cannot read values, so export stops there on a data-dependent guard, inside
torch's code, where the user can change nothing (PyTorch's word_language_model, its
nn.Transformer tutorial). torch documents the answer as a hint for speed alone: with
``is_causal=False`` the mask is applied as given, and the result is the same. So while capturing the
check answers ``False``; a caller's own ``is_causal`` is kept.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch.nn.modules import transformer

__all__ = ["causal_masks_applied"]


def _mask_applied(mask, is_causal: bool | None = None, size: int | None = None) -> bool:
    return is_causal is True


@contextlib.contextmanager
def causal_masks_applied() -> Iterator[None]:
    """While the block runs, ``nn.Transformer``'s layers apply their masks as given instead of
    reading them to choose a kernel; torch's check after."""
    original = getattr(transformer, "_detect_is_causal_mask", None)
    if original is None:  # a torch without the check
        yield
        return
    transformer._detect_is_causal_mask = _mask_applied
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = original
