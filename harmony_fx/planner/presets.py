"""Model presets for ``harmony-fx plan``: well-known transformers built on the meta device.

Each is a ``Transformer`` with the preset's widths and two blocks, captured on the meta device
(no memory, well under a second) and profiled; ``repeat_block`` then sets the real depth, since
every block costs the same. ``load_model("file.py:function")`` profiles a user's model instead.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from harmony_fx.frontend.capture import capture
from harmony_fx.planner.profile import ModelProfile, measure_seconds, profile_graph, repeat_block

__all__ = ["PRESETS", "TransformerConfig", "Transformer", "preset_profile", "load_profile", "measured_profile"]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq: int
    d_ff: int = 0              # 0: 4 * d_model
    causal: bool = True
    llama: bool = False        # RMSNorm, SwiGLU and rotary positions instead of LayerNorm, GELU, learned
    batch_size: int = 32       # the preset's default batch (sequences)


PRESETS: dict[str, TransformerConfig] = {
    "gpt2-xl": TransformerConfig(48, 1600, 25, 50257, 1024, batch_size=64),
    "bert-large": TransformerConfig(24, 1024, 16, 30522, 512, causal=False, batch_size=128),
    "llama-7b": TransformerConfig(32, 4096, 32, 32000, 2048, d_ff=11008, llama=True, batch_size=64),
    "gpt3-175b": TransformerConfig(96, 12288, 96, 50257, 2048, batch_size=256),
}


class _RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Block(nn.Module):
    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        norm = _RMSNorm if c.llama else nn.LayerNorm
        d_ff = c.d_ff or 4 * c.d_model
        self.c = c
        self.norm1, self.norm2 = norm(c.d_model), norm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=not c.llama)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=not c.llama)
        self.up = nn.Linear(c.d_model, (2 if c.llama else 1) * d_ff, bias=not c.llama)
        self.down = nn.Linear(d_ff, c.d_model, bias=not c.llama)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        heads = self.c.n_head
        q, k, v = (t.view(batch, seq, heads, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).split(width, dim=2))
        if self.c.llama:  # rotary positions: an elementwise rotation of q and k
            angle = torch.arange(seq, device=x.device, dtype=x.dtype)[:, None] / 10000 ** (
                torch.arange(width // heads, device=x.device, dtype=x.dtype) / (width // heads))
            q, k = q * angle.cos() + q.flip(-1) * angle.sin(), k * angle.cos() + k.flip(-1) * angle.sin()
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.c.causal)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        hidden = self.up(self.norm2(x))
        if self.c.llama:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden)
        return x + self.down(hidden)


class Transformer(nn.Module):
    """A decoder (GPT, Llama) or encoder (BERT) returning the language-model loss."""

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.pos = None if c.llama else nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.norm = _RMSNorm(c.d_model) if c.llama else nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        if not c.llama:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def preset_profile(name: str, precision: str = "bf16") -> tuple[ModelProfile, int]:
    """(profile, default batch size) of a preset, built and captured on the meta device."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}, "
                         "or pass file.py:function returning (model, example_inputs)") from None
    small = dataclasses.replace(config, n_layer=2)
    with torch.device("meta"):
        model = Transformer(small)
        tokens = torch.zeros(1, config.seq, dtype=torch.long)
    captured = capture(model, (tokens, tokens))
    itemsize = 2 if precision == "bf16" else 4
    profile = profile_graph(name, captured.gm, 1, itemsize, precision, "cuda")
    return repeat_block(profile, "blocks.", config.n_layer), config.batch_size


def load_profile(spec: str, precision: str = "fp32", measure: bool = False) -> tuple[ModelProfile, int]:
    """``path/to/file.py:function``; the function returns ``(model, example_inputs)`` and the model's
    output is what training minimises (a loss), or anything: only costs are read. ``measure``: time
    every layer on this machine at a few microbatch sizes (``measured_profile``)."""
    path, _, function = spec.rpartition(":")
    if not path or not os.path.exists(path):
        raise ValueError(f"cannot find {path or spec!r}: pass a preset name or file.py:function")
    module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, function):
        raise ValueError(f"{path} has no function {function!r}")
    model, example_inputs = getattr(module, function)()
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    batch = example_inputs[0].shape[0] if example_inputs and isinstance(example_inputs[0], torch.Tensor) else 1
    captured = capture(model, example_inputs)
    itemsize = 2 if precision == "bf16" else None
    profile = profile_graph(function, captured.gm, batch, itemsize, precision, "cuda")
    if measure:
        profile = measured_profile(profile, model, example_inputs)
    return profile, batch


def measured_profile(profile: ModelProfile, model: nn.Module, example_inputs: tuple,
                     sizes: tuple[int, ...] | None = None) -> ModelProfile:
    """``profile`` with every layer's forward and backward seconds measured on this machine at a
    few microbatch sizes (1, a quarter, and the whole example batch; dim 0 of every input)."""
    batch = profile.batch_size
    sizes = sizes or tuple(sorted({1, max(batch // 4, 1), batch}))

    def run_at(size: int):
        args = tuple(x[:size] if isinstance(x, torch.Tensor) else x for x in example_inputs)
        captured = capture(model, args)
        values = {**captured.params, **captured.buffers}
        flat = iter(captured.flatten_inputs(args, {}))
        example = [values[node.name].detach() if node.name in values else next(flat)
                   for node in captured.gm.graph.find_nodes(op="placeholder")]
        backward = min(_backward_seconds(model, args) for _ in range(3))
        return captured.gm, example, backward

    return measure_seconds(profile, run_at, sizes)


def _backward_seconds(model: nn.Module, args: tuple) -> float:
    """Seconds of ``output.sum().backward()`` in eager (gradients dropped afterwards)."""
    output = model(*args)
    loss = output if output.dim() == 0 else output.float().sum()
    started = time.perf_counter()
    loss.backward()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds

