"""Work-arounds for bugs in the decompositions of the torch versions harmony_fx supports, applied
only while capturing and only where the installed torch has the bug (found by behaviour, not by
version number).

- ``one_layer_lstm`` (``torch._decomp.decompositions``, torch < 2.13): the LSTM decomposition that
  export traces returns the final ``h``/``c`` of each layer as ``(1, B, H)`` (it squeezes dim 1,
  not the leading 1 it added), so the graph records ``h_n`` as ``(layers, 1, B, H)`` and the next
  LSTM rejects it. The wrapper squeezes the leading dim that torch left.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch._decomp import decompositions

__all__ = ["decomposition_fixes"]


@functools.cache
def _lstm_keeps_a_leading_dim() -> bool:
    layer = getattr(decompositions, "one_layer_lstm", None)
    if layer is None:
        return False
    batch, hidden = 2, 1
    inputs = torch.zeros(1, batch, 1)
    state = (torch.zeros(batch, hidden), torch.zeros(batch, hidden))
    params = [torch.zeros(4 * hidden, 1), torch.zeros(4 * hidden, hidden)]
    _, (h, _) = layer(inputs, state, params, has_biases=False)
    return h.dim() != state[0].dim()


def _squeezing(layer):
    @functools.wraps(layer)
    def one_layer_lstm(inp, hidden, params, has_biases, reverse=False):
        out, (h, c) = layer(inp, hidden, params, has_biases, reverse)
        if h.dim() == hidden[0].dim() + 1:
            h, c = h.squeeze(0), c.squeeze(0)
        return out, (h, c)
    return one_layer_lstm


@contextlib.contextmanager
def decomposition_fixes() -> Iterator[None]:
    """The fixed decompositions while the block runs (capturing), the installed ones after."""
    if not _lstm_keeps_a_leading_dim():
        yield
        return
    original = decompositions.one_layer_lstm
    decompositions.one_layer_lstm = _squeezing(original)
    try:
        yield
    finally:
        decompositions.one_layer_lstm = original
