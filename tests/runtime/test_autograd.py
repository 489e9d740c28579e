"""The compiled model as one autograd function (``runtime.autograd``)."""
from __future__ import annotations

import copy

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
