"""A forward's tensor attribute writes are said once, in harmony's words (``frontend.attribute_writes``)."""
from __future__ import annotations

import warnings

import torch
from torch import nn

import harmony_fx


class _KeepsItsAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.calls, self.last_attn = 0, None

    def forward(self, x):
        self.calls += 1  # Python scratch state: not said
        attn = torch.softmax(self.inner(x), -1)
        self.last_attn = attn.detach()  # kept for a plot: the compiled model never assigns it
        self.inner.seen = x.sum()
        return attn.sum(-1)


def _warnings_of_compile(model: nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        harmony_fx.compile(model, torch.randn(2, 4), devices=["host:0"])
    return [str(warning.message) for warning in caught]


def test_a_tensor_the_forward_assigns_to_an_attribute_is_named_once_with_what_to_do():
    said = _warnings_of_compile(_KeepsItsAttention())
    ours = [message for message in said if "assigns a tensor" in message]
    assert len(ours) == 1 and "inner.seen, last_attn at each call" in ours[0]
    assert "outputs" in ours[0]
    assert not [message for message in said if "assigned during export" in message]  # torch.export's, replaced


def test_a_forward_that_assigns_no_tensor_is_not_warned_about():
    model = _KeepsItsAttention()
    model.forward = lambda x: model.inner(x).sum(-1)
    assert not [message for message in _warnings_of_compile(model) if "assigns a tensor" in message]
