"""``analysis.attention``: on meta tensors, attention keeps for its backward what the target
device's kernel keeps, counted against a real run of the op on this machine's CPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from harmony_fx.analysis.attention import SDPA, run_attention
from harmony_fx.planner.presets import PRESETS

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 64, 16


def saved_bytes(call) -> int:
    """Bytes of the distinct storages autograd saves during ``call()``, less its inputs'."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        inputs = call()
    return sum(nbytes for key, nbytes in saved.items() if key not in {t.untyped_storage()._cdata for t in inputs})


def qkv(device: str, mask: str | None = None):
    torch.manual_seed(0)
    tensors = [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device, requires_grad=True) for _ in range(3)]
    if mask == "bool":
        tensors.append(torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device=device).tril())
    elif mask == "float":
        tensors.append(torch.zeros(BATCH, 1, SEQ, SEQ, device=device))
    return tensors


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_on_meta_as_the_cpu_attention_keeps_what_a_real_cpu_call_keeps(mask) -> None:
    def real():
        q, k, v, *m = qkv("cpu", mask)
        F.scaled_dot_product_attention(q, k, v, *m, is_causal=mask is None)
        return [q, k, v, *m]

    def on_meta(device_type):
        def call():
            q, k, v, *m = qkv("meta", mask)
            out = run_attention((q, k, v, *m), {"is_causal": mask is None}, device_type)
            if out is None:
                out = SDPA(q, k, v, *m, is_causal=mask is None)
            assert out.shape == (BATCH, HEADS, SEQ, HEAD_DIM)
            return [q, k, v, *m]
        return call

    kept = saved_bytes(real)
    assert saved_bytes(on_meta("cpu")) == kept
    weights = BATCH * HEADS * SEQ * SEQ * 4  # one fp32 attention matrix
    math = saved_bytes(on_meta(None))  # the math path keeps the attention weights
    assert math >= weights and math - kept >= weights * 3 // 4
    # a GPU's memory-efficient kernel keeps the same: the output and a logsumexp per row (and its
    # random seed and offset, a few bytes)
    assert 0 <= saved_bytes(on_meta("cuda")) - kept <= 64


def test_with_dropout_the_cpu_takes_the_math_path_and_so_does_the_profile() -> None:
    q, k, v = qkv("meta")
    assert run_attention((q, k, v), {"dropout_p": 0.1}, "cpu") is None
    assert run_attention((q, k, v), {"dropout_p": 0.1}, "cuda") is not None  # a GPU's fused kernels drop out
    assert run_attention((q, k, v), {}, None) is None


def test_a_presets_block_is_profiled_without_its_attention_weights() -> None:
    """GPT-3's block at 2048 tokens: the math path would keep three fp32/bf16 attention matrices
    of 96 x 2048 x 2048 a sample; the fused kernel keeps none."""
    from harmony_fx.frontend.capture import capture
    from harmony_fx.planner.presets import Transformer
    from harmony_fx.planner.profile import profile_graph

    config = dataclasses.replace(PRESETS["gpt3-175b"], n_layer=1)
    with torch.device("meta"):
        model = Transformer(config)
        tokens = torch.zeros(1, config.seq, dtype=torch.long)
    gm = capture(model, (tokens, tokens)).gm
    block = {kind: next(layer for layer in profile_graph("gpt3", gm, 1, 2, "bf16", kind).layers
                        if layer.name == "blocks.0") for kind in ("cuda", None)}
    weights = config.n_head * config.seq**2 * 2  # one bf16 attention matrix a sample
    assert block[None].saved_bytes - block["cuda"].saved_bytes >= 2 * weights
    activations = config.seq * config.d_model * 2  # one bf16 activation of the block a sample
    assert block["cuda"].saved_bytes <= 20 * activations  # what a fused block keeps: some 16 of them
