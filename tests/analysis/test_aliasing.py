"""``analysis.aliasing``: whose memory a value shares, which in-place writes reach."""
from __future__ import annotations

import copy

import torch
from torch import nn

import harmony_fx
from harmony_fx.analysis.aliasing import alias_base
from harmony_fx.frontend.capture import capture


class _TypeAs(nn.Module):
    def forward(self, x):
        same = (x * 2).type_as(x)  # the same dtype: torch returns the tensor itself
        other = (x * 3).type_as(x.double())  # another dtype: a copy
        return same, other


def test_type_as_to_the_same_dtype_shares_its_input_and_to_another_does_not() -> None:
    gm = capture(_TypeAs(), (torch.randn(2, 3),)).gm
    same, other = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.type_as.default)
    assert alias_base(same) is same.args[0] and alias_base(other) is other


class _ScaledInPlace(nn.Module):
    """torchtune's Gemma 2 attention: ``q = rope(q).type_as(x); q.mul_(scaling)``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        q = (self.linear(x) * 2).type_as(x)
        q.mul_(0.5)
        return q


class _CountsThroughTypeAs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.type_as(x).add_(1)
        return self.second(torch.relu(self.first(x)))


def _smallest_budget(model: nn.Module, x: torch.Tensor) -> int:
    try:
        harmony_fx.compile(copy.deepcopy(model), (x,), memory_budget=1, microbatches=1, devices=["host:0"])
    except harmony_fx.BudgetTooSmallError as error:
        return error.smallest_budget
    raise AssertionError("a budget of 1 byte fitted")


def _trains_as_eager(model: nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    eager, ours = copy.deepcopy(model), copy.deepcopy(model)
    eager(x).pow(2).mean().backward()
    compiled = harmony_fx.compile(ours, (x,), memory_budget=_smallest_budget(model, x), microbatches=1,
                                  devices=["host:0"])
    assert len(compiled.packs) > 1
    compiled(x).pow(2).mean().backward()
    for theirs, mine in zip(eager.parameters(), ours.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)
    for (name, theirs), mine in zip(eager.named_buffers(), ours.buffers()):
        torch.testing.assert_close(mine, theirs, msg=name)


def test_an_in_place_op_on_type_as_in_blocks_alike_trains_as_eager() -> None:
    """The second block's flags were taken from the first's without running it: ``type_as`` then
    handed back a fresh leaf that requires grad, and ``mul_`` on it raised inside torch."""
    torch.manual_seed(0)
    _trains_as_eager(nn.Sequential(_ScaledInPlace(), _ScaledInPlace()))


def test_a_buffer_written_through_type_as_is_updated_once() -> None:
    """The write was not seen as a buffer's: the recompute wrote it again (count 2, eager's 1)."""
    torch.manual_seed(0)
    _trains_as_eager(_CountsThroughTypeAs())
