"""Branches on a random draw whose outcome is certain (layer drop at probability 0, as transformers
5.17's BART, OPT, Whisper and others draw it), captured as eager takes them."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.frontend.capture import CaptureError, capture
from tests.helpers import assert_grads_equal


class _LayerDrop(nn.Module):
    """Blocks skipped in training when a draw falls below ``layerdrop``, each followed by dropout:
    the draw moves the random numbers every later dropout uses."""

    def __init__(self, layerdrop: float, blocks: int = 3) -> None:
        super().__init__()
        self.layerdrop = layerdrop
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = F.dropout(torch.tanh(block(x)), 0.3, self.training)
        return x


def test_layer_drop_at_zero_trains_like_eager_with_eager_random_numbers():
    torch.manual_seed(0)
    model = _LayerDrop(0.0)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    hm = harmony_fx.compile(model, (x,), pack_boundaries=(0, 1, 2), microbatches=1)
    assert len(hm.packs) == 3
    for seed in (1, 2):  # the dropout masks after each draw are eager's: the draws are in the program
        torch.manual_seed(seed)
        loss = hm(x).pow(2).sum()
        loss.backward()
        torch.manual_seed(seed)
        ref_loss = reference(x).pow(2).sum()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert_grads_equal(model, reference, rtol=1e-6, atol=1e-6)
    assert "forward" not in model.__dict__  # the capture's wrapper is gone


@pytest.mark.parametrize("compare, expected", [
    (lambda draw: draw < 0.0, False), (lambda draw: draw <= -0.5, False), (lambda draw: draw < 1.5, True),
    (lambda draw: draw >= 0, True), (lambda draw: draw > 1, False), (lambda draw: 2 > draw, True),
    (lambda draw: torch.lt(draw, 0.0), False), (lambda draw: (draw.ge(-1)).item(), True),
    # a draw is below 1 (torch.rand is on [0, 1)); PEFT's LoHa drops a module where rand > 0.0 fails
    (lambda draw: draw < 1.0, True), (lambda draw: draw >= 1.0, False), (lambda draw: draw > 0.0, True),
])
def test_each_certain_comparison_takes_eager_branch(compare, expected):
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x) * (2.0 if compare(torch.rand_like(x[0, 0])) else 3.0)

    model = Branch()
    x = torch.randn(2, 4)
    captured = capture(model, (x,))
    assert any(node.target is torch.ops.aten.rand_like.default for node in captured.gm.graph.nodes)
    torch.testing.assert_close(captured.gm(*captured.params.values(), *captured.buffers.values(), x)[0],
                               model.linear(x) * (2.0 if expected else 3.0))


def test_a_draw_whose_outcome_is_random_is_still_refused():
    model = _LayerDrop(0.3)
    with pytest.raises(CaptureError, match="data-dependent") as refused:
        capture(model, (torch.randn(4, 8),))
    # the model's line, not the capture's; and symbolic tracing, which would draw once at capture and
    # bake that draw's branch into the graph (it did), refuses too
    assert "if dropout_probability < self.layerdrop" in str(refused.value)
    assert "draw once and bake" in str(refused.value)
    assert "forward" not in model.__dict__
    # what to do: the draw, the probability and what holds it, not "pick with torch.where"
    assert "torch.rand() < 0.3" in str(refused.value)
    assert "Set that probability to 0 (model.layerdrop, now 0.3)" in str(refused.value)
    assert "torch.where, or move" not in str(refused.value)


class _LayersDroppedTogether(nn.Module):
    """vit-pytorch's CaiT: one ``uniform_`` draw per layer, compared at once, then iterated."""

    def __init__(self, layer_dropout: float) -> None:
        super().__init__()
        self.layer_dropout = layer_dropout
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        to_drop = torch.zeros(len(self.layers)).uniform_(0.0, 1.0) < self.layer_dropout
        for layer, drop in zip(self.layers, to_drop):
            if not drop:
                x = torch.tanh(layer(x))
        return x


def test_a_draw_per_layer_iterated_is_taken_or_refused_as_one_draw():
    """At probability 0 every element's outcome is certain: captured, eager's numbers. Above it, the
    refusal says what to set to 0 (it gave a branch's advice: the elements were not known draws)."""
    torch.manual_seed(0)
    model, x = _LayersDroppedTogether(0.0), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    loss = harmony_fx.compile(model, (x,), microbatches=1, devices=["host:0"])(x).pow(2).sum()
    loss.backward()
    reference(x).pow(2).sum().backward()
    assert_grads_equal(model, reference, rtol=1e-6, atol=1e-6)
    with pytest.raises(CaptureError, match=r"Set that probability to 0 \(model\.layer_dropout, now 0\.2\)"):
        capture(_LayersDroppedTogether(0.2), (x,))


def test_a_hugging_face_layer_drop_names_the_config_that_holds_it():
    """Wav2Vec2 with transformers' default layerdrop (0.1): skips each layer at random in training."""
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_architectures import architecture_batch, build_architecture

    model = build_architecture("wav2vec2")
    model.config.layerdrop = 0.1
    with pytest.raises(CaptureError, match=r"Set that probability to 0 \(model\.config\.layerdrop, now 0\.1\)") as refused:
        capture(model, (), architecture_batch("wav2vec2"))
    assert "call the model without labels" not in str(refused.value)  # the loss is not what failed


def test_a_users_own_forward_attribute_is_kept():
    model = _LayerDrop(0.0)
    own = model.forward
    model.forward = own  # an instance attribute, as a wrapper a user set would be
    capture(model, (torch.randn(4, 8),))
    assert model.__dict__["forward"] is own


class _PythonLayerDrop(nn.Module):
    def __init__(self, draw) -> None:
        super().__init__()
        self.draw = draw
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            if self.draw() < 0.5:  # a branch the graph would freeze at its capture's draw
                continue
            x = block(x)
        return x


@pytest.mark.parametrize("draw", ["random", "numpy"])
def test_a_python_draw_in_forward_is_said_and_its_generator_put_back(draw):
    import random

    import numpy

    model = _PythonLayerDrop(random.random if draw == "random" else numpy.random.uniform)
    random.seed(3)
    numpy.random.seed(3)
    expected = (random.random(), numpy.random.uniform())
    random.seed(3)
    numpy.random.seed(3)
    with pytest.warns(UserWarning, match=f"draws from {'random' if draw == 'random' else 'numpy.random'} in forward"):
        capture(model, (torch.randn(4, 8),))
    assert (random.random(), numpy.random.uniform()) == expected  # as if nothing had drawn


def test_a_model_drawing_only_with_torch_is_not_warned_about(recwarn):
    capture(_LayerDrop(0.0), (torch.randn(4, 8),))
    assert not [w for w in recwarn if "draws from" in str(w.message)]


class _Reseeding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        torch.manual_seed(42)  # as torch's own OpInfo wrappers of random ops do: run once, at capture
        return F.dropout(self.linear(x), 0.5, True)


def test_a_forward_reseeding_torch_is_said_and_the_generator_put_back():
    """Eager draws each call's mask from seed 42; the graph keeps no ``manual_seed`` and draws on
    from the caller's generator: said, and capturing leaves the caller's generator as it was."""
    model, x = _Reseeding(), torch.randn(4, 8)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="sets torch's random generator in forward"):
        capture(model, (x,))
    assert torch.equal(torch.rand(4), expected)  # as if nothing had reseeded it


def test_a_model_drawing_with_torch_without_reseeding_is_not_warned_about(recwarn):
    capture(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), (torch.randn(4, 8),))
    assert not [w for w in recwarn if "random generator" in str(w.message)]
