"""analyze_batch_dims: the batch is cut only where every op treats the samples apart, and the
planner keeps a batch whole otherwise; outputs batched along another dim are joined along it."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.analysis.batch_dims import analyze_batch_dims
from harmony_fx.frontend.capture import capture
from harmony_fx.testing.models import zoo


class _Fn(nn.Module):
    def __init__(self, fn, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.linear(x), self)


def _analysis(model: nn.Module, *inputs: torch.Tensor, dims=None):
    captured = capture(model, inputs)
    dims = dims or [0] * len(inputs)
    return analyze_batch_dims(captured.gm, dict(zip(captured.inputs, dims)), inputs[0].shape[dims[0]])


@pytest.mark.parametrize("name,separable", [("mlp_chain", True), ("residual_mlp", True), ("tiny_gpt", True),
                                            ("small_cnn", False)])
def test_zoo(name, separable):
    model, inputs, _ = zoo(batch=4)[name].build(0)
    analysis = _analysis(model, *inputs)
    assert analysis.separable is separable, analysis.reason
    if not separable:  # named as a person reads it: the op and its module, not fx's node syntax
        assert analysis.reason.startswith("batch_norm: aten.batch_norm in module features.0.1 (a BatchNorm2d) ")
        assert "BatchNorm in training" in analysis.reason and "%" not in analysis.reason


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_hugging_face_models_are_separable(name):
    """Their masks pick each sample's row with arange(batch): an index that keeps samples apart."""
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    batch = hf_batch(name, batch=4, seq=16)
    captured = capture(build_hf_model(name), (), batch)
    analysis = analyze_batch_dims(captured.gm, {name: 0 for name in captured.inputs}, 4)
    assert analysis.separable, analysis.reason
    assert set(analysis.output_dims.values()) == {None, 0}  # the loss, and the logits along dim 0


def _tiny_bart():
    import transformers

    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(config).train()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoders_shifting_their_labels_in_place_are_separable(name):
    """T5 and BART make the decoder's inputs by writing the labels, in place, into views of a
    fresh ``labels.new_zeros(...)``: the buffer holds each sample's own labels."""
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    batch = hf_batch("t5", batch=4, seq=16)  # BART takes the same source and (shorter) target
    captured = capture(_tiny_bart() if name == "bart" else build_hf_model("t5", num_layers=1), (), batch)
    analysis = analyze_batch_dims(captured.gm, {name: 0 for name in captured.inputs}, 4)
    assert analysis.separable, analysis.reason
    assert set(analysis.output_dims.values()) == {None, 0}


class _ShiftRight(nn.Module):
    """What T5's ``_shift_right`` and BART's ``shift_tokens_right`` do, then a loss per token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        shifted[..., 0] = 2
        shifted.masked_fill_(shifted == -100, 0)
        logits = self.head(self.embed(ids) + self.embed(shifted))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_labels_shifted_in_place_into_a_fresh_buffer_are_cut_as_eager():
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 16, (6, 5)), torch.randint(0, 16, (6, 5))
    labels[:3, 3:] = -100  # the first microbatch holds fewer labelled tokens
    model = _ShiftRight()
    reference = copy.deepcopy(model)
    analysis = _analysis(model, ids, labels)
    assert analysis.separable, analysis.reason
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = harmony_fx.compile(model, (ids, labels), microbatches=2)
    assert hm.num_microbatches == 2 and not [w for w in caught if "harmony_fx" in str(w.message)]
    loss, want = hm(ids, labels), reference(ids, labels)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6)


def _into_a_buffer_of_twice_the_batch(h, m):
    buffer = h.new_zeros(2 * h.shape[0], h.shape[1])
    buffer[:h.shape[0]] = h  # microbatches would leave their zeros between the samples
    return buffer


def _across_samples(h, m):
    buffer = h.new_zeros(h.shape)
    buffer[:3] = h[3:]
    return buffer


def _into_a_shared_buffer_varying_along_the_batch(h, m):
    buffer = torch.arange(6.0)[:, None].repeat(1, 4)
    buffer[:, 1:] = h[:, 1:]  # column 0 is each row's index in the whole batch
    return buffer


def _into_a_buffer_made_varying_in_place(h, m):
    buffer = torch.zeros(6, 4)
    buffer[0] = 1.0  # a shared write: the first row of the whole batch, not of each microbatch
    return h + buffer


def _reduced_over_the_batch_it_was_written(h, m):
    buffer = h.new_zeros(h.shape)
    buffer[:, 1:] = h[:, 1:]  # the buffer now holds the batch: its mean over dim 0 mixes samples
    return h + buffer.mean(0)


@pytest.mark.parametrize("fn,why", [
    (_reduced_over_the_batch_it_was_written, "reduces along the batch dim"),
    (_into_a_buffer_of_twice_the_batch, "holds only some of its entries along the batch dim"),
    (_across_samples, "picks some samples"),
    (_into_a_shared_buffer_varying_along_the_batch, "varies along the batch dim"),
    (_into_a_buffer_made_varying_in_place, "varies along the batch dim"),
])
def test_writes_in_place_that_mix_samples_are_found(fn, why):
    analysis = _analysis(_Fn(fn), torch.randn(6, 4))
    assert not analysis.separable
    assert why in analysis.reason


@pytest.mark.parametrize("fn,why", [
    (lambda h, m: F.softmax(h, dim=0), "acts along the batch dim"),
    (lambda h, m: F.glu(torch.cat([h, h], 0), dim=0), "joins along the batch dim"),
    (lambda h, m: h - h.mean(0), "reduces along the batch dim"),
    (lambda h, m: h[1:], "picks some samples"),
    (lambda h, m: h + torch.arange(h.shape[0])[:, None], "varies along the batch dim"),
    (lambda h, m: h.t() @ h, "contracts the batch dim"),
    (lambda h, m: torch.einsum("bi,bj->ij", h, h), "sums over the batch dim"),
    (lambda h, m: h + torch.arange(6.0)[:, None].expand(6, 4).cumsum(0), "varies along the batch dim"),
    (lambda h, m: h + torch.arange(6.0)[:, None].repeat(1, 4), "varies along the batch dim"),
    (lambda h, m: torch.gather(torch.arange(6.0)[:, None].expand(6, 8), 1, (h > 0).long()), "varies along the batch"),
    (lambda h, m: torch.fft.fftn(h).real, "acts along the batch dim"),
    (lambda h, m: F.pad(h, (0, 0, 1, 0)), "pads along the batch dim"),
    (lambda h, m: h.repeat(2, 1), "holds the batch interleaved"),
    (lambda h, m: (h.reshape(12, 2) + torch.arange(4.0)[:, None].repeat(3, 1)).reshape(6, 4),
     "varies along the batch dim"),  # 3 copies of a block of 4 rows: not one per sample
    (lambda h, m: h.repeat_interleave(2, dim=0), "acts along the batch dim"),
    (lambda h, m: torch.zeros(6, 4).scatter(0, (h > 0).long(), h), "scatters along the batch dim"),
    (lambda h, m: h + torch.floor_divide(torch.arange(6)[:, None], 1), "varies along the batch dim"),
    (lambda h, m: h.roll(1, 0) + h.flip(0), "acts along the batch dim"),
    (lambda h, m: h + torch.roll(h, 1), "acts along the batch dim"),  # no dims: over the flattened tensor
    (lambda h, m: h + F.embedding((h > 0).long(), torch.ones(2, 4), scale_grad_by_freq=True).sum(1),
     "scale_grad_by_freq"),  # counts of the whole batch's indices
    # the batch reversed: as many rows as samples, but each another sample's
    (lambda h, m: torch.index_select(h, 0, torch.arange(5, -1, -1)), "by an index other than each sample's own"),
    # rules that get an op's rank wrong: a product by a vector drops a's last dim (not its first),
    # kthvalue without keepdim drops the dim it acts along (the batch, at dim 1, moves to 0)
    (lambda h, m: F.softmax(h.view(6, 2, 2) @ torch.ones(2), dim=0), "acts along the batch dim"),
    (lambda h, m: F.softmax(torch.kthvalue(h.view(6, 2, 2).transpose(0, 1), 1, dim=0).values, dim=0),
     "acts along the batch dim"),
    # a per-sample value through addmm's bias; channels shuffled where the batch is the channel dim
    (lambda h, m: h * torch.addmm(torch.arange(6.0)[:, None].expand(6, 4), torch.ones(6, 3), torch.ones(3, 4)),
     "varies along the batch dim"),
    (lambda h, m: F.channel_shuffle(h.view(6, 4, 1, 1).transpose(0, 1), 2).transpose(0, 1).reshape(6, 4),
     "is batched along another dim than its first"),
    # made of ops that act along the batch: a similarity over it
    (lambda h, m: F.cosine_similarity(h, h, dim=0)[None] + h, "mixes the samples in the ops it is made of"),
    # bags of two samples each: a microbatch would bag other rows together
    (lambda h, m: F.embedding_bag((h > 0).long().flatten(), torch.ones(2, 4), torch.arange(0, 24, 8)).repeat(2, 1),
     "offsets other than one bag per sample"),
    # positions the values pick (a mixture of experts' torch.where(expert_mask[i])): said, not a Python error
    (lambda h, m: h[torch.where(h > 0)[0][:1]].sum() + h, "lists entries the batch's values pick"),
    # an unbatched input's dim 0 is its channels; random samples shared whole by every sample
    (lambda h, m: F.max_pool1d(h, 2).repeat(1, 2), "takes its input as unbatched"),
    (lambda h, m: F.fractional_max_pool2d(h.view(6, 1, 2, 2), 1, output_size=1,
                                          _random_samples=torch.arange(12.0).view(6, 1, 2) / 12).view(6, 1) + h,
     "per sample, which is not batched as its input is"),
    # each sample normalised apart, but the running statistics take the batch's mean (once a step)
    (lambda h, m: F.instance_norm(h.view(6, 2, 2), torch.zeros(2), torch.ones(2), use_input_stats=True).view(6, 4),
     "InstanceNorm with track_running_stats"),
    # a query shared whole that differs along the batch dim: a microbatch would take another's rows
    (lambda h, m: F.scaled_dot_product_attention(torch.arange(48.0).view(6, 2, 4) / 48, h.view(6, 1, 4),
                                                 h.view(6, 1, 4)).sum(1), "varies along the batch dim"),
    # windows of two samples each (Tensor.unfold along the batch)
    (lambda h, m: h.unfold(0, 2, 2).sum(-1).repeat(2, 1), "cuts windows along the batch dim"),
])
def test_ops_that_mix_samples_are_found(fn, why):
    analysis = _analysis(_Fn(fn), torch.randn(6, 4))
    assert not analysis.separable
    assert why in analysis.reason


@pytest.mark.parametrize("fn", [
    lambda h, m: F.softmax(h, dim=1) + torch.zeros(6, 4),
    lambda h, m: h.view(6, 2, 2).transpose(1, 2).reshape(6, 4),       # the batch stays outermost
    lambda h, m: (h.unsqueeze(1) @ h.unsqueeze(2)).squeeze(),          # per-sample dot products
    lambda h, m: h[torch.arange(6), (h > 0).sum(1) % 4],               # each sample's own entry
    lambda h, m: h + torch.ones(1, 4).expand(6, 4),                    # constant along the batch
    # shared values the same for every sample, as Hugging Face's mask helpers build them: positions
    # expanded to the batch, looked up per sample, counted along the sequence, tiled, joined, viewed
    lambda h, m: h + torch.arange(4).expand(6, 4)[torch.arange(6)[:, None], torch.arange(4)[None, :]],
    lambda h, m: h + torch.arange(4.0).expand(6, 4).cumsum(1) + torch.arange(5.0).expand(6, 5).diff(dim=1),
    lambda h, m: h + torch.arange(4)[None].repeat(6, 1),
    lambda h, m: h + torch.cat([torch.arange(2).expand(6, 2), torch.zeros(6, 2)], 1),
    lambda h, m: h + torch.arange(4).expand(6, 4).reshape(6, 1, 4).squeeze(1),
    lambda h, m: h + torch.arange(4)[:, None].expand(4, 6).t(),
    lambda h, m: h + torch.einsum("bi,ij->bj", torch.arange(4.0).expand(6, 4), torch.eye(4)),
    lambda h, m: h + torch.arange(4).expand(6, 4).type_as(h[None]),  # h gives a dtype, not values
    lambda h, m: h.type_as(h.t()),
    # ops on the batched values along other dims
    lambda h, m: torch.einsum("bi,ij->bj", h, m.linear.weight),
    lambda h, m: torch.gather(torch.arange(8.0).expand(6, 8), 1, (h > 0).long()),
    lambda h, m: torch.fft.fft(h, dim=1).real + torch.view_as_real(torch.fft.rfft(h, dim=1)).sum(-1).sum(-1, True),
    lambda h, m: F.pad(h, (1, 1, 0, 0)),
    lambda h, m: h.repeat(1, 2) + h.repeat_interleave(2, dim=1),
    # ALiBi: a bias per head tiled to [batch * heads], the same for every sample's block of rows
    lambda h, m: (h.reshape(12, 2) + torch.arange(2.0)[:, None].repeat(6, 1)).reshape(6, 4),
    # Llama 4's experts: every token once per expert, scaled by its score for that expert
    lambda h, m: (h.repeat(4, 1) * h.t().reshape(-1, 1)).view(4, 6, 4).sum(0),
    lambda h, m: torch.full_like(h, -1.0).scatter_(1, h.topk(2, 1).indices, h.topk(2, 1).values),  # a router's
    # ops on every entry apart that have no pointwise tag; a mask over the last two dims
    lambda h, m: h + torch.floor_divide(torch.arange(4).expand(6, 4), 2) + torch.remainder(h, 2) + torch.rsub(h, 1),
    lambda h, m: h + torch.ones(4, 4).triu().expand(6, 4, 4).sum(1) + h[:, None, :].expand(6, 4, 4).tril().sum(1),
    # each broadcast to the shape of both, as mse_loss does with its input and target
    lambda h, m: sum(torch.broadcast_tensors(h[:, :1], torch.arange(4.0)))
    + F.mse_loss(h[:, :1], h, reduction="none"),
    lambda h, m: h.roll(1, 1) + h.flip(-1) + F.logsigmoid(h),  # dims named ``dims``; DPO's log-sigmoid
    # per sample: one_hot, bucketize, a matrix op per sample's matrix, F.unfold / F.fold, affine_grid
    lambda h, m: h + F.one_hot((h > 0).long().sum(1) % 4, 4) + torch.bucketize(h, torch.tensor([0.0]))
    + torch.linalg.det(h.view(6, 2, 2) @ h.view(6, 2, 2).transpose(1, 2) + torch.eye(2))[:, None],
    lambda h, m: h + F.fold(F.unfold(h.view(6, 1, 2, 2), 1), (2, 2), 1).view(6, 4)
    + F.affine_grid(h[:, :3].repeat(1, 2).view(6, 2, 3), [6, 1, 2, 2], align_corners=False).sum((1, 2, 3))[:, None],
    # an RNN's initial state: zeros at the batch size through a layer, the same for every sample
    lambda h, m: h + m.linear(torch.zeros(6, 4)) + torch.addmm(torch.ones(4), torch.zeros(6, 4), torch.eye(4)),
    # views that change their input's shape in place (functorch's batching rules make them too)
    lambda h, m: h.unsqueeze(1).squeeze_(1).t_().t_() + h.unsqueeze(0).transpose_(0, 1).squeeze_(1),
    # F.normalize: x / norm.clamp_min(eps).expand_as(x)
    lambda h, m: F.normalize(h, dim=-1),
    # multiple choice: [B, C] flattened to [B * C], each row picked by arange(B * C), the identity
    lambda h, m: h + h.reshape(12, 2)[torch.arange(12), torch.zeros(12, dtype=torch.long)].reshape(6, 2).repeat(1, 2),
    # each sample's own row by arange(B); a vector's t() is itself; a product by a vector; pixel_shuffle per image
    lambda h, m: torch.index_select(h, 0, torch.arange(6)) + h.sum(1).t()[:, None] + (h @ torch.ones(4))[:, None],
    lambda h, m: F.pixel_shuffle(h.view(6, 4, 1, 1), 2).reshape(6, 4) + torch.kthvalue(h, 2, dim=1).values[:, None],
    # ops torch defines by others (kept whole by export), read as the ops they are made of
    lambda h, m: F.cosine_similarity(h, h.flip(1), dim=1)[:, None] + F.pairwise_distance(h, 2 * h)[:, None]
    + torch.take_along_dim(h, (h > 0).long(), dim=1) + torch.tensordot(h, torch.ones(4, 4), dims=1),
    # torch.max(a, b), entrywise (max.other), not the reduction its name has a rule for
    lambda h, m: torch.max(h, torch.zeros(4)) + torch.min(h, h.flip(1)),
    # attention scores as q @ k.mT; ravel and reshape_as
    lambda h, m: (h.view(6, 2, 2) @ h.view(6, 2, 2).mT).reshape(6, 4) + h.ravel().reshape_as(h),
    # learned queries every sample shares (BLIP-2's Q-former: a parameter expanded to the batch) attending
    # over each sample's keys and values: the batch was kept whole
    lambda h, m: F.scaled_dot_product_attention(torch.arange(8.0).view(1, 2, 4).expand(6, 2, 4) / 8,
                                                h.view(6, 1, 4).repeat(1, 3, 1), h.view(6, 1, 4).repeat(1, 3, 1)
                                                ).sum(1),
    # patches of each sample (Tensor.unfold along its other dims: a ViT's patchify, a signal's frames)
    lambda h, m: h.unfold(1, 2, 2).sum(-1).repeat(1, 2) + h.view(6, 2, 2).unfold(2, 1, 1).reshape(6, 4),
])
def test_ops_that_keep_samples_apart_are_separable(fn):
    analysis = _analysis(_Fn(fn), torch.randn(6, 4))
    assert analysis.separable, analysis.reason


def test_a_batch_index_is_named_so_a_larger_forward_microbatch_is_not_cut_apart():
    # separable (every microbatch computes its own arange), but arange(6)'s second half is 3, 4, 5:
    # cut out of a forward microbatch's stash it would index past a backward microbatch of 3
    analysis = _analysis(_Fn(lambda h, m: h[torch.arange(6), (h > 0).sum(1) % 4]), torch.randn(6, 4))
    assert analysis.separable and len(analysis.batch_indices) == 1
    assert _analysis(_Fn(lambda h, m: h * 2), torch.randn(6, 4)).batch_indices == ()


@pytest.mark.parametrize("fn", [
    lambda h, m: h.pow(2).mean() + h.abs().mean(),
    lambda h, m: (h[:, :2].pow(2).mean() - 0.5 * h[:, 2:].sum() / h.shape[0]) * 3,
    lambda h, m: h.pow(2).mean() + 0.01 * m.linear.weight.pow(2).sum(),
], ids=["sum-of-means", "scaled-difference", "mean-plus-penalty"])
def test_a_linear_combination_of_batch_means_is_separable(fn):
    """A loss that adds means (and sums) of the batch is put back together from microbatches, each
    weighted by its share: the samples stay apart, so the forward may run larger microbatches than
    the backward. ``reductions.scalar_reduction`` decides it, for this analysis and the runtime."""
    analysis = _analysis(_Fn(fn), torch.randn(6, 4))
    assert analysis.separable, analysis.reason
    assert list(analysis.output_dims.values()) == [None]  # a number for the whole batch


@pytest.mark.parametrize("fn,why", [
    (lambda h, m: h.pow(2).sum() + h.abs().mean(), "weigh differently"),
    (lambda h, m: h.mean() * h.sum(), "made by"),
    (lambda h, m: h * h.mean(), "computes with a loss reduced over the whole batch"),
], ids=["sum-plus-mean", "product", "mean-meets-the-samples"])
def test_a_loss_that_cannot_be_put_back_together_is_not_separable(fn, why):
    analysis = _analysis(_Fn(fn), torch.randn(6, 4))
    assert not analysis.separable
    assert why in analysis.reason


def test_a_reshape_that_cuts_the_batch_across_dims_is_not_separable():
    # [6, 4] -> [2, 3, 4]: each sample's index is split over two dims, which one batch dim cannot say
    analysis = _analysis(_Fn(lambda h, m: h.view(2, 3, 4).transpose(0, 1).reshape(6, 4)), torch.randn(6, 4))
    assert not analysis.separable and "cutting the batch (dim 0) across dims" in analysis.reason


def _merged_with_an_outer_dim(h, m):
    """[B, 4] -> [2*B, 2] with the batch inside (as nn.MultiheadAttention merges time and batch
    around its output projection), a row-wise product, and back to [B, 4]."""
    rows = h.view(6, 2, 2).transpose(0, 1).reshape(12, 2)
    rows = torch.tanh(rows @ torch.ones(2, 2)) * 2
    return rows.view(2, 6, 2).transpose(0, 1).reshape(6, 4)


@pytest.mark.parametrize("fn", [
    _merged_with_an_outer_dim,
    # merged, then split into [2, B*2]: the batch is again the outer factor of dim 1
    lambda h, m: h.view(6, 2, 2).transpose(0, 1).reshape(12, 2).view(2, 12).transpose(0, 1).reshape(6, 4),
    lambda h, m: F.layer_norm(h.t().reshape(24, 1).view(4, 6, 1), (1,)).reshape(4, 6).t(),
], ids=["linear-on-rows", "split-back-elsewhere", "norm-on-rows"])
def test_a_batch_merged_inside_another_dim_stays_apart_through_row_wise_ops(fn):
    analysis = _analysis(_Fn(fn), torch.randn(6, 4))
    assert analysis.separable, analysis.reason
    assert list(analysis.output_dims.values()) == [0]


def _interleaved(h):
    return h.view(6, 2, 2).transpose(0, 1).reshape(12, 2)


@pytest.mark.parametrize("fn,why", [
    (lambda h, m: _interleaved(h), "holds the batch interleaved"),
    (lambda h, m: _interleaved(h).softmax(0).reshape(2, 6, 2).sum(0), "acts along the batch dim"),
    (lambda h, m: _interleaved(h)[:6], "picks some samples"),
    (lambda h, m: (_interleaved(h) + h.reshape(12, 2)).view(2, 6, 2).sum(0), "interleaved differently"),
    (lambda h, m: F.embedding((_interleaved(h) > 0).long(), torch.ones(2, 3)).view(2, 6, 6).sum(0),
     "only through ops that treat the rows"),
    (lambda h, m: _interleaved(h).view(3, 8).transpose(0, 1).reshape(6, 4), "cutting the batch"),
], ids=["as-output", "softmax-across-rows", "some-rows", "two-layouts", "unknown-op", "cut-again"])
def test_a_batch_merged_inside_another_dim_meeting_what_mixes_rows_is_found(fn, why):
    analysis = _analysis(_Fn(fn), torch.randn(6, 4))
    assert not analysis.separable
    assert why in analysis.reason


class _SequenceFirstLM(nn.Module):
    """PyTorch's word_language_model RNNModel: [time, batch] tokens, its log-probabilities returned
    as view(-1, vocab), time and batch merged, beside the LSTM's state."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rnn, self.head = nn.Embedding(40, 16), nn.LSTM(16, 16), nn.Linear(16, 40)

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.embed(tokens), hidden)
        return F.log_softmax(self.head(out).view(-1, 40), dim=1), hidden


def test_microbatches_are_refused_where_an_output_has_no_batch_dim_to_join_them_along():
    """Cut anyway (only a warning before), the log-probabilities came back interleaved wrongly, the
    state joined along dim 0, and the backward raised in split_with_sizes."""
    tokens, hidden = torch.randint(0, 40, (10, 4)), (torch.zeros(1, 4, 16), torch.zeros(1, 4, 16))
    with pytest.raises(ValueError, match="interleaved with another dim .* microbatches=1"):
        harmony_fx.compile(_SequenceFirstLM(), (tokens, hidden), microbatches=2, batch_dims=1)
    hm = harmony_fx.compile(_SequenceFirstLM(), (tokens, hidden), batch_dims=1)  # the planner keeps it whole
    assert hm.num_microbatches == 1


@pytest.mark.parametrize("batch_first", [True, False])
def test_pytorchs_transformer_layers_are_cut_into_microbatches_as_eager_computes(batch_first):
    """nn.MultiheadAttention merges time and batch ([T*B, E]) around its output projection: a
    batch merged inside another dim. Analysed separable, the batch is cut, and the microbatches
    give eager's outputs and gradients with no warning."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(8, 5, 16) if batch_first else torch.randn(5, 8, 16)
    dim = 0 if batch_first else 1
    assert _analysis(model, x, dims=[dim]).separable
    _assert_cut_as_eager(model, x, 4, batch_dims=dim)


def _assert_cut_as_eager(model: nn.Module, x: torch.Tensor, microbatches: int, **options) -> None:
    """Compiled with ``microbatches`` and no warning that they may change the results, one step
    gives eager's outputs and every gradient."""
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hm = harmony_fx.compile(model, (x,), microbatches=microbatches, devices=["host:0"], **options)
    out = hm(x)
    out.pow(2).mean().backward()
    expected = reference(x)
    expected.pow(2).mean().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)


class _Bags(nn.Module):
    def __init__(self, mode: str, weighted: bool) -> None:
        super().__init__()
        self.bags = nn.EmbeddingBag(20, 6, mode=mode)
        self.weighted = weighted
        self.linear = nn.Linear(6, 3)

    def forward(self, ids):
        weights = ids.float().div(20) if self.weighted else None  # each index's weight, from the data
        return self.linear(self.bags(ids, per_sample_weights=weights))


@pytest.mark.parametrize("mode,weighted", [("mean", False), ("max", False), ("sum", True)])
def test_embedding_bags_one_a_sample_are_cut_as_eager(mode, weighted):
    """nn.EmbeddingBag on a [B, L] input bags each sample's row (torch's own offsets, one bag every
    L indices): each microbatch bags its own rows."""
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (8, 5))
    assert _analysis(_Bags(mode, weighted), ids).separable
    _assert_cut_as_eager(_Bags(mode, weighted), ids, microbatches=4)


def test_an_unbatched_sequence_is_not_a_batch():
    analysis = _analysis(nn.LSTM(4, 4), torch.randn(5, 4))  # [time, features]: no batch dim at all
    assert not analysis.separable and "unbatched sequence" in analysis.reason


def test_a_sequence_first_lstm_is_batched_along_dim_1():
    analysis = _analysis(nn.LSTM(4, 4), torch.randn(5, 6, 4), dims=[1])
    assert analysis.separable, analysis.reason
    assert list(analysis.output_dims.values()) == [1, 1, 1]  # output [T, B, H], h and c [layers, B, H]


def test_compile_joins_microbatches_along_each_outputs_batch_dim():
    torch.manual_seed(0)
    model = nn.LSTM(4, 4)
    reference = copy.deepcopy(model)
    x = torch.randn(5, 6, 4)
    hm = harmony_fx.compile(model, (x,), microbatches=2, batch_dims=1)
    out, (h, c) = hm(x)
    ref_out, (ref_h, ref_c) = reference(x)
    for got, want in ((out, ref_out), (h, ref_h), (c, ref_c)):
        torch.testing.assert_close(got, want)
    (out.sum() + h.sum()).backward()
    (ref_out.sum() + ref_h.sum()).backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_the_planner_keeps_a_batch_whole_that_it_cannot_cut():
    """A loss whose class weights are computed from the batch's own labels (their inverse
    frequency) needs the whole batch; the planner does not cut it even at the smallest budget, and
    says why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))

    class Weighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x, y):
            weight = 1.0 / (F.one_hot(y, 3).sum(0) + 1.0)
            return F.cross_entropy(self.model(x), y, weight=weight)

    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    wrapped = Weighted()
    try:
        harmony_fx.compile(copy.deepcopy(wrapped), (x, y), memory_budget=1)
    except harmony_fx.BudgetTooSmallError as error:
        smallest = error.smallest_budget
    hm = harmony_fx.compile(wrapped, (x, y), memory_budget=smallest)
    assert hm.num_microbatches == 1
    assert "batch: kept whole" in hm.explain()
    torch.testing.assert_close(hm(x, y), Weighted()(x, y))


def test_a_sequence_first_model_read_along_dim_0_is_told_to_say_batch_dims_1():
    """nn.TransformerEncoder's default layout is [time, batch, features]: cut along dim 0 (the
    default batch_dims), attention mixes its "samples"; the warning and the plan say dim 1 would do."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0), 2, enable_nested_tensor=False)
    x = torch.randn(5, 8, 16)
    with pytest.warns(UserWarning, match=r"attends along the batch dim.*say batch_dims=1"):
        harmony_fx.compile(model, (x,), microbatches=4, devices=["host:0"])
    hm = harmony_fx.compile(model, (x,), devices=["host:0"])
    assert "batch_dims=1" in hm.explain()
    # a model that mixes its samples along either dim gets no such advice
    with pytest.warns(UserWarning) as caught:
        harmony_fx.compile(_Fn(lambda h, m: h.softmax(0) + h.softmax(1), width=4), (torch.randn(6, 5, 4),),
                           microbatches=2, devices=["host:0"])
    assert not any("batch_dims=1" in str(w.message) for w in caught)


class _Experts(nn.Module):
    """A mixture of experts as transformers' grouped_mm experts compute it: every (token, expert)
    pair sorted by expert id, each expert's run of rows multiplied by its weights (offsets from a
    histc of the ids), the rows put back in order by the inverse permutation. ``variant`` breaks
    one step of that, as a model the analysis must not cut would."""

    def __init__(self, variant: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router, self.weight, self.variant = nn.Linear(4, 3), nn.Parameter(torch.randn(3, 4, 4)), variant

    def forward(self, x):
        import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback

        scores, ids = self.router(x).softmax(-1).topk(2, dim=-1)
        flat_ids, flat_scores = ids.reshape(-1), scores.reshape(-1)
        sorted_ids, perm = torch.sort(flat_ids, descending=self.variant == "descending")
        rows, row_scores = x[perm // 2], flat_scores[perm]
        if self.variant == "mixing":
            rows = rows + flat_scores[:, None]  # another pair's score: the pairs in their own order
        top = 3 if self.variant == "bins" else 2  # not one bin per id: a row's group is not its id
        offsets = torch.cumsum(torch.histc(sorted_ids.float(), bins=3, min=0, max=top), 0, dtype=torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(rows, self.weight, offs=offsets) * row_scores[:, None]
        if self.variant == "sorted":
            return out
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        return out[inverse].view(-1, 2, 4).sum(1)


def test_experts_that_sort_the_batchs_tokens_and_put_them_back_are_cut_as_eager():
    pytest.importorskip("transformers")
    model = _Experts()
    x = torch.randn(8, 4)
    analysis = _analysis(model, x)
    assert analysis.separable, analysis.reason
    try:
        _assert_cut_as_eager(model, x, 4)
    except ValueError as error:  # the op's backward, not harmony_fx: the README names it
        if "reads a tensor's values" not in str(error):
            raise
        pytest.skip("this transformers' grouped matmul reads values in its backward (transformers 5.17)")


@pytest.mark.parametrize("variant,why", [
    ("sorted", "holds the batch's rows in a sorted order"),
    ("descending", "acts along the batch dim"),
    ("mixing", "meets the batch's rows sorted by sort"),
    ("bins", "meets the batch's rows sorted by sort"),
])
def test_experts_that_do_not_put_each_tokens_rows_back_are_not_cut(variant, why):
    pytest.importorskip("transformers")
    analysis = _analysis(_Experts(variant), torch.randn(8, 4))
    assert not analysis.separable
    assert why in analysis.reason


class _Reversed(torch.autograd.Function):
    """The gradient reversal layer: identity forward, the gradient negated."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class _NormalizedGradient(torch.autograd.Function):
    """A backward that divides by the whole batch's gradient norm: it mixes the samples."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad / grad.norm()


class _Centered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x - x.mean(0)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Scaled(torch.autograd.Function):
    """Scaled by a shared parameter, whose gradient its backward sums over the batch."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        return grad * scale, (grad * x).sum(0)


class _OnesForGradient(torch.autograd.Function):
    """A backward giving every sample the same gradient, whatever its own."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.ones(grad.shape)


class _ReadsValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * float(grad.abs().max() > 1)


def test_a_custom_function_that_keeps_the_samples_apart_forward_and_backward_is_cut_as_eager():
    torch.manual_seed(0)
    model = _Fn(lambda h, m: torch.tanh(_Reversed.apply(h)))
    x = torch.randn(6, 4)
    assert _analysis(model, x).separable
    _assert_cut_as_eager(model, x, 3)


@pytest.mark.parametrize("fn,why", [
    (lambda h, m: _NormalizedGradient.apply(h), "its backward: linalg_vector_norm"),
    (lambda h, m: _Centered.apply(h), "its forward: mean"),
    (lambda h, m: _Scaled.apply(h, m.linear.bias), "its backward: sum"),
    (lambda h, m: _ReadsValues.apply(h), "cannot be traced"),
    (lambda h, m: _OnesForGradient.apply(h), "gives linear a gradient batched otherwise"),
], ids=["backward-mixes", "forward-mixes", "shared-parameter", "reads-values", "shared-gradient"])
def test_a_custom_function_that_may_mix_the_samples_is_not_cut(fn, why):
    analysis = _analysis(_Fn(fn), torch.randn(6, 4))
    assert not analysis.separable
    assert "custom autograd Function" in analysis.reason and why in analysis.reason


class _DropPath(nn.Module):
    """Stochastic depth as transformers (``torch.rand``) and timm (``new_empty().bernoulli_``) write it:
    each sample's branch kept or dropped by a number drawn for it alone."""

    def __init__(self, timm_style: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.timm_style = timm_style

    def forward(self, x):
        shape = (x.shape[0], 1)
        if self.timm_style:
            mask = x.new_empty(shape).bernoulli_(0.7)
        else:
            mask = (0.7 + torch.rand(shape, dtype=x.dtype)).floor_()
        return x + self.block(x).div(0.7) * mask


@pytest.mark.parametrize("timm_style", [False, True])
def test_a_draw_of_one_number_per_sample_keeps_the_samples_apart_and_cuts_as_eager_draws(timm_style):
    """Cut in two, each microbatch draws its own samples' numbers: one pack running the microbatches
    in turn draws what eager draws running the two halves in turn, so the step is eager's on them."""
    torch.manual_seed(0)
    model, x = _DropPath(timm_style), torch.randn(4, 8)
    assert _analysis(model, x).separable
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x,), microbatches=2, pack_boundaries=(0,))
    torch.manual_seed(1)
    hm(x).square().mean().backward()
    torch.manual_seed(1)
    sum(reference(half).square().mean() for half in x.chunk(2)).div(2).backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)


def test_a_permutation_of_the_batch_still_mixes_samples():
    """``randperm``'s entries depend on each other: shuffling the batch by it is not a per-sample draw."""
    model = _Fn(lambda h, m: h[torch.randperm(h.shape[0])] + h)
    analysis = _analysis(model, torch.randn(4, 4))
    assert not analysis.separable


def test_joining_an_empty_tensor_keeps_the_batch():
    """torch.cat skips a 1-D empty tensor (a key/value cache's keys before its first update, in
    transformers' DynamicCache): the result is the batched part alone."""
    model = _Fn(lambda h, m: torch.cat([h.new_empty(0).detach_(), h], dim=-1) * 2)
    analysis = _analysis(model, torch.randn(4, 4))
    assert analysis.separable, analysis.reason
