"""``planner.profile``: per-layer, per-sample figures from a captured graph, ``repeat_block`` and
measured seconds.

The models are tiny (``MLPChain`` of width 16, a 2-block ``TinyGPT``) so every figure can be checked
by hand: a float32 activation of width 16 is 64 bytes per sample, an int64 target 8 bytes.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harmony_fx.frontend.capture import capture
from harmony_fx.models import GPTConfig, MLPChain, TinyGPT
from harmony_fx.planner.profile import LayerProfile, ModelProfile, measure_seconds, profile_graph, repeat_block

WIDTH, DEPTH, CLASSES = 16, 3, 4


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.m(x), y)


@functools.lru_cache(maxsize=None)
def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _WithLoss(MLPChain(width=WIDTH, depth=DEPTH, num_classes=CLASSES))
    return model, torch.randn(16, WIDTH), torch.randint(0, CLASSES, (16,))


@functools.lru_cache(maxsize=None)
def _mlp_captured(batch: int):
    model, x, y = _mlp()
    return capture(model, (x[:batch], y[:batch]))


@functools.lru_cache(maxsize=None)
def _mlp_profile(batch: int) -> ModelProfile:
    return profile_graph("mlp", _mlp_captured(batch).gm, batch)


def test_layers_are_the_blocks_then_the_head_then_the_loss() -> None:
    profile = _mlp_profile(8)
    assert [layer.name for layer in profile.layers][:DEPTH] == [f"m.blocks.{i}" for i in range(DEPTH)]
    assert len(profile.layers) == DEPTH + 2  # the head's linear and the loss are layers of their own
    assert profile.layers[-1].num_params == 0
    assert profile.batch_size == 8 and profile.precision == "fp32"


def test_param_figures_sum_to_the_models_parameters() -> None:
    model, _, _ = _mlp()
    profile = _mlp_profile(8)
    num_params = sum(p.numel() for p in model.parameters())
    assert profile.num_params == num_params
    assert profile.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert profile.layers[0].num_params == WIDTH * WIDTH + WIDTH
    assert profile.layers[DEPTH].num_params == WIDTH * CLASSES + CLASSES


def test_per_sample_activation_and_flop_figures() -> None:
    profile = _mlp_profile(8)
    block = profile.layers[0]
    assert block.fwd_flops == 2 * WIDTH * WIDTH          # one linear: a multiply and an add per weight
    assert block.made_bytes == 2 * WIDTH * 4             # the linear's output and the ReLU's
    # autograd keeps the ReLU's output (the block's output too), not the linear's; and the
    # linear's input, which the block before made
    assert block.saved_bytes == WIDTH * 4
    assert block.saved_input_bytes == WIDTH * 4
    # live after a block: its output, and the target the loss reads at the very end
    assert block.out_bytes == WIDTH * 4 + 8
    assert profile.input_bytes == WIDTH * 4 + 8          # x and y
    assert profile.layers[DEPTH].out_bytes == CLASSES * 4 + 8   # logits and the target


def test_out_bytes_of_the_last_layer_is_the_loss() -> None:
    batch = 8
    profile = _mlp_profile(batch)
    assert profile.layers[-1].out_bytes == 4 / batch     # one float32 scalar for the whole batch


def test_figures_are_per_sample_whatever_the_batch() -> None:
    small, large = _mlp_profile(8), _mlp_profile(16)
    assert small.input_bytes == large.input_bytes
    for a, b in zip(small.layers[:-1], large.layers[:-1], strict=True):
        assert a.name == b.name
        assert (a.num_params, a.param_bytes) == (b.num_params, b.param_bytes)
        assert a.fwd_flops == pytest.approx(b.fwd_flops)
        assert a.saved_bytes == pytest.approx(b.saved_bytes)
        assert a.out_bytes == pytest.approx(b.out_bytes)
    # the loss is one scalar per batch, not per sample: its share per sample halves
    loss_small, loss_large = small.layers[-1], large.layers[-1]
    assert loss_small.out_bytes * 8 == loss_large.out_bytes * 16 == 4
    # what autograd keeps of it: the log-softmax per sample (8 more samples, 8 more rows), the
    # loss and nll_loss's total weight once
    assert loss_large.saved_bytes * 16 - loss_small.saved_bytes * 8 == 8 * CLASSES * 4


def test_compute_itemsize_sizes_floating_activations_and_weights() -> None:
    profile = profile_graph("mlp", _mlp_captured(8).gm, 8, compute_itemsize=2, precision="bf16")
    fp32 = _mlp_profile(8)
    assert profile.precision == "bf16"
    for half, full in zip(profile.layers, fp32.layers, strict=True):
        assert half.param_bytes * 2 == full.param_bytes
        assert half.num_params == full.num_params
    assert profile.layers[0].saved_bytes == fp32.layers[0].saved_bytes / 2
    assert profile.input_bytes == WIDTH * 2 + 8  # the int64 target keeps its size


def test_total_flops_is_forward_recompute_and_a_double_backward() -> None:
    profile = _mlp_profile(8)
    assert profile.total_flops(10) == 4 * 10 * sum(layer.fwd_flops for layer in profile.layers)


# ---------------------------------------------------------------- tied weights

@functools.lru_cache(maxsize=None)
def _tiny_gpt() -> tuple[nn.Module, ModelProfile]:
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    torch.manual_seed(0)
    model = TinyGPT(config)
    captured = capture(model, (torch.randint(0, config.vocab_size, (4, config.block_size)),))
    return model, profile_graph("gpt", captured.gm, 4)


def test_tied_weight_is_moved_by_every_layer_but_counted_once() -> None:
    """TinyGPT's token embedding, tied to the head, is moved to the device for each layer that
    reads it (``param_bytes``), but it is one parameter: only the first layer counts it."""
    model, profile = _tiny_gpt()
    wte = model.wte.weight
    readers = [layer for layer in profile.layers if layer.param_bytes >= wte.numel() * 4 and not layer.name.startswith("h.")]
    assert [layer.name for layer in readers] == ["embedding", "linear_8"]
    assert readers[0].num_params == wte.numel() and readers[1].num_params == 0


def test_model_num_params_counts_a_tied_weight_once() -> None:
    """It sizes the host's fp32 masters and optimizer state, the CPU update time and the count
    ``harmony-fx plan`` prints."""
    model, profile = _tiny_gpt()
    assert profile.num_params == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- repeat_block

def _layer(name: str, num_params: int = 0) -> LayerProfile:
    return LayerProfile(name, num_params, 2 * num_params, 10.0 * (num_params + 1), 4.0, 8.0)


def _block_profile() -> ModelProfile:
    layers = (_layer("embed", 100), _layer("h.0", 7), _layer("h.1", 10), _layer("norm", 1), _layer("loss"))
    return ModelProfile("toy", layers, 1, 2.0)


def test_repeat_block_makes_n_copies_of_the_last_block() -> None:
    profile = repeat_block(_block_profile(), "h.", 5)
    assert [layer.name for layer in profile.layers] == ["embed", *(f"h.{i}" for i in range(5)), "norm", "loss"]
    for copy in profile.layers[1:6]:
        assert (copy.num_params, copy.param_bytes, copy.fwd_flops) == (10, 20, 110.0)
    assert profile.num_params == 100 + 5 * 10 + 1
    assert (profile.name, profile.batch_size, profile.input_bytes) == ("toy", 1, 2.0)


def test_repeat_block_scales_a_captured_model() -> None:
    model, profile = _tiny_gpt()
    block = sum(p.numel() for p in model.h[1].parameters())
    deep = repeat_block(profile, "h.", 12)
    assert sum(layer.name.startswith("h.") for layer in deep.layers) == 12
    assert deep.num_params == profile.num_params + (12 - 2) * block
    assert len(deep.layers) == len(profile.layers) + 10


def test_repeat_block_with_an_unknown_name_raises() -> None:
    with pytest.raises(ValueError, match="blocks"):
        repeat_block(_block_profile(), "blocks.", 3)


# ---------------------------------------------------------------- measured seconds

def test_measured_without_measurements_is_none() -> None:
    assert _layer("a").measured(4) is None


def test_measured_scales_a_single_point_linearly() -> None:
    layer = LayerProfile("a", 0, 0, 0.0, 0.0, 0.0, seconds=((4, 1.0, 2.0),))
    assert layer.measured(8) == pytest.approx((2.0, 4.0))
    assert layer.measured(1) == pytest.approx((0.25, 0.5))


def test_measured_interpolates_and_extrapolates() -> None:
    layer = LayerProfile("a", 0, 0, 0.0, 0.0, 0.0, seconds=((2, 1.0, 3.0), (4, 2.0, 5.0), (8, 3.0, 9.0)))
    assert layer.measured(4) == pytest.approx((2.0, 5.0))      # a measured point
    assert layer.measured(3) == pytest.approx((1.5, 4.0))      # between the first two
    assert layer.measured(6) == pytest.approx((2.5, 7.0))      # between the last two
    assert layer.measured(16) == pytest.approx((5.0, 17.0))    # beyond: the last segment's slope
    assert layer.measured(1) == pytest.approx((0.5, 2.0))      # below: the first segment's slope


def test_measured_never_goes_negative() -> None:
    layer = LayerProfile("a", 0, 0, 0.0, 0.0, 0.0, seconds=((4, 1.0, 1.0), (8, 5.0, 9.0)))
    assert layer.measured(1) == (0.0, 0.0)


def test_measure_seconds_times_every_layer_at_every_size() -> None:
    model, x, y = _mlp()
    backward = {4: 0.5, 8: 0.75}

    def run_at(size: int):
        captured = _mlp_captured(size)
        inputs = dict(zip(captured.inputs, (x[:size], y[:size]), strict=True))
        example = [captured.params[n.name] if n.name in captured.params else inputs[n.name]
                   for n in captured.gm.graph.find_nodes(op="placeholder")]
        return captured.gm, example, backward[size]

    profile = measure_seconds(_mlp_profile(8), run_at, [8, 4, 8], repeats=1)
    for layer, before in zip(profile.layers, _mlp_profile(8).layers, strict=True):
        assert [size for size, _, _ in layer.seconds] == [4, 8]
        assert all(fwd > 0 and bwd > 0 for _, fwd, bwd in layer.seconds)
        assert layer.fwd_flops == before.fwd_flops  # only the measurements change
    for index, size in enumerate([4, 8]):
        # the model's backward is shared out in proportion to the forward times
        assert sum(layer.seconds[index][2] for layer in profile.layers) == pytest.approx(backward[size])
        ratios = [layer.seconds[index][2] / layer.seconds[index][1] for layer in profile.layers]
        assert ratios == pytest.approx([ratios[0]] * len(ratios))
    assert profile.layers[0].measured(6) is not None


def test_measure_seconds_rejects_a_model_with_other_layers() -> None:
    profile = _mlp_profile(8)
    fewer = ModelProfile("mlp", profile.layers[:-1], 8, profile.input_bytes)

    def run_at(size: int):
        return _mlp_captured(8).gm, [], 1.0

    with pytest.raises(ValueError, match="layers"):
        measure_seconds(fewer, run_at, [8])
