"""Packs compiled by inductor (``compile_packs=True``): the same numbers as eager, dropout
replayed in recompute, identical packs compiled once."""
from __future__ import annotations

import copy

import pytest
import torch

import harmony_fx
from harmony_fx.models import GPTConfig, TinyGPT
from harmony_fx.runtime.inductor import structure_key


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores (which run has it: tests/tiers.py)
def test_compiled_packs_train_like_eager_with_dropout_and_compile_identical_blocks_once():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.2))
    reference = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    # one pack per block, so the recompute of every block must replay its dropout masks
    # layers: arange, the embeddings, add, dropout, h.0 .. h.3, the final norm, the head
    hm = harmony_fx.compile(model, x, devices=["host:0"], microbatches=1, compile_packs=True,
                            pack_boundaries=(0, 5, 6, 7, 8, 9))
    assert [pack.layer_names[0] for pack in hm.packs] == ["arange", "h.0", "h.1", "h.2", "h.3", "layer_norm_8"]
    torch.manual_seed(1)
    loss = _loss(hm(x), y)
    loss.backward()
    torch.manual_seed(1)
    reference_loss = _loss(reference(x), y)
    reference_loss.backward()
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    compiler = hm.session.pack_compiler
    keys = {structure_key(pack.gm) for pack in hm.packs}
    assert compiler.structures == len(keys) < len(hm.packs)  # the blocks share one compiled function
    stage = next(stage for stage in hm.passes if stage.name == "compile packs (inductor)")
    assert stage.seconds > 0 and f"{len(keys)} distinct pack structure(s)" in stage.decision


def test_packs_compile_without_dynamo_and_keep_their_graphs():
    """A pack's graph is ATen already: inductor compiles it directly (Dynamo traces no frame, so
    no guards run at every call), and the pack's graph and node metadata stay the passes' own."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    hm = harmony_fx.compile(model, x, devices=["host:0"], microbatches=1, compile_packs=True, track_memory=False,
                            pack_boundaries=(0, 5))

    def graphs():
        return [(pack.gm.code, [[(key, id(value)) for key, value in node.meta.items()] for node in pack.gm.graph.nodes])
                for pack in hm.packs]

    before = graphs()
    torch._dynamo.utils.counters.clear()
    for _ in range(2):
        _loss(hm(x), y).backward()
    assert not torch._dynamo.utils.counters["frames"]
    assert graphs() == before
    assert hm.session.pack_compiler.settled  # the second step compiled nothing new


def test_compiled_packs_refuse_per_tensor_tracking():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="track_memory=False"):
        harmony_fx.compile(model, torch.randn(2, 4), compile_packs=True, track_memory=True)


@pytest.mark.parametrize("name", [  # out of the default suite (18-120 s each, inductor's cache cold): tests/tiers.py
    # BatchNorm: inductor's fused backward differs from eager's by ~2%, so the match is to torch.compile
    pytest.param("small_cnn", marks=pytest.mark.slow),
    pytest.param("mlp_chain", marks=pytest.mark.slow),
    pytest.param("residual_mlp", marks=pytest.mark.slow),
    pytest.param("tiny_gpt", marks=pytest.mark.slow),
])
def test_compiled_packs_equal_torch_compile_of_the_whole_model(name):
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.testing.models import zoo

    entry = zoo()[name]
    model, inputs, target = entry.build(0)
    reference = torch.compile(copy.deepcopy(model))
    budget = int(0.25 * eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target)))
    hm = harmony_fx.compile(model, inputs, devices=["host:0"], memory_budget=budget, microbatches=1,
                            compile_packs=True, track_memory=False)
    assert len(hm.packs) > 3
    torch.manual_seed(0)
    loss = entry.loss_fn(hm(*inputs), target)
    loss.backward()
    torch.manual_seed(0)
    with torch._inductor.config.patch(fallback_random=True):  # dropout: eager's kernels in both
        reference_loss = entry.loss_fn(reference(*inputs), target)
    reference_loss.backward()
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=0)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5 * float(q.grad.abs().max()), msg=pname)


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores (which run has it: tests/tiers.py)
@pytest.mark.parametrize("parallel", ["dp", "pp"])
def test_compiled_packs_on_two_devices_whose_threads_share_them(parallel):
    """Two devices' controller threads call the same compiled functions (dp) or hand values to each
    other (pp), over two iterations."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0))
    reference = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    hm = harmony_fx.compile(model, x, devices=["host:0", "host:1"], parallel=parallel, microbatches=4,
                            compile_packs=True, pack_boundaries=(0, 5, 7, 9))
    try:
        for _ in range(2):
            model.zero_grad()
            reference.zero_grad()
            loss = _loss(hm(x), y)
            loss.backward()
            reference_loss = _loss(reference(x), y)
            reference_loss.backward()
            torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        hm.close()
