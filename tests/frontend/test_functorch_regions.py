"""``frontend.functorch_regions``: a ``torch.vmap`` in the forward becomes the batched ops it
computes, and trains as eager does, in several packs and microbatches; the other functorch
transforms are refused; no compile leaves functorch's level pushed. (A vmap crashed the
requires-grad pass, and the failed compile left the level pushed: every later ``requires_grad_()``
in the process raised.)"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.frontend.capture import capture
from harmony_fx.frontend.functorch_regions import functorch_call
from harmony_fx.ir import meta


class _PerSample(nn.Module):
    """Attention within each sample, written for one sample and mapped over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, y):
        def one(sample):  # [T, D]
            mixed = torch.softmax(sample @ sample.T, -1) @ sample
            return self.l3(torch.tanh(self.l2(torch.relu(self.l1(mixed)))).mean(0))

        return F.cross_entropy(torch.vmap(one)(x), y)


class _Ensemble(nn.Module):
    """Heads of the same shape stacked and mapped with ``functional_call`` (torch.func's ensembling)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.heads = nn.ModuleList(nn.Linear(8, 3) for _ in range(4))

    def forward(self, x):
        params = torch.func.stack_module_state(list(self.heads))[0]
        h = torch.relu(self.trunk(x))
        outputs = torch.vmap(lambda p: torch.func.functional_call(self.heads[0], p, (h,)))(params)
        return outputs.square().mean()


class _ForwardMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        out, tangent = torch.func.jvp(lambda s: torch.tanh(self.linear(s)), (x,), (torch.ones_like(x),))
        return (out + tangent).sum()


def _per_sample_call():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, 8, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def test_a_vmap_region_is_captured_as_batched_ops_of_batched_sizes():
    torch.manual_seed(0)
    x, y = _per_sample_call()
    gm = capture(_PerSample(), (x, y)).gm
    assert not [node for node in gm.graph.nodes if functorch_call(node)]
    # the linear layers run on the whole batch's rows: no value of one sample's [6, 8] is left
    shapes = [tuple(node.meta[meta.VAL].shape) for node in gm.graph.nodes
              if isinstance(node.meta.get(meta.VAL), torch.Tensor)]
    assert (6, 8) not in shapes and (8, 6, 8) in shapes


@pytest.mark.parametrize("microbatches", [1, 2, None])
@pytest.mark.parametrize("name", ["per sample", "ensemble"])
def test_a_vmap_in_the_forward_trains_like_eager_in_several_packs(name, microbatches):
    torch.manual_seed(0)
    if name == "per sample":
        model, call = _PerSample(), _per_sample_call()
    else:
        model, call = _Ensemble(), (torch.randn(8, 8, generator=torch.Generator().manual_seed(1)),)
    reference = copy.deepcopy(model)
    options = dict(devices=["host:0"], microbatches=microbatches)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refusal:
        harmony_fx.compile(model, call, memory_budget=1, **options)
    hm = harmony_fx.compile(model, call, memory_budget=refusal.value.smallest_budget, **options)
    loss = hm(*call)
    loss.backward()
    expected = reference(*call)
    expected.backward()
    assert len(hm.packs) > 1
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (param_name, param), reference_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, reference_param.grad, rtol=1e-5, atol=1e-6, msg=param_name)
    assert torch._C._functorch.maybe_current_level() is None


def test_a_forward_mode_transform_is_refused_and_leaves_no_level_pushed():
    x = torch.randn(4, 8)
    # torch 2.13's export keeps the jvp in the graph (refused there); 2.11's fails on it (said at capture)
    with pytest.raises(ValueError, match=r"(torch\.func transform other than torch\.vmap|derivative inside its "
                                         r"forward).*jvp"):
        harmony_fx.compile(_ForwardMode(), x, devices=["host:0"])
    assert torch._C._functorch.maybe_current_level() is None
    torch.ones(2).requires_grad_()  # raised inside a transform before

