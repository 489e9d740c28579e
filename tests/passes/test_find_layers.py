"""find_layers: layers are the model's repeated blocks, tiling the compute nodes in order."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import harmony_fx
from harmony_fx.compiler.packing import BudgetTooSmallError
from harmony_fx.ir import meta
from harmony_fx.passes.find_layers import find_layers
from tests.helpers import ZOO, assert_backward_equal, prepared


def _compute_nodes(gm: fx.GraphModule) -> list[str]:
    return [node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output")]


@pytest.mark.parametrize("name", list(ZOO))
def test_layers_tile_the_compute_nodes_in_order(name):
    prep = prepared(name)
    gm = prep.captured.gm
    assert [layer.index for layer in prep.layers] == list(range(len(prep.layers)))
    assert [n for layer in prep.layers for n in layer.nodes] == _compute_nodes(gm)
    nodes = {node.name: node for node in gm.graph.nodes}
    for layer in prep.layers:
        assert layer.nodes, f"empty layer {layer}"
        for node_name in layer.nodes:
            assert nodes[node_name].meta[meta.LAYER] == layer.index
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            assert meta.LAYER not in node.meta


def test_mlp_chain_layers_are_its_blocks_then_the_head():
    prep = prepared("mlp_chain")
    names = [layer.name for layer in prep.layers]
    assert names[:12] == [f"blocks.{i}" for i in range(12)]
    # the head is no repeated block: its nodes are layers of their own, after every block
    assert all(not name.startswith("blocks.") for name in names[12:]) and len(names) > 12
    # a block is the outermost indexed module: blocks.3.0 (Linear) and blocks.3.1 (ReLU) are one layer
    block3 = prep.layers[3]
    nodes = {node.name: node for node in prep.captured.gm.graph.nodes}
    paths = {path for n in block3.nodes for path, _ in nodes[n].meta["nn_module_stack"].values()}
    assert any(p.endswith("blocks.3.0") for p in paths) and any(p.endswith("blocks.3.1") for p in paths)
    assert all(nodes[n].meta[meta.LAYER_NAME] == "blocks.3" for n in block3.nodes)


def test_tiny_gpt_has_one_layer_per_transformer_block():
    prep = prepared("tiny_gpt")
    names = [layer.name for layer in prep.layers]
    blocks = [name for name in names if name.startswith("h.")]
    assert blocks == [f"h.{i}" for i in range(8)]
    h3 = next(layer for layer in prep.layers if layer.name == "h.3")
    # attention, both LayerNorms and the MLP of h[3] are all in layer h.3
    assert len(h3.nodes) > 10


def _graph_with_stacks(stacks: list[dict | None]) -> fx.GraphModule:
    """x -> relu -> relu -> ...: one node per entry, with that ``nn_module_stack``."""
    graph = fx.Graph()
    value = graph.placeholder("x")
    for stack in stacks:
        value = graph.call_function(torch.relu, (value,))
        if stack is not None:
            value.meta["nn_module_stack"] = stack
    graph.output(value)
    return fx.GraphModule(nn.Module(), graph)


def test_dynamo_spelling_of_module_paths_is_normalised():
    gm = _graph_with_stacks([
        {"a": ("L['self'].h[3]", nn.Module), "b": ("L['self'].h[3].mlp[0]", nn.Linear)},
        {"a": ("L['self'].h[3]", nn.Module)},
        {"a": ("L['self'].h[4]", nn.Module)},
    ])
    layers = find_layers(gm)
    assert [(layer.name, len(layer.nodes)) for layer in layers] == [("h.3", 2), ("h.4", 1)]


def test_a_block_interrupted_by_other_nodes_gives_separate_layers():
    block = {"a": ("blocks.0", nn.Sequential)}
    gm = _graph_with_stacks([block, block, None, block])
    layers = find_layers(gm)
    assert [len(layer.nodes) for layer in layers] == [2, 1, 1]
    assert layers[0].name == "blocks.0" and layers[2].name == "blocks.0"
    assert layers[1].name == layers[1].nodes[0]  # an unblocked node is named after itself


def test_unindexed_modules_are_layers_of_their_own_node():
    gm = _graph_with_stacks([{"a": ("stem", nn.Linear)}, {"a": ("stem", nn.Linear)}])
    layers = find_layers(gm)
    assert [layer.nodes for layer in layers] == [(n,) for n in _compute_nodes(gm)]


def test_a_hierarchical_models_blocks_are_layers_not_its_stages():
    """A stage of blocks (Swin's ``layers.0.blocks.1``, ConvNeXt's ``stages.0.blocks.2``) was one
    layer, so no pack was smaller than a stage: a ConvNeXt-T's smallest budget was 114 MiB where its
    blocks fit in 55. A block's own Sequential of different layers (``mlp.0``, ``mlp.1``) stays in it."""
    def stack(stage: int, block: int | None, inner: str | None = None) -> dict:
        entries = {"s": (f"layers.{stage}", "Stage")}
        if block is not None:
            entries["b"] = (f"layers.{stage}.blocks.{block}", "Block")
        if inner is not None:
            entries["i"] = (f"layers.{stage}.blocks.{block}.mlp.{inner[0]}", inner[1:])
        return entries

    gm = _graph_with_stacks([stack(0, 0, "0Linear"), stack(0, 0, "1GELU"), stack(0, 1), stack(0, None),
                             stack(1, 0), stack(1, 1, "0Linear")])
    assert [(layer.name, len(layer.nodes)) for layer in find_layers(gm)] == [
        ("layers.0.blocks.0", 2), ("layers.0.blocks.1", 1), ("layers.0", 1), ("layers.1.blocks.0", 1),
        ("layers.1.blocks.1", 1)]


def test_a_stage_of_unlike_blocks_is_cut_at_its_blocks():
    """A stage whose blocks are of two classes (NextViT's NCB and NTB, DaViT's (SpatialBlock,
    ChannelBlock) pairs) was one layer: its blocks' siblings were not all of one class, so the
    stage was the innermost repeated module (timm's iformer_s: smallest budget 32.9 MiB where its
    blocks fit in 6.1). Blocks that hold modules of their own are blocks; a Sequential of single
    layers (``mlp.0`` a Linear, ``mlp.1`` a GELU) stays one layer."""
    def stack(stage: int, block: int, kind: str, inner: str | None = None) -> dict:
        entries = {"s": (f"stages.{stage}", "Stage"), "b": (f"stages.{stage}.blocks.{block}", kind)}
        entries["c"] = (f"stages.{stage}.blocks.{block}.{inner or 'conv'}", "Conv2d" if inner is None else "Linear")
        return entries

    stacks = [stack(0, 0, "NCB"), stack(0, 1, "NCB"), stack(0, 2, "NTB"), stack(1, 0, "NCB"), stack(1, 1, "NTB"),
              {"s": ("stages.1", "Stage"), "m": ("stages.1.mlp.0", "Linear")},
              {"s": ("stages.1", "Stage"), "m": ("stages.1.mlp.1", "GELU")}]
    assert [(layer.name, len(layer.nodes)) for layer in find_layers(_graph_with_stacks(stacks))] == [
        ("stages.0.blocks.0", 1), ("stages.0.blocks.1", 1), ("stages.0.blocks.2", 1), ("stages.1.blocks.0", 1),
        ("stages.1.blocks.1", 1), ("stages.1", 2)]


class _ConvBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


class _OtherConvBlock(_ConvBlock):
    """A block of another class, its weights the size of a _ConvBlock's."""

    def forward(self, x):
        return x + nn.functional.gelu(self.conv(x))


class _StagesNet(nn.Module):
    def __init__(self, last: type, dim: int = 32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 1)
        self.stages = nn.Sequential(*[nn.Sequential(_ConvBlock(dim), _ConvBlock(dim), last(dim)) for _ in range(2)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def test_a_stage_of_unlike_blocks_needs_the_budget_of_a_stage_of_like_ones_and_matches_eager():
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))

    def smallest(last: type) -> int:
        torch.manual_seed(0)
        with pytest.raises(BudgetTooSmallError) as err:
            harmony_fx.compile(_StagesNet(last), (x,), memory_budget=1, devices=["host:0"], microbatches=1)
        return err.value.smallest_budget

    budget = smallest(_OtherConvBlock)
    assert budget <= 1.05 * smallest(_ConvBlock)  # was a whole stage's: 1.8x
    torch.manual_seed(0)
    model = _StagesNet(_OtherConvBlock)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x,), memory_budget=budget, devices=["host:0"], microbatches=1, track_memory=True)
    nn.functional.cross_entropy(hm(x), y).backward()
    nn.functional.cross_entropy(reference(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


class _ConvScaledByRunningStd(nn.Module):
    """QAT's fused ConvBn (``torch.ao.nn.intrinsic.qat.ConvBnReLU2d``): the conv's weight is scaled by
    ``bn.weight / sqrt(bn.running_var + eps)`` before the BatchNorm, which then updates
    ``running_var`` in place."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        scale = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)
        conv = nn.functional.conv2d(x, self.conv.weight * scale.reshape(-1, 1, 1, 1), padding=1)
        return torch.relu(self.bn(conv / scale.reshape(1, -1, 1, 1)))


class _TwoScaledConvs(nn.Module):
    """Its modules named, not in a container: a layer per op, as QAT's prepared models are."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.first, self.second = nn.Conv2d(3, 8, 3, padding=1), _ConvScaledByRunningStd(8), \
            _ConvScaledByRunningStd(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.second(self.first(self.stem(x))).mean((2, 3)))


def test_a_norms_running_statistic_read_before_the_norm_updates_it_is_in_the_norms_layer():
    """The read of ``running_var`` and the BatchNorm were cut into two packs: the first pack's
    recompute read the statistic the second had updated, and its weight's gradient was silently
    off (4% on QAT's ConvBnReLU2d), the loss and every later gradient eager's."""
    torch.manual_seed(0)
    model = _TwoScaledConvs()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    with pytest.raises(BudgetTooSmallError) as refused:
        harmony_fx.compile(copy.deepcopy(model), (x,), memory_budget=1, devices=["host:0"], microbatches=1)
    hm = harmony_fx.compile(model, (x,), memory_budget=refused.value.smallest_budget, devices=["host:0"],
                            microbatches=1)
    assert len(hm.packs) >= 4
    reads = {name for pack in hm.packs for name in pack.buffers if name.endswith("running_var")}
    assert len(reads) == 2 and all(sum(name in pack.buffers for pack in hm.packs) == 1 for name in reads)
    for _ in range(2):
        assert_backward_equal(hm, model, reference, x)
