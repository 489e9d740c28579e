"""``analysis.sizes``: bytes and FLOPs of every node, counted without running anything that could
change global state."""
from __future__ import annotations

import torch
from torch import nn

from harmony_fx.analysis.sizes import annotate_sizes
from harmony_fx.frontend.capture import capture
from harmony_fx.ir import meta


class NoGradInside(nn.Module):
    """A ``no_grad`` region in the forward: export puts it in a ``wrap_with_set_grad_enabled``."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 16)
        self.trained = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.frozen(x)
        return self.trained(h)


def test_a_higher_order_op_is_counted_from_its_subgraph_not_called():
    captured = capture(NoGradInside(), (torch.randn(3, 8),))
    wraps = [n for n in captured.gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert wraps, "export no longer makes a higher-order op of a no_grad region: pick another construct"
    torch.set_grad_enabled(True)
    annotate_sizes(captured.gm)
    assert torch.is_grad_enabled()  # calling the op would have turned it off for good on a failure
    # the frozen Linear inside: 2 * batch * in * out multiply-adds
    assert sum(n.meta[meta.FLOPS] for n in wraps) == 2 * 3 * 8 * 16
    total = sum(n.meta[meta.FLOPS] for n in captured.gm.graph.nodes)
    assert total == 2 * 3 * 8 * 16 + 2 * 3 * 16 * 4


def test_an_op_called_alike_again_is_counted_once_with_the_same_flops(monkeypatch):
    """A repeated call (same op, same shapes and constants) takes the FLOPs counted first; a call
    with another shape is counted again. Three Linear layers of 8 -> 8, then one of 8 -> 4."""
    from harmony_fx.analysis import sizes

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    captured = capture(model, (torch.randn(3, 8),))
    counts = []
    count = sizes._op_flops
    monkeypatch.setattr(sizes, "_op_flops", lambda node: counts.append(node.name) or count(node))
    annotate_sizes(captured.gm)
    flops = [n.meta[meta.FLOPS] for n in captured.gm.graph.nodes if n.meta[meta.FLOPS]]
    assert flops == [2 * 3 * 8 * 8] * 3 + [2 * 3 * 8 * 4]
    assert len(counts) == 2  # the first 8 -> 8 call and the 8 -> 4 one
