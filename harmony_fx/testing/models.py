"""The model zoo shared by tests and benchmarks.

Each model is small enough for a 2-core CPU, and each stresses one thing packs must get right:

* ``harmony_fx.models.MLPChain``: a plain chain of blocks (``blocks.0``, ``blocks.1``, ...).
* ``ResidualMLP``: a skip connection from the stem to the head, so one value crosses every pack.
* ``harmony_fx.models.TinyGPT``: causal self-attention, LayerNorm, GELU, dropout, token embedding
  tied to the head (the demo's model).
* ``SmallCNN``: convolutions with BatchNorm (buffers updated in place, once per real forward).

``StepCounter`` (not in the zoo) reads a buffer and then updates it in place, as spectral_norm's
power iteration does: a recompute must read the buffer as the forward did.

``zoo()`` returns ``{name: ZooEntry}``; an entry builds a fresh seeded model with an example batch
and a loss function, so tests can compare harmony_fx with eager on identical copies.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from harmony_fx.models import GPTConfig, MLPChain, TinyGPT

__all__ = ["ResidualMLP", "SmallCNN", "StepCounter", "ZooEntry", "zoo"]


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


class StepCounter(nn.Module):
    """A linear layer scaled by how many forwards ran before (a buffer), which then counts this one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("count", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x)) * self.count.clone()
        with torch.no_grad():
            self.count.add_(1.0)
        return y


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
