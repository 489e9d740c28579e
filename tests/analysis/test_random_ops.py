"""draws_random: random ops are found by their schema's seeded tag, inside no_grad regions too,
and a dropout that draws nothing is not one."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from harmony_fx.analysis.random_ops import draws_random
from harmony_fx.frontend.capture import capture


def _random_nodes(model: nn.Module, *inputs: torch.Tensor) -> list[str]:
    gm = capture(model, inputs).gm
    return [node.name for node in gm.graph.nodes if draws_random(node)]


class _Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_seeded_ops_are_random_by_their_tag():
    x = torch.randn(2, 2, 4, 4)
    assert _random_nodes(_Lambda(lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)), x)
    assert _random_nodes(_Lambda(lambda x: F.gumbel_softmax(x)), x)
    assert _random_nodes(_Lambda(lambda x: F.rrelu(x, training=True)), x)
    assert _random_nodes(_Lambda(lambda x: torch.bernoulli(torch.sigmoid(x))), x)
    assert _random_nodes(_Lambda(lambda x: F.dropout(x, 0.1)), x)


def test_ops_that_draw_nothing_are_not_random():
    x = torch.randn(2, 2, 4, 4)
    assert not _random_nodes(_Lambda(lambda x: F.scaled_dot_product_attention(x, x, x)), x)
    assert not _random_nodes(_Lambda(lambda x: F.dropout(x, 0.0)), x)
    assert not _random_nodes(_Lambda(lambda x: F.dropout(x, 0.5, training=False)), x)
    assert not _random_nodes(_Lambda(lambda x: x.relu() * 2), x)
    lstm = nn.LSTM(4, 4, num_layers=2)  # no dropout between its layers (it was said to draw)
    assert not _random_nodes(_Lambda(lambda x: lstm(x)[0]), torch.randn(3, 2, 4))
    dropping = nn.LSTM(4, 4, num_layers=2, dropout=0.5)
    assert _random_nodes(_Lambda(lambda x: dropping(x)[0]), torch.randn(3, 2, 4))


def test_a_random_op_inside_a_no_grad_region_makes_the_region_random():
    def noisy(x):
        with torch.no_grad():
            noise = torch.rand_like(x)
        return x + noise

    assert _random_nodes(_Lambda(noisy), torch.randn(3))


def test_symbolic_trace_calls_are_recognised_by_name():
    gm = fx.symbolic_trace(_Lambda(lambda x: F.dropout(x, 0.2) + torch.rand_like(x) + F.dropout(x, 0.0)))
    assert [node.name for node in gm.graph.nodes if draws_random(node)] == ["dropout", "rand_like"]
