"""``frontend.causal_masks``: nn.Transformer's layers given a mask and no ``is_causal`` are captured
with the mask applied (torch's check reads the mask's values: export stopped there)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.modules import transformer

import harmony_fx
from harmony_fx.frontend.causal_masks import causal_masks_applied
from tests.helpers import assert_grads_equal


class _CausalLM(nn.Module):
    """PyTorch's word_language_model TransformerModel, small: [time, batch] tokens, a causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(len(tokens))
        return self.head(self.encoder(self.embed(tokens), mask=mask))


def test_a_transformer_given_a_causal_mask_trains_like_eager():
    torch.manual_seed(0)
    model = _CausalLM()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 20, (6, 4))
    hm = harmony_fx.compile(model, (tokens,), devices=["host:0"], batch_dims=1)
    out, expected = hm(tokens), reference(tokens)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    expected.square().mean().backward()
    assert_grads_equal(model, reference, 1e-5, 1e-6)
    assert transformer._detect_is_causal_mask.__name__ == "_detect_is_causal_mask"  # torch's own, after


def test_torchs_check_is_back_after_an_error_and_a_given_hint_is_kept():
    original = transformer._detect_is_causal_mask
    with pytest.raises(RuntimeError, match="inside"):
        with causal_masks_applied():
            assert transformer._detect_is_causal_mask(torch.zeros(2, 2), True) is True
            assert transformer._detect_is_causal_mask(torch.zeros(2, 2), None) is False
            raise RuntimeError("inside")
    assert transformer._detect_is_causal_mask is original
