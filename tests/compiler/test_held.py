"""compiler.held: what a layer's backward adds, on the first microbatch and on a later one."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony_fx

WEIGHT = 64 * 64 * 4     # one Linear(64, 64)'s weight gradient, fp32
ACTIVATION = 4 * 64 * 4  # an input's gradient, for a microbatch of 4 samples


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Measured(Exception):
    pass


def _held(monkeypatch) -> list:
    """The per-layer measure a compile's bounds read, for three blocks of two Linears each, a batch
    of 8 in 2 microbatches."""
    from harmony_fx.compiler import driver

    seen = []

    def measured(costs, evaluate, peak_of, budget, policy, margin, *, bound, **options):
        seen.extend(bound._held())
        raise _Measured

    monkeypatch.setattr(driver, "plan_packs", measured)
    with pytest.raises(_Measured):
        harmony_fx.compile(nn.Sequential(_TwoLinears(), _TwoLinears(), _TwoLinears()), (torch.randn(8, 64),),
                           devices=["host:0"], microbatches=2)
    return seen


def test_a_later_microbatch_adds_each_weight_gradient_in_place_as_it_is_made(monkeypatch):
    """The first microbatch's backward keeps both weights' new gradients (they become ``.grad``);
    a later one's, where ``.grad`` exists, holds one at a time: autograd adds each into its weight's
    ``.grad`` as it makes it. The first block's input needs no gradient."""
    held = _held(monkeypatch)
    assert [(h.backward, h.accumulating) for h in held] == [
        (2 * WEIGHT, WEIGHT + ACTIVATION),  # b's weight gradient beside the one between the Linears
        (2 * WEIGHT + ACTIVATION, WEIGHT + ACTIVATION),
        (2 * WEIGHT + ACTIVATION, WEIGHT + ACTIVATION),
    ]
