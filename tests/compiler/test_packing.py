"""plan_packs: the fewest packs that fit; ``balanced`` cuts layers into chunks of about equal cost."""
from __future__ import annotations

import re

import pytest
import torch
pytest.importorskip("hypothesis")  # a test extra: without it this module skips
from hypothesis import given, settings, strategies as st

import harmony_fx
from harmony_fx.compiler.packing import BudgetTooSmallError, balanced, plan_packs
from harmony_fx.models import MLPChain

costs_strategy = st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=60)


@settings(deadline=None, max_examples=200)
@given(costs=costs_strategy, num_packs=st.integers(min_value=1, max_value=80))
def test_balanced_boundaries_are_valid(costs, num_packs):
    boundaries = balanced(costs, num_packs)
    assert boundaries[0] == 0
    assert all(a < b for a, b in zip(boundaries, boundaries[1:]))
    assert len(boundaries) == min(num_packs, len(costs))
    assert all(0 <= b < len(costs) for b in boundaries)


@settings(deadline=None, max_examples=100)
@given(num_layers=st.integers(min_value=1, max_value=40), cost=st.integers(min_value=0, max_value=1000),
       num_packs=st.integers(min_value=1, max_value=40))
def test_balanced_equal_costs_give_chunks_differing_by_at_most_one(num_layers, cost, num_packs):
    boundaries = balanced([cost] * num_layers, num_packs)
    sizes = [b - a for a, b in zip(boundaries, boundaries[1:] + [num_layers])]
    assert max(sizes) - min(sizes) <= 1


def test_balanced_cuts_by_cost_not_by_count():
    assert balanced([100, 1, 1, 1, 1], 2) == [0, 1]  # the expensive layer alone
    assert balanced([1, 1, 1, 1, 100], 2) == [0, 4]


def _chunk_peak(costs):
    def evaluate(boundaries):
        ends = list(boundaries[1:]) + [len(costs)]
        return max(sum(costs[a:b]) for a, b in zip(boundaries, ends))
    return evaluate


def test_plan_packs_takes_the_fewest_packs_that_fit():
    costs = [5, 5, 5, 5]
    tried = []

    def evaluate(boundaries):
        tried.append(list(boundaries))
        return _chunk_peak(costs)(boundaries)

    assert plan_packs(costs, evaluate, lambda peak: peak, None) == ([0], 20)
    tried.clear()
    boundaries, peak = plan_packs(costs, evaluate, lambda peak: peak, 10)
    assert (boundaries, peak) == ([0, 2], 10)
    assert tried == [[0], [0, 2]]  # stops at the first that fits


def test_plan_packs_names_the_smallest_budget():
    costs = [3, 9, 4]
    with pytest.raises(BudgetTooSmallError, match=r"smallest budget that fits is 9 bytes") as info:
        plan_packs(costs, _chunk_peak(costs), lambda peak: peak, 8)
    assert info.value.smallest_budget == 9  # for tools that retry, beside the message
    assert issubclass(BudgetTooSmallError, ValueError)


_SMALLEST = re.compile(r"smallest budget that fits is ([0-9,]+) bytes")


def test_compile_with_the_named_smallest_budget_succeeds(memory_witness):
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    x, target = torch.randn(8, 16), torch.randint(0, 10, (8,))
    with pytest.raises(BudgetTooSmallError) as info:
        harmony_fx.compile(model, (x,), memory_budget=1000)
    assert "1,000 bytes" in str(info.value)  # the budget asked for
    match = _SMALLEST.search(str(info.value))
    assert match, str(info.value)
    smallest = info.value.smallest_budget
    assert smallest == int(match.group(1).replace(",", "")) > 1000

    hm = harmony_fx.compile(model, (x,), memory_budget=smallest)
    assert hm.plan.predicted_peak[hm.device.name] <= smallest
    torch.nn.functional.cross_entropy(hm(x), target).backward()
    assert memory_witness.peak_of(hm.device) == hm.stats.peak_bytes[hm.device.name] <= smallest
    assert all(p.grad is not None for p in model.parameters())

    with pytest.raises(BudgetTooSmallError):  # and it is the smallest with one microbatch
        harmony_fx.compile(model, (x,), memory_budget=smallest - 1, microbatches=1)
