"""split_packs: one GraphModule per contiguous range of layers, with cross-pack values as inputs."""
from __future__ import annotations

import copy

import pytest
import torch

import harmony_fx
from harmony_fx.ir import meta
from harmony_fx.compiler.packing import balanced
from harmony_fx.passes.split_packs import annotate_packs, split_packs
from tests.helpers import ZOO, assert_grads_equal, prepared


def _split(name: str, num_packs: int):
    """The packs, and the packing written on the graph (``annotate_packs``: the chosen packing)."""
    prep = prepared(name)
    boundaries = balanced([1] * len(prep.layers), num_packs)
    packs = split_packs(prep.captured.gm, prep.layers, boundaries, prep.masters)
    annotate_packs(prep.captured.gm, prep.layers, boundaries)
    return prep, packs


def test_split_packs_writes_nothing_on_the_graph():
    """Evaluating a candidate packing must leave the shared graph as it was."""
    prep = prepared("mlp_chain")
    before = {node.name: dict(node.meta) for node in prep.captured.gm.graph.nodes}
    split_packs(prep.captured.gm, prep.layers, balanced([1] * len(prep.layers), 3), prep.masters)
    assert {node.name: dict(node.meta) for node in prep.captured.gm.graph.nodes} == before


def _model_outputs(prep) -> list[str]:
    output = prep.captured.gm.graph.find_nodes(op="output")[0]
    return [arg.name for arg in output.args[0]]


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("num_packs", [1, 4])
def test_packs_are_contiguous_and_cover_every_layer(name, num_packs):
    prep, packs = _split(name, num_packs)
    assert len(packs) == num_packs
    assert [layer for pack in packs for layer in pack.layers] == list(range(len(prep.layers)))
    nodes = {node.name: node for node in prep.captured.gm.graph.nodes}
    for pack in packs:
        pack.gm.graph.lint()
        for layer in pack.layers:
            assert all(nodes[n].meta[meta.PACK] == pack.index for n in prep.layers[layer].nodes)
        # placeholders: activations first, then state, in the order the pack declares them
        placeholders = [n.name for n in pack.gm.graph.find_nodes(op="placeholder")]
        assert placeholders == list(pack.act_inputs + pack.state_inputs)
        returned = pack.gm.graph.find_nodes(op="output")[0].args[0]
        assert [n.name for n in returned] == list(pack.outputs)


@pytest.mark.parametrize("name", list(ZOO))
def test_running_the_packs_in_order_equals_the_model(name):
    prep, packs = _split(name, 4)
    reference = copy.deepcopy(prep.model)
    # copies of the masters, so BatchNorm statistics the packs update stay out of the cached model
    masters = {n: t.detach().clone() for n, t in prep.masters.items()}
    env = dict(zip(prep.captured.inputs, prep.inputs))
    torch.manual_seed(11)
    with torch.no_grad():
        for pack in packs:
            outputs = pack.gm(*[env[n] for n in pack.act_inputs], *[masters[n] for n in pack.state_inputs])
            assert len(outputs) == len(pack.outputs)
            env.update(zip(pack.outputs, outputs))
        torch.manual_seed(11)
        expected = reference(*prep.inputs)
    (output_name,) = _model_outputs(prep)
    torch.testing.assert_close(env[output_name], expected, rtol=1e-5, atol=1e-6)
    by_target = {node.meta[meta.TARGET]: node.name for node in prep.captured.gm.graph.find_nodes(op="placeholder")
                 if node.name in prep.captured.buffers}
    for target, ref_buffer in reference.named_buffers():
        torch.testing.assert_close(masters[by_target[target]], ref_buffer, rtol=1e-5, atol=1e-7)


def test_skip_connection_across_packs_is_an_input_of_the_far_pack():
    prep, packs = _split("residual_mlp", 4)
    nodes = {node.name: node for node in prep.captured.gm.graph.nodes}
    # the stem's output: the last node of the first layer, used again by the head's `h + skip`
    skip = prep.layers[0].nodes[-1]
    assert any(path.endswith("stem") for path, _ in nodes[skip].meta["nn_module_stack"].values())
    producer = nodes[skip].meta[meta.PACK]
    consumers = sorted({user.meta[meta.PACK] for user in nodes[skip].users if meta.PACK in user.meta})
    far = consumers[-1]
    assert far - producer >= 2, "the skip does not span three packs; the test needs another split"
    assert skip in packs[producer].outputs
    assert skip in packs[far].act_inputs
    for pack in packs[producer + 1:far]:
        if pack.index not in consumers:
            assert skip not in pack.act_inputs  # it waits on the host in between
            assert skip not in pack.outputs


@pytest.mark.parametrize("num_packs", [1, 4])
def test_tied_parameters_are_one_master_per_pack(num_packs):
    prep, packs = _split("tiny_gpt", num_packs)
    wte = prep.model.wte.weight
    tied_names = [n for n, p in prep.captured.params.items() if p is wte]
    users = set()
    for pack in packs:
        state = list(pack.params + pack.buffers)
        masters = [prep.masters[n] for n in state]
        assert len({id(m) for m in masters}) == len(masters), f"{pack.name} fetches a master twice"
        assert sum(m is wte for m in masters) <= 1
        assert len(pack.state_slot) == len(pack.state_inputs)
        for placeholder, slot in zip(pack.state_inputs, pack.state_slot):
            assert masters[slot] is prep.masters[placeholder]
        if any(n in tied_names for n in pack.state_inputs):
            users.add(pack.index)
            assert sum(m is wte for m in masters) == 1
    # the embedding (first pack) and the head (last pack) both read the tied weight
    assert users == {0, len(packs) - 1}


def test_pack_flags_random_and_mutated_buffers():
    _, gpt_packs = _split("tiny_gpt", 4)
    assert any(pack.random for pack in gpt_packs)  # dropout
    assert all(not pack.mutated_buffers for pack in gpt_packs)  # the causal mask is only read
    _, mlp_packs = _split("mlp_chain", 4)
    assert not any(pack.random for pack in mlp_packs)
    prep, cnn_packs = _split("small_cnn", 4)
    mutated = [n for pack in cnn_packs for n in pack.mutated_buffers]
    by_name = {node.name: node.meta[meta.TARGET] for node in prep.captured.gm.graph.find_nodes(op="placeholder")
               if node.name in prep.captured.buffers}
    assert {by_name[n] for n in mutated} == {name for name, _ in prep.model.named_buffers()}
    # BatchNorm updates its statistics, but its training output never reads them: nothing to replay
    assert not any(pack.replayed_buffers for pack in cnn_packs)


def test_a_buffer_read_then_updated_is_replayed_by_the_recompute():
    """A step counter read by the output, then incremented under no_grad (spectral_norm's vectors
    alike): its value as the forward began is what the recompute must read."""
    from harmony_fx.compiler.variants import capture_variant
    from harmony_fx.testing.models import StepCounter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), StepCounter(8), torch.nn.BatchNorm1d(8))
    variant = capture_variant(model, None, (torch.randn(4, 8),), {}, torch.device("cpu"))
    masters = {**variant.captured.params, **variant.captured.buffers}
    (pack,) = split_packs(variant.captured.gm, variant.layers, [0], masters)
    targets = {node.name: node.meta.get(meta.TARGET) for node in variant.captured.gm.graph.find_nodes(op="placeholder")}
    assert {targets[n] for n in pack.replayed_buffers} == {"1.count"}
    assert {"1.count", "2.running_mean", "2.num_batches_tracked"} <= {targets[n] for n in pack.mutated_buffers}


@pytest.mark.parametrize("boundaries", [[], [1], [0, 0], [0, 3, 2], [0, 10_000]])
def test_bad_boundaries_are_refused(boundaries):
    prep = prepared("mlp_chain")
    with pytest.raises(ValueError, match="boundaries"):
        split_packs(prep.captured.gm, prep.layers, boundaries, prep.masters)


def test_a_cache_builds_each_layer_range_once_under_any_index():
    """A search over packings builds most packs many times: with a cache, a range of layers built
    for one packing is the same pack (its graph shared) under its index in the next."""
    prep = prepared("mlp_chain")
    cache: dict = {}
    first = split_packs(prep.captured.gm, prep.layers, [0, 2, 4], prep.masters, cache)
    second = split_packs(prep.captured.gm, prep.layers, [0, 1, 2, 4], prep.masters, cache)
    uncached = split_packs(prep.captured.gm, prep.layers, [0, 1, 2, 4], prep.masters)
    assert [pack.index for pack in second] == [0, 1, 2, 3]
    assert second[2].gm is first[1].gm and second[3].gm is first[2].gm and second[0].gm is not first[0].gm
    for cached, built in zip(second, uncached):
        assert (cached.layers, cached.act_inputs, cached.outputs, cached.params) == \
               (built.layers, built.act_inputs, built.outputs, built.params)
        assert cached.gm.code == built.gm.code
    assert set(cache) == {(0, 2), (2, 4), (4, len(prep.layers)), (0, 1), (1, 2)}


class _TargetWithoutGrad(torch.nn.Module):
    """A target computed under ``no_grad`` inside the forward: export makes it a higher-order op
    whose subgraph is a ``get_attr`` node, a layer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher, self.student, self.head = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        with torch.no_grad():
            target = torch.tanh(self.teacher(x))
        hidden = torch.relu(self.student(x))
        return self.head(hidden) + (hidden - target).square().mean()


def test_a_pack_cut_between_a_subgraph_and_its_op_copies_the_subgraph():
    """Every layer its own pack, so the ``get_attr`` of the ``no_grad`` region is in the pack before
    its op's: it was taken for a value crossing packs, which has none (a KeyError on 'val' at plan)."""
    torch.manual_seed(0)
    model = _TargetWithoutGrad()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    layers = len(harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=1).compiled.layers)
    hm = harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=1, pack_boundaries=tuple(range(layers)))
    subgraph = next(node for node in hm.captured.gm.graph.nodes if node.op == "get_attr")
    assert subgraph.meta[meta.LAYER] < min(user.meta[meta.LAYER] for user in subgraph.users)  # the cut tested
    assert all(subgraph.name not in pack.act_inputs + pack.outputs for pack in hm.packs)
    hm(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert_grads_equal(model, reference)
