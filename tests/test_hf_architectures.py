"""Breadth: 22 Hugging Face architectures nobody here wrote (``testing.hf_architectures``), each
compiled at the smallest budget its refusal names and stepped once beside eager: the same loss and
every gradient. With ``-m slow`` (about a minute); ``test_hf_models`` goes deeper on a few."""
from __future__ import annotations

import copy

import pytest
import torch

import harmony_fx
from harmony_fx.testing.hf_architectures import ARCHITECTURES, architecture_batch, architecture_loss, build_architecture

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_an_architecture_trains_like_eager_at_its_smallest_budget(name, memory_witness):
    pytest.importorskip("transformers")
    model = build_architecture(name)
    reference = copy.deepcopy(model)
    batch = architecture_batch(name)
    # ResNet's BatchNorm computes per microbatch (as in every microbatching system): one microbatch
    options = dict(devices=["host:0"], microbatches=1 if name == "resnet" else 2)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        harmony_fx.compile(model, (), batch, memory_budget=1, **options)
    budget = refused.value.smallest_budget
    hm = harmony_fx.compile(model, (), batch, memory_budget=budget, **options)
    assert len(hm.packs) > 1
    torch.manual_seed(5)
    loss = architecture_loss(name, hm(**batch))
    loss.backward()
    torch.manual_seed(5)
    expected = architecture_loss(name, reference(**batch))
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
    for (param_name, param), eager in zip(model.named_parameters(), reference.parameters()):
        assert (param.grad is None) == (eager.grad is None), param_name
        if param.grad is not None:
            torch.testing.assert_close(param.grad, eager.grad, rtol=1e-4, atol=1e-6, msg=param_name)
    assert memory_witness.peak_of(hm.device) == hm.stats.peak_bytes[hm.device.name] <= budget
