"""Breadth: 45 Hugging Face architectures nobody here wrote (``testing.hf_architectures``), each
compiled at the smallest budget its refusal names and stepped once beside eager: the same loss and
every gradient; again under ``precision="bf16"`` beside the model converted to bf16; and built with
transformers' defaults (dropout on, the key/value cache), beside eager on the same seed. CI runs
a sample of each (``-m slow``), ``-m extended`` all of them (about 11 minutes on 2 cores);
``test_hf_models`` goes deeper on a few."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import harmony_fx
from harmony_fx.testing.hf_architectures import ARCHITECTURES, architecture_batch, architecture_loss, build_architecture
from tests.helpers import assert_grads_equal

pytestmark = pytest.mark.slow

# what CI runs (about 80 s and 25 s on 2 cores): an encoder-decoder, a causal LM with grouped-query
# attention, one key-value head, ALiBi-like, relative positions (XLNet), sparse attention (BigBird),
# DeBERTa's made constant, BatchNorm (ResNet), ViT-likes, speech with weight_norm (Wav2Vec2), a loss
# computed outside (CLIP's vision tower); -m extended runs every architecture
CI_SAMPLE = ("bart", "big_bird", "clip_vision", "deberta_v2", "dinov2", "falcon", "gpt_bigcode", "mistral", "opt",
             "resnet", "wav2vec2", "xlnet")
CI_SAMPLE_BF16 = ("deberta_v2", "gpt_bigcode", "mistral", "opt", "resnet", "wav2vec2")


# the architectures whose batch the analysis cannot show apart (so the planner keeps it whole, and a
# user's microbatches get a warning), and the op it stops at: the rest are cut, and must compute
# eager's loss and gradients in microbatches (the test below)
KEPT_WHOLE = {
    "mobilevit": "BatchNorm in training", "resnet": "BatchNorm in training",
    "xlnet": "varies along the batch dim",  # dropout draws on positions expanded to the batch
}


def _architectures(sample: tuple[str, ...]) -> list:
    return [pytest.param(name, marks=() if name in sample else pytest.mark.extended) for name in sorted(ARCHITECTURES)]


@pytest.mark.parametrize("name", _architectures(CI_SAMPLE))
def test_an_architecture_trains_like_eager_at_its_smallest_budget(name, memory_witness):
    pytest.importorskip("transformers")
    model = build_architecture(name)
    reference = copy.deepcopy(model)
    batch = architecture_batch(name)
    # BatchNorm computes per microbatch (as in every microbatching system): one microbatch
    # (and PhiMoE's router draws random numbers, which 2 microbatches draw otherwise than eager)
    options = dict(devices=["host:0"], microbatches=1 if name in ("resnet", "mobilevit", "phimoe") else 2)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        harmony_fx.compile(model, (), batch, memory_budget=1, **options)
    budget = refused.value.smallest_budget
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = harmony_fx.compile(model, (), batch, memory_budget=budget, **options)
    assert len(hm.packs) > 1
    assert hm.compiled.batch_analysis.separable == (name not in KEPT_WHOLE), hm.compiled.batch_analysis.reason
    if name in KEPT_WHOLE:
        assert KEPT_WHOLE[name] in hm.compiled.batch_analysis.reason
    # a batch shown apart is cut without the warning that the results may differ
    assert any("cannot show" in str(w.message) for w in caught) == (name in KEPT_WHOLE and options["microbatches"] > 1)
    _assert_steps_as_eager(name, hm, model, reference, batch)
    assert memory_witness.peak_of(hm.devices[0]) == hm.stats.peak_bytes[hm.devices[0].name] <= budget


# with transformers' defaults: dropout, stochastic depth (Swin, BEiT), the key/value cache; Wav2Vec2's
# layer drop (0.1) skips layers at random, which no graph can (tests/frontend/test_random_branches.py)
CI_SAMPLE_DEFAULTS = ("bart", "beit", "opt", "swin", "whisper", "xlnet")


@pytest.mark.parametrize("name", [param for param in _architectures(CI_SAMPLE_DEFAULTS)
                                  if param.values != ("wav2vec2",)])
def test_an_architecture_with_transformers_defaults_draws_as_eager_at_its_smallest_budget(name):
    """Built as users build it, dropout on: at the smallest budget (many packs, each recompute
    replaying its forward's random numbers; several microbatches where nothing is drawn), the same
    seed gives eager's loss and every gradient, and the model's config says use_cache as before."""
    pytest.importorskip("transformers")
    model = build_architecture(name, defaults=True)
    reference = copy.deepcopy(model)
    batch = architecture_batch(name)
    caching = getattr(model.config, "use_cache", None)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        harmony_fx.compile(model, (), batch, memory_budget=1, devices=["host:0"])
    hm = harmony_fx.compile(model, (), batch, memory_budget=refused.value.smallest_budget, devices=["host:0"])
    assert len(hm.packs) > 1 and getattr(model.config, "use_cache", None) == caching
    _assert_steps_as_eager(name, hm, model, reference, batch)


def _assert_steps_as_eager(name: str, hm, model, reference, batch: dict) -> None:
    """One step of ``hm`` and of eager ``reference`` on the same seed: the same loss and every
    gradient (attention's key bias: an exact 0, rounding noise of 1e-10 on both sides, hence atol)."""
    torch.manual_seed(5)
    loss = architecture_loss(name, hm(**batch))
    loss.backward()
    torch.manual_seed(5)
    expected = architecture_loss(name, reference(**batch))
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
    assert_grads_equal(model, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", _architectures(CI_SAMPLE_BF16))
def test_an_architecture_under_bf16_computes_what_it_computes_in_bf16(name):
    """precision="bf16" at the smallest budget, one microbatch, beside the model converted to bf16:
    the same loss, and every gradient as close to fp32 eager's as the bf16 model's own is (the
    packs sum a value's gradient parts in another order than eager, so the two round apart; a key
    bias's gradient, zero but for rounding, is all rounding)."""
    pytest.importorskip("transformers")
    if name == "fnet":
        pytest.skip("FNet's FFT has no bf16 kernel on the CPU: the model itself cannot run in bf16 here")
    model = build_architecture(name)
    in_bf16, in_fp32 = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(model)
    batch = architecture_batch(name)
    options = dict(devices=["host:0"], microbatches=1, precision="bf16")
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        harmony_fx.compile(model, (), batch, memory_budget=1, **options)
    hm = harmony_fx.compile(model, (), batch, memory_budget=refused.value.smallest_budget, **options)
    assert len(hm.packs) > 1
    torch.manual_seed(5)
    loss = architecture_loss(name, hm(**batch))
    loss.backward()
    torch.manual_seed(5)
    bf16_batch = {key: value.to(torch.bfloat16) if value.is_floating_point() else value for key, value in batch.items()}
    # harmony gives floating outputs back in the masters' fp32: a loss computed outside from them is too
    outputs = pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t,
                                   in_bf16(**bf16_batch))
    expected = architecture_loss(name, outputs)
    expected.backward()
    torch.manual_seed(5)
    architecture_loss(name, in_fp32(**batch)).backward()
    torch.testing.assert_close(loss, expected.float(), rtol=1e-3, atol=0)
    for (param_name, param), bf16, fp32 in zip(model.named_parameters(), in_bf16.parameters(), in_fp32.parameters()):
        assert (param.grad is None) == (bf16.grad is None), param_name
        if param.grad is not None:
            ours, eagers = ((grad - fp32.grad).abs().max().item() for grad in (param.grad, bf16.grad.float()))
            assert ours <= 2 * eagers + 0.02 * fp32.grad.abs().max().item(), (param_name, ours, eagers)


def test_a_loss_over_a_mask_made_inside_the_model_keeps_the_batch_whole():
    """ViTMAE's loss is a mean over the patches a random mask hides, divided by the mask's sum: a
    mask made inside the model at the batch's size. The planner keeps the batch whole (the same loss
    and gradients as eager); a cut forced by hand says why instead of adding the microbatches' means."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                       image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                       decoder_num_attention_heads=4, decoder_intermediate_size=64, mask_ratio=0.5,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.ViTMAEForPreTraining(config).train()
    reference = copy.deepcopy(model)
    batch = {"pixel_values": torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))}
    hm = harmony_fx.compile(model, (), batch, devices=["host:0"])
    torch.manual_seed(5)
    loss = hm(**batch).loss
    loss.backward()
    torch.manual_seed(5)
    expected = reference(**batch).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (param_name, param), eager in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, eager.grad, rtol=1e-4, atol=1e-6, msg=param_name)
    with pytest.warns(UserWarning, match="cannot show that microbatches compute what the whole batch does"):
        cut = harmony_fx.compile(copy.deepcopy(reference), (), batch, devices=["host:0"], microbatches=2)
    with pytest.raises(ValueError, match=r"divides by a number computed from rand"):
        cut(**batch)
