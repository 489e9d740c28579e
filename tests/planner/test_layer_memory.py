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


def test_layers_alike_are_measured_once_with_the_figures_of_measuring_each(monkeypatch):
    """A transformer's blocks repeat: each kind of layer runs once (the 59-layer GPT-2's profile
    went from 3.5 s to 0.2 s), and the figures are those of measuring every layer."""
    from harmony_fx.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=4, block_size=16, dropout=0.0))
    variant = capture_variant(model, None, (torch.randint(0, 96, (4, 16)),), {}, torch.device("cpu"))
    gm, layers = variant.captured.gm, list(variant.layers)

    def measure() -> tuple[list, int]:
        runs = []
        measured = layer_memory._measure
        monkeypatch.setattr(layer_memory, "_measure", lambda *args: runs.append(1) or measured(*args))
        try:
            return layer_memory.measure_layer_memory(gm, layers, layer_memory.last_readers(gm, layers),
                                                     lambda node: 0, device_type="cpu"), len(runs)
        finally:
            monkeypatch.setattr(layer_memory, "_measure", measured)

    alike, runs_alike = measure()
    monkeypatch.setattr(layer_memory, "layer_signature", lambda *args: object())  # every layer its own
    each, runs_each = measure()
    assert alike == each
    assert runs_each == len(layers) > runs_alike
