"""``planner.presets``: the model presets (built on the meta device) and ``load_profile``."""
from __future__ import annotations

import functools
import textwrap

import pytest
import torch

from harmony_fx.planner.presets import PRESETS, Transformer, TransformerConfig, load_profile, preset_profile

# Public parameter counts (GPT-2 XL 1.5B, BERT-large 340M, LLaMA-7B 6.7B, GPT-3 175B). The profile
# counts a tied embedding once per layer that reads it (see test_profile.py), so GPT-2 and BERT come
# out a little above their published figures, still within 10%.
PUBLIC = {"gpt2-xl": 1.5e9, "bert-large": 0.34e9, "llama-7b": 6.7e9, "gpt3-175b": 175e9}


@functools.lru_cache(maxsize=None)
def _preset(name: str):
    return preset_profile(name)


def test_every_preset_has_a_public_figure() -> None:
    assert set(PRESETS) == set(PUBLIC)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_preset_parameter_count_is_within_10_percent_of_the_public_figure(name: str) -> None:
    profile, batch = _preset(name)
    assert profile.num_params == pytest.approx(PUBLIC[name], rel=0.10)
    assert batch == PRESETS[name].batch_size


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_preset_has_the_real_depth_and_bf16_figures(name: str) -> None:
    profile, _ = _preset(name)
    config = PRESETS[name]
    blocks = [layer for layer in profile.layers if layer.name.startswith("blocks.")]
    assert [layer.name for layer in blocks] == [f"blocks.{i}" for i in range(config.n_layer)]
    assert profile.name == name and profile.precision == "bf16" and profile.batch_size == 1
    # bf16: two bytes per parameter (the LayerNorm/RMSNorm weights included)
    assert profile.param_bytes == 2 * (profile.num_params + _tied(name, config))
    block = blocks[0]
    d, d_ff = config.d_model, config.d_ff or 4 * config.d_model
    matmuls = 4 * d * d + (3 if config.llama else 2) * d * d_ff
    assert block.num_params == pytest.approx(matmuls, rel=0.01)
    # a forward multiply-add per weight and token, and attention on top of it
    assert block.fwd_flops >= 2 * matmuls * config.seq
    assert all(layer.out_bytes > 0 and layer.saved_bytes >= 0 for layer in profile.layers)


def test_fp32_preset_has_four_byte_weights() -> None:
    profile, _ = preset_profile("bert-large", precision="fp32")
    assert profile.precision == "fp32"
    assert profile.param_bytes == 4 * (profile.num_params + _tied("bert-large", PRESETS["bert-large"]))


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ValueError) as error:
        preset_profile("gpt5")
    message = str(error.value)
    assert "'gpt5'" in message and "file.py:function" in message
    for name in PRESETS:
        assert name in message


def test_transformer_returns_a_loss() -> None:
    config = TransformerConfig(n_layer=2, d_model=16, n_head=2, vocab=32, seq=8)
    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (2, 8))
    for llama in (False, True):
        model = Transformer(TransformerConfig(**{**config.__dict__, "llama": llama}))
        loss = model(tokens, tokens)
        assert loss.shape == () and torch.isfinite(loss)
        assert (model.head.weight is model.embed.weight) is not llama  # GPT ties its head


def test_load_profile_from_a_file(tmp_path) -> None:
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
            return model, torch.randn(6, 8)
    """))
    profile, batch = load_profile(f"{path}:build")
    assert batch == 6
    assert profile.name == "build" and profile.precision == "fp32"
    assert profile.num_params == 8 * 32 + 32 + 32 * 4 + 4
    assert profile.param_bytes == 4 * profile.num_params
    assert sum(layer.fwd_flops for layer in profile.layers) == 2 * (8 * 32 + 32 * 4)
    half, _ = load_profile(f"{path}:build", precision="bf16")
    assert half.param_bytes == 2 * half.num_params


def test_load_profile_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot find"):
        load_profile(str(tmp_path / "missing.py") + ":build")
    with pytest.raises(ValueError, match="cannot find"):
        load_profile("not-a-preset")
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    with pytest.raises(ValueError, match="no function 'build'"):
        load_profile(f"{path}:build")


def _tied(name: str, config) -> int:
    """The head shares the token embedding (all but Llama): moved twice, one parameter."""
    return 0 if config.llama else config.vocab * config.d_model


def test_measured_profile_times_every_layer_at_three_sizes(tmp_path) -> None:
    path = tmp_path / "chain.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 16)
    """))
    profile, batch = load_profile(f"{path}:build", measure=True)
    assert batch == 8
    for layer in profile.layers:
        assert [size for size, _, _ in layer.seconds] == [1, 2, 8]
        assert all(fwd > 0 and bwd >= 0 for _, fwd, bwd in layer.seconds)
        assert layer.measured(4) is not None
