import torch

import harmony_fx
from harmony_fx.ir import meta
from harmony_fx.testing.models import ResidualMLP


def test_skip_value_spans_every_pack_and_dies_at_the_head():
    torch.manual_seed(0)
    model = ResidualMLP(width=16, depth=4)
    hm = harmony_fx.compile(model, torch.randn(4, 16), memory_budget=None, pack_boundaries=(0, 3, 6))
    nodes = {node.name: node for node in hm.captured.gm.graph.nodes}
    stem = nodes["linear"]  # the stem's output, added back before the head
    assert stem.meta[meta.LIVE_PACKS] == (0, len(hm.packs) - 1)
    assert stem.meta[meta.LAST_USE] == "add_4"
    (output,) = hm.captured.gm.graph.find_nodes(op="output")
    head = output.args[0][0]
    assert head.meta[meta.LAST_USE] == "output"
    assert nodes["x"].meta[meta.LIVE_PACKS][0] == -1


def test_annotations_change_nothing_else():
    torch.manual_seed(0)
    model = ResidualMLP(width=16, depth=2)
    x = torch.randn(4, 16)
    hm = harmony_fx.compile(model, x)
    torch.testing.assert_close(hm(x), model(x))
