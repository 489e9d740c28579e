"""annotate_requires_grad: every value requires grad exactly where eager's does, leaf by leaf."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harmony_fx.analysis.requires_grad import annotate_requires_grad, requires_grad_of
from harmony_fx.frontend.capture import capture


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x, target):
        hidden = self.linear(x)
        out, (h, c) = self.lstm(hidden)
        with torch.no_grad():
            scaled = hidden * 2
        frozen = self.frozen(target)
        return F.soft_margin_loss(out, target) + scaled.sum() + h.detach().sum() + frozen.sum() + out.argmax()


def _flags(x_requires_grad: bool) -> dict[str, tuple[bool, ...]]:
    torch.manual_seed(0)
    model = _Mixed()
    x, target = torch.randn(2, 3, 4, requires_grad=x_requires_grad), torch.randn(2, 3, 4).sign()
    captured = capture(model, (x, target))
    flags = {name: p.requires_grad for name, p in captured.params.items()}
    flags.update(zip(captured.inputs, (x.requires_grad, target.requires_grad)))
    annotate_requires_grad(captured.gm, flags)
    by_target = {}
    for node in captured.gm.graph.nodes:
        key = node.target.__name__ if callable(node.target) and hasattr(node.target, "__name__") else str(node.target)
        by_target.setdefault(key, requires_grad_of(node))
    return by_target


def test_flags_follow_autograd_as_eager_does():
    flags = _flags(x_requires_grad=False)
    assert flags["x"] == (False,) and flags["target"] == (False,)
    assert flags["linear.default"] == (True,)                 # reads a trainable weight
    assert flags["lstm.input"] == (True, True, True)          # one flag per leaf of (out, h, c)
    assert flags["wrap_with_set_grad_enabled"] == (False,)    # computed under no_grad
    assert flags["detach.default"] == (False,)
    assert flags["argmax.default"] == (False,)                # an integer result
    assert flags["soft_margin_loss.default"] == (True,)


def test_a_frozen_layer_on_an_input_without_grad_requires_none():
    flags = _flags(x_requires_grad=False)
    frozen_linears = [name for name in flags if name.startswith("linear")]
    assert frozen_linears  # the frozen layer reads target only: it shares the op name, so check the input side
    assert _flags(x_requires_grad=True)["x"] == (True,)
