"""The compiled model as one autograd function (``runtime.autograd``)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import harmony_fx
from harmony_fx.models import MLPChain
from tests.helpers import assert_grads_equal


def _compiled():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=6)
    x = torch.randn(8, 16)
    return model, x, harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=2, pack_boundaries=[0, 2, 4])


def test_two_calls_before_one_backward_give_eager_gradients():
    """Each call keeps its own iteration: a loss of two calls' outputs (two views, as contrastive
    training makes) differentiates through both."""
    model, x, hm = _compiled()
    reference, y = copy.deepcopy(model), torch.randn(8, 16)
    (hm(x) * hm(y)).mean().backward()
    (reference(x) * reference(y)).mean().backward()
    assert_grads_equal(model, reference)


def test_a_second_backward_through_one_call_says_what_to_do():
    """``retain_graph=True`` and a second backward: the first used up the call's stash, so the
    second is refused saying so (it used to fail with an AttributeError deep in the runtime)."""
    model, x, hm = _compiled()
    reference = copy.deepcopy(model)
    loss = hm(x).square().mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"a second time \(retain_graph=True\).*call backward once"):
        loss.backward()
    reference(x).square().mean().backward()
    assert_grads_equal(model, reference)  # the first backward's gradients, once


def test_a_gradient_of_a_gradient_says_what_to_do_and_loses_nothing():
    """``create_graph=True`` (a gradient penalty) is refused in words (it failed later with torch's
    "element 0 of tensors does not require grad"); the next call trains like eager."""
    model, x, hm = _compiled()
    reference = copy.deepcopy(model)
    x = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"create_graph=True.*eager model"):
        torch.autograd.grad(hm(x).square().sum(), x, create_graph=True)
    assert all(param.grad is None for param in model.parameters())
    hm(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert_grads_equal(model, reference)


class _TwoHeadsAndADeadEnd(torch.nn.Module):
    """A trunk, two heads returned, and a branch computed but returned nowhere (a pooler the
    model's loss ignores, as in Hugging Face's FNet and BigBird masked LMs)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.dead_end = torch.nn.Linear(16, 16)
        self.head_a, self.head_b = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.trunk:
            x = torch.relu(layer(x))
        torch.tanh(self.dead_end(x))
        return self.head_a(x), self.head_b(x)


@pytest.mark.parametrize("parallel", [None, "pp"])
def test_what_the_loss_does_not_reach_keeps_no_gradient_as_in_eager(parallel):
    """The loss uses one head: the other head and the dead end get ``.grad`` None, as in eager (not
    zeros, which AdamW's weight decay and momentum would still move), whatever packs they fall in;
    the rest, the input's included, eager's gradients; and one AdamW step moves exactly what eager's
    moves."""
    torch.manual_seed(0)
    model = _TwoHeadsAndADeadEnd()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    options = dict(devices=["host:0", "host:1"], parallel="pp") if parallel else dict(devices=["host:0"])
    hm = harmony_fx.compile(model, (x,), microbatches=2, pack_boundaries=[0, 2, 4, 6, 8], **options)
    assert len(hm.packs) >= 4
    hm(x)[0].square().mean().backward()
    reference(x_ref)[0].square().mean().backward()
    for silent in ("head_b.weight", "head_b.bias", "dead_end.weight", "dead_end.bias"):
        assert model.get_parameter(silent).grad is None, silent
    assert_grads_equal(model, reference, inputs=[x], ref_inputs=[x_ref])
    optimizer, ref_optimizer = (torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (model, reference))
    optimizer.step()
    ref_optimizer.step()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, msg=name)


@pytest.mark.parametrize("through", ["backend", "compiled_module"])
def test_a_compiled_training_step_does_not_trace_harmonys_own_backward(through, monkeypatch):
    """forward, loss.backward() and optimizer.step() under one torch.compile: autograd runs the
    backward at Dynamo's graph break with Dynamo's frame callback on; harmony's backward (the
    runtime, frame by frame) was traced and its pieces handed to the backend (to harmony's own
    backend: compiled as models). It runs as it is, and the step trains as eager does."""
    import torch._dynamo.convert_frame as convert_frame

    traced = []
    convert = convert_frame.ConvertFrameAssert.__call__

    def recording(self, frame, *args, **kwargs):
        if "harmony_fx" in frame.f_code.co_filename:
            traced.append(frame.f_code.co_name)
        return convert(self, frame, *args, **kwargs)

    monkeypatch.setattr(convert_frame.ConvertFrameAssert, "__call__", recording)
    torch._dynamo.reset()
    model, x, _ = _compiled()
    reference = copy.deepcopy(model)
    y = torch.randn(8, 10)
    run = harmony_fx.compile(model, (x,), devices=["host:0"], pack_boundaries=[0, 2, 4]) \
        if through == "compiled_module" else model
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]

    def step(module, optimizer):
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    compiled = torch.compile(functools.partial(step, run, optimizers[0]), backend="harmony" if through == "backend"
                             else "eager", options={"devices": ["host:0"]} if through == "backend" else None)
    try:
        for _ in range(2):
            torch.testing.assert_close(compiled(), step(reference, optimizers[1]), rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, rtol=1e-5, atol=1e-6)
    assert traced == []
