"""``frontend.decomposition_fixes``: the LSTM decomposition export traces gives each layer's final
state as ``(B, H)`` on every supported torch (torch < 2.13 left a leading 1)."""
from __future__ import annotations

import torch
from torch._decomp import decompositions

from harmony_fx.frontend.decomposition_fixes import _squeezing, decomposition_fixes


def _final_state_dims() -> tuple[int, int]:
    batch, hidden = 3, 2
    inputs = torch.randn(4, batch, 5)
    state = (torch.zeros(batch, hidden), torch.zeros(batch, hidden))
    params = [torch.randn(4 * hidden, 5), torch.randn(4 * hidden, hidden)]
    _, (h, c) = decompositions.one_layer_lstm(inputs, state, params, has_biases=False)
    return h.dim(), c.dim()


def test_the_final_state_has_the_states_dims_while_capturing():
    original = decompositions.one_layer_lstm
    with decomposition_fixes():
        assert _final_state_dims() == (2, 2)
    assert decompositions.one_layer_lstm is original  # the installed one again after


def test_the_wrapper_squeezes_only_a_leading_dim_torch_left():
    def buggy(inp, hidden, params, has_biases, reverse=False):
        return inp, (hidden[0].unsqueeze(0), hidden[1].unsqueeze(0))

    def right(inp, hidden, params, has_biases, reverse=False):
        return inp, hidden

    state = (torch.zeros(3, 2), torch.zeros(3, 2))
    for layer in (buggy, right):
        _, (h, c) = _squeezing(layer)(None, state, [], False)
        assert h.shape == c.shape == (3, 2)
