"""Models nobody here wrote: what they do that the zoo does not, each trained next to eager.

Random ops recognised by their schema (SDPA's dropout, ``gumbel_softmax``), values of any pytree
shape crossing packs (an LSTM's ``(output, (h, c))``, ``max_pool``'s indices), scalar inputs, inputs
that must not get gradients, in-place writes into activations, and ``compile(model)`` with nothing
else. Every model is cut into several packs (``pack_boundaries``) so each value really crosses.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.testing.models import StepCounter
from tests.helpers import LSTMStack, assert_grads_equal

RTOL, ATOL = 1e-5, 1e-6


def _step_both(model: nn.Module, inputs: tuple, loss_of, seed: int = 3, **options):
    """One training step through harmony_fx and one in eager on a copy; returns both models and
    both input tuples after ``backward``."""
    reference = copy.deepcopy(model)
    ref_inputs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
    hm = harmony_fx.compile(model, inputs, **options)
    torch.manual_seed(seed)
    loss = loss_of(hm(*inputs))
    loss.backward()
    torch.manual_seed(seed)
    ref_loss = loss_of(reference(*ref_inputs))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    return hm, model, reference, inputs, ref_inputs


def _pytree_inputs(hm) -> list[str]:
    """The pack inputs whose value is a tuple or list (not one tensor)."""
    nodes = {node.name: node for node in hm.captured.gm.graph.nodes}
    return [name for pack in hm.packs for name in pack.act_inputs if isinstance(nodes[name].meta["val"], (tuple, list))]


class _Attention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2, dropout: float = 0.3) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))


class _Stack(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_sdpa_dropout_replays_in_recompute():
    torch.manual_seed(0)
    model = _Stack(*[_Attention() for _ in range(4)])
    x = torch.randn(2, 8, 16, requires_grad=True)
    hm, model, reference, inputs, ref_inputs = _step_both(
        model, (x,), lambda out: out.pow(2).sum(), pack_boundaries=(0, 1, 2, 3), microbatches=1)
    assert len(hm.packs) == 4 and all(pack.random for pack in hm.packs)
    assert_grads_equal(model, reference, rtol=0, atol=1e-6, inputs=inputs, ref_inputs=ref_inputs)


def test_gumbel_softmax_replays_in_recompute():
    class Gumbel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return F.gumbel_softmax(self.linear(x), tau=0.5)

    torch.manual_seed(0)
    hm, model, reference, *_ = _step_both(_Stack(Gumbel(), Gumbel(), Gumbel()), (torch.randn(4, 8),),
                                          lambda out: (out * out.detach()).sum(),
                                          pack_boundaries=(0, 1, 2), microbatches=1)
    assert all(pack.random for pack in hm.packs)
    assert_grads_equal(model, reference, RTOL, ATOL)


def test_lstm_stack_in_three_packs_trains_like_eager():
    torch.manual_seed(0)
    model = LSTMStack()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 5, 8)
    hm = harmony_fx.compile(model, (x,), pack_boundaries=(0, 1, 2), microbatches=1)
    assert len(hm.packs) == 3
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for _ in range(3):
        out, (h, c) = hm(x)
        ref_out, (ref_h, ref_c) = reference(x)
        for got, want in ((out, ref_out), (h, ref_h), (c, ref_c)):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        (out.sum() + h.pow(2).sum() + c.sum()).backward()
        (ref_out.sum() + ref_h.pow(2).sum() + ref_c.sum()).backward()
        assert_grads_equal(model, reference, RTOL, ATOL)
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    assert hm.stats.as_dict()["bytes_by_kind"] == hm.plan.predicted_bytes


def test_multihead_attention_stack_in_three_packs_trains_like_eager():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(16, 4, batch_first=True)
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            attended, weights = self.attention(x, x, x)
            return self.norm(x + attended) * weights.mean()

    torch.manual_seed(0)
    x = torch.randn(3, 6, 16, requires_grad=True)
    hm, model, reference, inputs, ref_inputs = _step_both(
        _Stack(Block(), Block(), Block()), (x,), lambda out: out.pow(2).sum(), pack_boundaries=(0, 1, 2),
        microbatches=1)
    assert len(hm.packs) == 3
    assert_grads_equal(model, reference, RTOL, ATOL, inputs=inputs, ref_inputs=ref_inputs)


def test_a_tuple_crossing_a_pack_is_moved_and_counted_per_tensor():
    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool = nn.AdaptiveMaxPool1d(4, return_indices=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            pooled, indices = self.pool(x)
            return self.head(pooled) + indices.float().mean()

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, requires_grad=True)
    hm, model, reference, inputs, ref_inputs = _step_both(Pool(), (x,), lambda out: out.pow(2).sum(),
                                                          pack_boundaries=(0, 1), microbatches=1)
    assert _pytree_inputs(hm), "the pooling's (values, indices) should cross into the second pack"
    assert_grads_equal(model, reference, RTOL, ATOL, inputs=inputs, ref_inputs=ref_inputs)
    assert hm.stats.as_dict()["bytes_by_kind"] == hm.plan.predicted_bytes


class _Contrastive(nn.Module):
    """CLIP's loss: each sample's text scored against every sample's image, so a sample's loss
    depends on the whole batch and a microbatch's is another loss."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.image = nn.Linear(8, 8), nn.Linear(12, 8)

    def forward(self, text, image):
        logits = self.text(text) @ self.image(image).t()
        labels = torch.arange(text.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def test_a_contrastive_loss_keeps_its_batch_whole_and_a_batch_cut_by_hand_warns():
    torch.manual_seed(0)
    text, image = torch.randn(6, 8), torch.randn(6, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm, model, reference, *_ = _step_both(_Contrastive(), (text, image), lambda loss: loss)
    assert hm.num_microbatches == 1 and not [w for w in caught if "harmony_fx" in str(w.message)]
    assert_grads_equal(model, reference, RTOL, ATOL)
    with pytest.warns(UserWarning, match=r"microbatches=2 cuts the batch.*batched along different dims"):
        hm = harmony_fx.compile(_Contrastive(), (text, image), microbatches=2)
    assert "batch: cut into 2 microbatches as microbatches= asks" in hm.explain()


def test_a_scalar_input_is_shared_by_every_microbatch():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

        def forward(self, x, scale):
            return self.layers(x) * scale

    torch.manual_seed(0)
    x, scale = torch.randn(6, 4), torch.tensor(1.5, requires_grad=True)
    hm, model, reference, inputs, ref_inputs = _step_both(Scaled(), (x, scale), lambda out: out.pow(2).mean(),
                                                          microbatches=3)
    assert hm.mb_sizes == [2, 2, 2]
    assert_grads_equal(model, reference, RTOL, ATOL, inputs=inputs, ref_inputs=ref_inputs)


def test_an_input_an_op_cannot_differentiate_gets_no_gradient_as_in_eager():
    """``soft_margin_loss`` is not differentiable for its target: eager never asks, nor may we."""

    class Margin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, target):
            return F.soft_margin_loss(self.second(self.first(x)), target * 2)

    torch.manual_seed(0)
    x, target = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4).sign()
    hm, model, reference, inputs, ref_inputs = _step_both(Margin(), (x, target), lambda out: out,
                                                          pack_boundaries=(0, 1), microbatches=1)
    assert_grads_equal(model, reference, RTOL, ATOL, inputs=inputs, ref_inputs=ref_inputs)
    assert target.grad is None


def test_an_in_place_write_into_an_activation_stays_in_the_pack_that_made_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Hardtanh(inplace=True),
                          nn.Linear(8, 2))
    x = torch.randn(4, 8, requires_grad=True)
    hm = harmony_fx.compile(copy.deepcopy(model), (x,), microbatches=1)
    layers = [layer.name for layer in hm.compiled.layers]
    assert "0+1" in layers and "2+3" in layers, layers  # each in-place op joined its producer's layer
    hm, model, reference, inputs, ref_inputs = _step_both(model, (x,), lambda out: out.pow(2).sum(),
                                                          pack_boundaries=(0, 1, 2), microbatches=1)
    assert_grads_equal(model, reference, RTOL, ATOL, inputs=inputs, ref_inputs=ref_inputs)


class _WritesThroughDropout(nn.Module):
    """``nn.Dropout(0.0)`` hands back its input itself: adding into its result in place writes that
    input, which a pack boundary between them made a leaf (autograd refused the write)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        h = self.first(x)
        v = self.second(h) * 2
        w = self.drop(v)
        w += h
        return self.third(v).mean() + w.mean()


class _ClampsUnderNoGrad(nn.Module):
    """An activation clamped in place inside ``torch.no_grad()`` (a region of its own in the graph),
    then passed through an in-place ReLU: a pack boundary between its producer and the region made
    it a leaf, which autograd refused to write."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(12))
        self.linear = nn.Linear(12, 16)

    def forward(self, x):
        scaled = x * self.scale
        h = self.linear(scaled)
        with torch.no_grad():
            h.clamp_(-2.0, 2.0)
        return torch.relu_(h).square().sum() + (x + scaled).square().sum()


def test_a_write_inside_no_grad_stays_in_one_pack_with_what_it_writes():
    x = torch.randn(6, 12, requires_grad=True)
    try:
        harmony_fx.compile(_ClampsUnderNoGrad(), (x,), memory_budget=1, devices=["host:0"], microbatches=2)
    except harmony_fx.BudgetTooSmallError as error:
        smallest = error.smallest_budget
    torch.manual_seed(0)
    hm, model, reference, inputs, ref_inputs = _step_both(_ClampsUnderNoGrad(), (x,), lambda out: out,
                                                          memory_budget=smallest, devices=["host:0"], microbatches=2)
    assert_grads_equal(model, reference, RTOL, ATOL, inputs=inputs, ref_inputs=ref_inputs)


def test_a_write_into_what_dropout_handed_back_stays_in_one_pack_with_its_input():
    x = torch.randn(4, 8, requires_grad=True)
    try:
        harmony_fx.compile(_WritesThroughDropout(), (x,), memory_budget=1, devices=["host:0"])
    except harmony_fx.BudgetTooSmallError as error:
        smallest = error.smallest_budget
    torch.manual_seed(0)
    hm, model, reference, inputs, ref_inputs = _step_both(_WritesThroughDropout(), (x,), lambda out: out,
                                                          memory_budget=smallest, devices=["host:0"])
    assert len(hm.packs) >= 3
    assert_grads_equal(model, reference, RTOL, ATOL, inputs=inputs, ref_inputs=ref_inputs)


class _WritesASlice(nn.Module):
    """A layer's output written into a slice of a tensor made without grad (``torch.zeros``): the
    tensor requires grad from the write on, so the next pack must take it as differentiable."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        buffer = torch.zeros(x.shape[0], 32)
        buffer[:, 8:24] = self.first(x)
        return self.second(buffer[:, 4:20])


def test_a_layer_written_into_a_slice_of_zeros_gets_its_gradients_across_packs():
    """The pack after the write took the written tensor as a leaf without grad: the first layer's
    gradients and the input's were None."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    hm, model, reference, inputs, ref_inputs = _step_both(_WritesASlice(), (x,), lambda out: out.square().sum(),
                                                          pack_boundaries=(0, 1, 2), microbatches=2)
    assert len(hm.packs) == 3
    assert_grads_equal(model, reference, RTOL, ATOL, inputs=inputs, ref_inputs=ref_inputs)


def test_compile_without_example_inputs_plans_on_the_first_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model)
    with pytest.raises(AttributeError, match="exists after the first call"):
        hm.plan
    with pytest.raises(AttributeError, match="exists after the first call"):
        hm.code
    x = torch.randn(4, 8)
    hm(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(model, reference, RTOL, ATOL)
    assert hm.plan.packs and "def forward" in hm.code
    # a new batch size is planned on its own first call, like torch.compile's recompile
    y = torch.randn(6, 8)
    torch.testing.assert_close(hm(y), reference(y), rtol=RTOL, atol=ATOL)


def test_the_readme_example_without_example_inputs(memory_witness):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)], nn.Linear(32, 10))
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    hm = harmony_fx.compile(model, memory_budget="24KiB")
    F.cross_entropy(hm(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    assert len(hm.packs) > 1
    assert_grads_equal(model, reference, RTOL, ATOL)
    assert memory_witness.peak_of(hm.devices[0]) == hm.stats.peak_bytes[hm.devices[0].name] <= 24 * 1024


def _spectral_norm_net(parametrization: bool) -> nn.Module:
    """Linear layers under spectral_norm: its forward reads the power iteration's vectors (buffers),
    updates them in place, then divides the weight by the sigma they give."""
    norm = nn.utils.parametrizations.spectral_norm if parametrization else nn.utils.spectral_norm
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), norm(nn.Linear(16, 16)), nn.Tanh(), norm(nn.Linear(16, 16)),
                         nn.Tanh(), nn.Linear(16, 2))


@pytest.mark.parametrize("microbatches", [1, None])
@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), StepCounter(8), nn.Linear(8, 2)),
    lambda: _spectral_norm_net(parametrization=False),
    lambda: _spectral_norm_net(parametrization=True),
], ids=["step-counter", "spectral-norm", "spectral-norm-parametrization"])
def test_a_buffer_read_then_updated_trains_like_eager(build, microbatches):
    """The recompute read the buffer as the forward left it (spectral_norm: one power iteration
    more; gradients 23-26% off, a counter's exactly doubled), and the planner cut the batch, each
    microbatch updating the buffer again. At the smallest budget (a pack per layer), the loss,
    every gradient and every buffer equal eager's."""
    x = torch.randn(6, 8)
    try:
        harmony_fx.compile(build(), (x,), memory_budget=1, devices=["host:0"], microbatches=microbatches)
    except harmony_fx.BudgetTooSmallError as error:
        smallest = error.smallest_budget
    hm, model, reference, _, _ = _step_both(build(), (x,), lambda out: out.square().mean(), memory_budget=smallest,
                                            devices=["host:0"], microbatches=microbatches)
    assert len(hm.packs) >= 3 and hm.num_microbatches == 1
    assert any(pack.replayed_buffers for pack in hm.packs)
    assert_grads_equal(model, reference, RTOL, ATOL)
    for (name, buffer), ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buffer, ref, msg=lambda m: f"{name}: {m}")


class _RunningStatistic(nn.Module):
    """A buffer updated through a view (``self.stats[0] += ...``, as a queue's slice is), then read
    by a later layer: the write and the read were cut into different packs, each on its own copy of
    the buffer, so the update was lost and the later layer read the stale value."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("stats", torch.zeros(2, 16))

    def forward(self, x):
        h = self.first(x)
        self.stats[0] += h.detach().mean(0)
        return self.third(self.second(h) + self.stats[0])


class _RunningStatisticWithoutGrad(_RunningStatistic):
    """The same update under ``torch.no_grad()``: export puts it in a region of its own."""

    def forward(self, x):
        h = self.first(x)
        with torch.no_grad():
            self.stats[0] += h.mean(0)
        return self.third(self.second(h) + self.stats[0])


@pytest.mark.parametrize("build", [_RunningStatistic, _RunningStatisticWithoutGrad], ids=["grad", "no_grad"])
def test_a_buffer_updated_through_a_view_and_read_later_trains_like_eager(build):
    x = torch.randn(8, 16)
    try:  # track_memory: each pack computes on device copies of its weights, as on a GPU
        harmony_fx.compile(build(), (x,), memory_budget=1, devices=["host:0"], microbatches=1, track_memory=True)
    except harmony_fx.BudgetTooSmallError as error:
        smallest = error.smallest_budget
    torch.manual_seed(0)
    hm, model, reference, _, _ = _step_both(build(), (x,), lambda out: out.square().mean(),
                                            memory_budget=smallest, devices=["host:0"], microbatches=1,
                                            track_memory=True)
    assert len(hm.packs) >= 3 and [pack.mutated_buffers for pack in hm.packs].count(("b_stats",)) == 1
    assert_grads_equal(model, reference, RTOL, ATOL)
    torch.testing.assert_close(model.stats, reference.stats)


@pytest.mark.parametrize("parallel", ["auto", "pp"])
def test_over_two_devices_a_model_that_updates_a_buffer_runs_whole_in_a_pipeline(parallel):
    """The options' own layout gave each device a microbatch, each updating the counter in turn
    (its gradients doubled, the count 2 for one step)."""
    x = torch.randn(6, 8)
    hm, model, reference, _, _ = _step_both(nn.Sequential(nn.Linear(8, 8), StepCounter(8), nn.Linear(8, 2)), (x,),
                                            lambda out: out.square().mean(), devices=["host:0", "host:1"],
                                            parallel=parallel)
    assert hm.num_microbatches == 1
    assert_grads_equal(model, reference, RTOL, ATOL)
    assert model[1].count.item() == reference[1].count.item() == 2.0


def test_a_batch_cut_by_hand_in_a_model_that_updates_a_buffer_warns():
    model = nn.Sequential(nn.Linear(8, 8), StepCounter(8), nn.Linear(8, 2))
    with pytest.warns(UserWarning, match="updates a buffer in place .*microbatches=1"):
        harmony_fx.compile(model, (torch.randn(6, 8),), devices=["host:0"], microbatches=2)
