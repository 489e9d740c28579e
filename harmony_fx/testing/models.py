"""The model zoo shared by tests, benchmarks and the demo.

Each model is small enough for a 2-core CPU, and each stresses one thing packs must get right:

* ``MLPChain``: a plain chain of blocks (``blocks.0``, ``blocks.1``, ...).
* ``ResidualMLP``: a skip connection from the stem to the head, so one value crosses every pack.
* ``TinyGPT``: causal self-attention, LayerNorm, GELU, dropout, token embedding tied to the head.
* ``SmallCNN``: convolutions with BatchNorm (buffers updated in place, once per real forward).

``zoo()`` returns ``{name: ZooEntry}``; an entry builds a fresh seeded model with an example batch
and a loss function, so tests can compare harmony_fx with eager on identical copies.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLPChain", "ResidualMLP", "TinyGPT", "GPTConfig", "SmallCNN", "ZooEntry", "zoo"]


class MLPChain(nn.Module):
    def __init__(self, width: int = 64, depth: int = 12, num_classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class ResidualMLP(nn.Module):
    """``stem -> blocks -> head(h + stem_out)``: the stem's output is used by the last layer."""

    def __init__(self, width: int = 64, depth: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        h = skip
        for block in self.blocks:
            h = h + block(h)
        return self.head(h + skip)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 8
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_drop = nn.Dropout(config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, seq, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        scores = scores.masked_fill(~self.causal_mask[:, :, :seq, :seq], float("-inf"))
        weights = self.attn_drop(F.softmax(scores, dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, width)
        return self.resid_drop(self.proj(out))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd), nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-2-shaped decoder; ``forward(idx) -> logits`` with the head tied to ``wte``."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():  # GPT-2's initialisation: small logits at the start
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 16, depth: int = 12, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.features = nn.Sequential(
            *[nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
              for _ in range(depth)]
        )
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """``build(seed)`` → ``(model, inputs, target)``; ``loss_fn(output, target)`` → scalar."""

    name: str
    build: Callable[[int], tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _cross_entropy
    has_dropout: bool = False


def _seeded(make_model, make_batch):
    def build(seed: int = 0):
        torch.manual_seed(seed)
        model = make_model()
        generator = torch.Generator().manual_seed(seed + 1)
        inputs, target = make_batch(generator)
        return model, inputs, target

    return build


def _gpt_batch(config: GPTConfig, batch: int):
    def make(generator):
        idx = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=generator)
        target = torch.roll(idx, shifts=-1, dims=1)
        return (idx,), target

    return make


def zoo(batch: int = 32) -> dict[str, ZooEntry]:
    gpt = GPTConfig()
    entries = [
        ZooEntry("mlp_chain", _seeded(lambda: MLPChain(), lambda g: (
            (torch.randn(batch, 64, generator=g),), torch.randint(0, 10, (batch,), generator=g)))),
        ZooEntry("residual_mlp", _seeded(lambda: ResidualMLP(), lambda g: (
            (torch.randn(batch, 64, generator=g),), torch.randint(0, 10, (batch,), generator=g)))),
        ZooEntry("tiny_gpt", _seeded(lambda: TinyGPT(gpt), _gpt_batch(gpt, batch)), has_dropout=True),
        ZooEntry("small_cnn", _seeded(lambda: SmallCNN(), lambda g: (
            (torch.randn(batch, 3, 16, 16, generator=g),), torch.randint(0, 10, (batch,), generator=g)))),
    ]
    return {entry.name: entry for entry in entries}
