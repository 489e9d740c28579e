"""A model's own autograd Functions keep their own backward (``ir.autograd_functions``): each is one
node of the captured graph, applied as eager applies it."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.frontend.capture import capture
from harmony_fx.ir import autograd_functions
from harmony_fx.ir.autograd_functions import AUTOGRAD_FUNCTION
from tests.helpers import assert_grads_equal


class GradientReversal(torch.autograd.Function):
    """Domain-adversarial training's layer: the identity forward, the gradient negated and scaled."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class StraightThroughRound(torch.autograd.Function):
    """Quantization-aware training's estimator: rounds forward, passes the gradient where |x| < 2;
    returns a tuple with a tensor that needs no gradient, and its input unchanged."""

    @staticmethod
    def forward(ctx, x, levels):
        ctx.save_for_backward(x)
        return torch.round(x * levels) / levels, x.detach().abs().amax(-1, keepdim=True), x

    @staticmethod
    def backward(ctx, grad, grad_of_max, grad_of_x):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() < 2).to(grad.dtype) + 3 * grad_of_x, None


class RandomMask(torch.autograd.Function):
    """Draws its own random numbers in forward, saved for its backward (a sampled router's)."""

    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.5).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask * 2


class WithFunctions(nn.Module):
    def __init__(self, random: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.random = random

    def forward(self, x):
        x = GradientReversal.apply(torch.tanh(self.layers[0](x)), 0.5)
        x, largest, same = StraightThroughRound.apply(self.layers[1](x), 4.0)
        x = torch.tanh(self.layers[2](x)) * largest + same
        if self.random:
            x = RandomMask.apply(x)
        return self.layers[3](x).square().mean()


def test_each_function_is_one_node_that_applies_it():
    torch.manual_seed(0)
    captured = capture(WithFunctions(), (torch.randn(4, 8),))
    calls = [node for node in captured.gm.graph.nodes if node.target is AUTOGRAD_FUNCTION]
    assert [node.args[0].split("#")[0] for node in calls] == ["GradientReversal", "StraightThroughRound"]
    ops = {node.target for node in captured.gm.graph.nodes if node.op == "call_function"}
    assert torch.ops.aten.round.default not in ops  # the forward's ops stay inside the node
    assert "harmony_fx.autograd_function.default('GradientReversal#" in captured.gm.code


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_functions_own_backward_gives_eager_gradients(microbatches):
    """Several packs, each Function in its own, recomputed in the backward: the gradients are the
    ones the Functions' backwards give (export alone differentiates their forwards: another
    gradient for every layer before them)."""
    torch.manual_seed(0)
    model = WithFunctions()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    hm = harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=microbatches,
                            pack_boundaries=[0, 2, 4, 6, 8])
    assert len(hm.packs) >= 4
    torch.testing.assert_close(hm(x), reference(x))
    hm(x).backward()
    reference(x).backward()
    assert_grads_equal(model, reference)


def test_a_function_that_draws_random_numbers_is_replayed_in_the_recompute():
    torch.manual_seed(0)
    model = WithFunctions(random=True)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    hm = harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=1, pack_boundaries=[0, 2, 4, 6, 8])
    assert any(pack.random for pack in hm.packs)
    torch.manual_seed(3)
    hm(x).backward()
    torch.manual_seed(3)
    reference(x).backward()
    assert_grads_equal(model, reference)


def test_apply_is_torchs_own_outside_a_capture_and_after_a_failed_one():
    class Fails(nn.Module):
        def forward(self, x):
            GradientReversal.apply(x, 1.0)
            raise RuntimeError("the model's own error")

    original = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(ValueError, match="the model's own error"):
        capture(Fails(), (torch.randn(2, 2),))
    assert torch.autograd.Function.__dict__["apply"] is original
    assert not autograd_functions.recording()
    x = torch.randn(3, requires_grad=True)
    GradientReversal.apply(x, 2.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), -2.0))


class _CheckpointedMiddle(nn.Module):
    """The middle layer under torch's reentrant activation checkpoint (older training code's default),
    with dropout inside it, on a hidden state (``first=True``: requires grad) or on the input."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16) if first else None
        self.middle, self.last = nn.Linear(16 if first else 8, 16), nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.tanh(self.first(x)) if self.first is not None else x
        hidden = torch.utils.checkpoint.checkpoint(
            lambda h: nn.functional.dropout(torch.relu(self.middle(h)), 0.2, self.training), hidden,
            use_reentrant=True)
        return self.last(hidden)


@pytest.mark.parametrize("first", [True, False], ids=["on a hidden state", "on the input"])
def test_reentrant_checkpointing_trains_like_eager(first):
    """Its function is called plainly at capture: traced through, it ran under no_grad and the model's
    outputs had no gradient ('element 0 of tensors does not require grad'). On the input, which
    wants no gradient, eager's reentrant checkpoint gives the checkpointed layer none: so here."""
    torch.manual_seed(0)
    model = _CheckpointedMiddle(first)
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8)
    hm = harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=1, pack_boundaries=(0, 1, 2))
    torch.manual_seed(1)
    loss = hm(x).square().mean()
    loss.backward()
    torch.manual_seed(1)
    ref_loss = reference(x).square().mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    assert_grads_equal(model, reference)
    assert (model.middle.weight.grad is None) == (not first)


class _RoundWithVmapRule(torch.autograd.Function):
    """A straight-through rounding (its backward is not its forward's derivative) that torch.vmap
    batches by its generated rule (``generate_vmap_rule``, ``setup_context``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, levels):
        return torch.round(x * levels) / levels

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() < 0.5).to(grad.dtype) + 0.5 * grad, None


class _ScaleWithVmap(torch.autograd.Function):
    """Its own ``vmap`` staticmethod, and a backward that doubles the input's gradient."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return 2 * grad * w, (grad * x).sum_to_size(w.shape)

    @staticmethod
    def vmap(info, in_dims, x, w):
        x = x.movedim(in_dims[0], 0)
        return _ScaleWithVmap.apply(x, w), 0


class _FunctionsUnderVmap(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.w = nn.Parameter(torch.randn(8))
        self.first = first

    def forward(self, x):
        x = torch.tanh(self.layers[0](x))
        if self.first:
            x = torch.vmap(_RoundWithVmapRule.apply, in_dims=(0, None))(x, 4.0)
        x = torch.vmap(_ScaleWithVmap.apply, in_dims=(0, None))(self.layers[1](x), self.w)
        return self.layers[2](x).square().mean()


@pytest.mark.parametrize("function", ["generated rule", "vmap staticmethod"])
def test_a_function_applied_inside_vmap_is_refused_naming_it(function):
    """vmap has no batching rule for the recorded node: the capture failed, advising to remove
    control flow; and tracing through the Function would have dropped its backward (the round's
    gradient silently zero). Refused, naming the Function and what to do."""
    model = _FunctionsUnderVmap(first=function == "generated rule")
    name = "_RoundWithVmapRule" if function == "generated rule" else "_ScaleWithVmap"
    with pytest.raises(ValueError, match=f"(?s)applies its own torch.autograd.Function {name} inside torch.vmap "
                                         f".*apply {name} to the whole batch outside torch.vmap"):
        harmony_fx.compile(model, (torch.randn(8, 8),), devices=["host:0"])
    assert torch.autograd.Function.__dict__["apply"] is not None and not autograd_functions.recording()
