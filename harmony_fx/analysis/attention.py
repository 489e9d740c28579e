"""Attention as the device runs it, for a memory profile taken on the meta device.

``aten.scaled_dot_product_attention`` is a composite op: each call picks a kernel on the device it
runs on. A fused kernel (FlashAttention or memory-efficient attention on a GPU, the flash kernel
on a CPU) keeps only its output and one logsumexp per row for the backward; the math path keeps
the attention weights, sequence x sequence per head: at GPT-3's 2048 tokens and 96 heads, 805 MB a
sample in bf16, some four times a block's other activations. On the meta device the op always
takes the math path, so a profile measured there (``planner.layer_memory``) would plan for memory
the run never holds. ``run_attention`` runs the kernel the target device would pick instead:

* ``"cpu"``: torch's own choice (``torch._fused_sdp_choice``, asked with empty host tensors of the
  same shapes, strides and dtypes); its flash kernel where it picks that (no dropout), with a
  boolean mask turned into an additive one as torch does;
* ``"cuda"``: memory-efficient attention (it takes masks, dropout and fp32; FlashAttention, picked
  for fp16 and bf16 without a mask, keeps the same), except with grouped-query heads
  (``enable_gqa``), left to the math path. It is not asked of torch (a GPU is not needed to plan
  for one), so a head size no fused kernel takes is profiled as fused all the same;
* anything else, or the math path chosen: ``None`` (the caller runs the op as it is).

The FakeTensor run that checks a plan's peak (``compiler.estimate``) needs none of this: it runs
the op on the target device's fake tensors, which pick as the device does.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention import SDPBackend

__all__ = ["SDPA", "run_attention"]

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def run_attention(args: tuple, kwargs: dict[str, Any], device_type: str | None) -> torch.Tensor | None:
    """``SDPA(*args, **kwargs)`` on meta tensors through the kernel a ``device_type`` device would
    run (its output), or ``None`` where that is the math path (run the op itself)."""
    call = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False,
            **dict(zip(_ARGUMENTS, args)), **kwargs}
    query, key, value, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    if device_type == "cpu" and _cpu_picks_flash(call):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, call["dropout_p"], call["is_causal"], attn_mask=_additive(mask, query.dtype),
            scale=call["scale"])[0]
    if device_type == "cuda" and not call["enable_gqa"]:
        grad = any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention.default(
            query, key, value, _additive(mask, query.dtype), grad, call["dropout_p"], call["is_causal"],
            scale=call["scale"])[0]
    return None


def _cpu_picks_flash(call: dict[str, Any]) -> bool:
    def host(tensor):  # the choice reads shapes, strides and dtypes only: nothing is touched
        return None if tensor is None else torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)

    choice = torch._fused_sdp_choice(host(call["query"]), host(call["key"]), host(call["value"]),
                                     host(call["attn_mask"]), call["dropout_p"], call["is_causal"],
                                     scale=call["scale"], enable_gqa=call["enable_gqa"])
    return choice == SDPBackend.FLASH_ATTENTION.value


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the additive one the fused kernels take, as torch makes it."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))
