"""``planner.layer_memory``: measuring a layer never leaves grad mode changed, even where the layer
cannot be measured."""
from __future__ import annotations

import torch
from torch import nn

from harmony_fx.compiler.variants import capture_variant
from harmony_fx.planner import layer_memory


class NoGradInside(nn.Module):
    """A ``no_grad`` region: export makes it a higher-order op that sets grad mode around its
    subgraph and does not put it back if the subgraph raises."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.trained = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.frozen(x)
        return self.trained(h)


def test_a_layer_that_fails_with_grad_mode_off_is_bounded_and_grad_mode_restored(monkeypatch):
    variant = capture_variant(NoGradInside(), None, (torch.randn(3, 8),), {}, torch.device("cpu"))
    gm, layers = variant.captured.gm, list(variant.layers)
    measured = layer_memory.measure_layer_memory(gm, layers, layer_memory.last_readers(gm, layers), lambda node: 7)

    def fails_like_the_higher_order_op(*args):
        torch.set_grad_enabled(False)
        raise RuntimeError("a subgraph op with no meta kernel")

    monkeypatch.setattr(layer_memory, "_measure", fails_like_the_higher_order_op)
    assert torch.is_grad_enabled()
    bounded = layer_memory.measure_layer_memory(gm, layers, layer_memory.last_readers(gm, layers), lambda node: 7)
    assert torch.is_grad_enabled()
    assert len(bounded) == len(measured) and all(m.kept == 7 * len(layer.nodes)
                                                 for m, layer in zip(bounded, variant.layers))
