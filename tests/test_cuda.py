"""The same properties on a real GPU (``CudaDevice``); skipped where there is none.

Measured bytes must equal the plan exactly, as on a HostDevice. Peaks come from the caching
allocator (``torch.cuda.max_memory_allocated``), which rounds blocks to 512 bytes and holds library
workspaces, so they are checked against the budget with a relative slack, not equated with the
prediction. Both runs draw dropout from the same seeded CUDA generator, so dropout models are
compared too; TF32 is off, so fp32 means fp32.
"""
from __future__ import annotations

import copy

import pytest
import torch

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.testing.models import zoo

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize("name", ["mlp_chain", "residual_mlp", "tiny_gpt", "small_cnn"])
@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_compile_on_cuda_matches_eager(name, fraction):
    entry = zoo()[name]
    model, inputs, target = entry.build(0)
    reference = copy.deepcopy(model).cuda()
    budget = int(fraction * eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target)))
    hm = harmony_fx.compile(model, inputs, devices=["cuda:0"], memory_budget=budget, microbatches=1)
    # dropout draws from the GPU generator in both runs: seed it the same way for each
    torch.manual_seed(0)
    loss = entry.loss_fn(hm(*inputs), target)
    loss.backward()
    torch.manual_seed(0)
    reference_loss = entry.loss_fn(reference(*[x.cuda() for x in inputs]), target.cuda())
    reference_loss.backward()
    torch.testing.assert_close(loss, reference_loss.cpu(), rtol=1e-5, atol=1e-6)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=1e-5, atol=1e-6, msg=pname)
    assert hm.stats.bytes_h2d == hm.plan.bytes_h2d
    assert hm.stats.bytes_d2h == hm.plan.bytes_d2h
    assert hm.stats.peak_bytes["cuda:0"] <= budget * 1.05  # allocator rounding


def test_trainer_on_cuda_matches_eager_adamw():
    entry = zoo()["residual_mlp"]
    model, inputs, target = entry.build(0)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    budget = int(0.25 * eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target)))
    trainer = harmony_fx.Trainer(model, entry.loss_fn, optimizer, (inputs, target), devices=["cuda:0"],
                                 memory_budget=budget)
    for _ in range(3):
        torch.manual_seed(0)
        loss = trainer.step((inputs, target))
        torch.manual_seed(0)
        reference_loss = entry.loss_fn(reference(*inputs), target)
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        torch.testing.assert_close(loss, reference_loss.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    trainer.close()
