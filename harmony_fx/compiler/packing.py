"""Decide the packs: which contiguous layer ranges run together.

A packing policy maps ``(layer_costs, num_packs)`` to pack boundaries; ``plan_packs`` tries 1, 2,
... packs and keeps the first packing whose program fits the budget (its peak comes from running
the program on FakeTensors, see ``api``). The policy is a parameter: the planner (a later pass)
replaces the default.

``balanced``: split the layers into ``num_packs`` contiguous chunks of about equal cost (weights
plus activations), cutting at prefix-sum quantiles, as Harmony's ``balanced_addx``.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable, Sequence, TypeVar

__all__ = ["balanced", "plan_packs", "PackingPolicy", "BudgetTooSmallError"]

PackingPolicy = Callable[[Sequence[int], int], list[int]]
C = TypeVar("C")


class BudgetTooSmallError(ValueError):
    """No packing fits the budget. ``smallest_budget``: the smallest budget that fits, in bytes
    (what a tool that retries should ask for)."""

    def __init__(self, message: str, smallest_budget: int) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


def balanced(layer_costs: Sequence[int], num_packs: int) -> list[int]:
    """Boundaries (first layer of each pack) of ``num_packs`` chunks of about equal total cost."""
    num_layers = len(layer_costs)
    num_packs = min(num_packs, num_layers)
    prefix = list(itertools.accumulate(max(cost, 1) for cost in layer_costs))
    total = prefix[-1]
    boundaries = [0]
    for k in range(1, num_packs):
        cut = bisect.bisect_left(prefix, total * k / num_packs) + 1
        cut = max(cut, boundaries[-1] + 1)
        cut = min(cut, num_layers - (num_packs - k))
        boundaries.append(cut)
    return boundaries


def plan_packs(layer_costs: Sequence[int], evaluate: Callable[[list[int]], C], peak_of: Callable[[C], int],
               budget: int | None, policy: PackingPolicy = balanced, margin: int = 0) -> tuple[list[int], C]:
    """The fewest packs whose program fits ``budget`` with ``margin`` bytes to spare (kept for
    allocations no shape predicts); raises ``BudgetTooSmallError`` naming the smallest budget that
    fits when none does."""
    tried: dict[tuple[int, ...], C] = {}
    for num_packs in range(1, len(layer_costs) + 1):
        boundaries = policy(layer_costs, num_packs)
        if tuple(boundaries) in tried:
            continue
        candidate = tried[tuple(boundaries)] = evaluate(boundaries)
        if budget is None or peak_of(candidate) + margin <= budget:
            return boundaries, candidate
    smallest = min(peak_of(candidate) for candidate in tried.values()) + margin
    raise BudgetTooSmallError(
        f"plan_packs: no packing fits the memory budget of {budget:,} bytes; the smallest budget that "
        f"fits is {smallest:,} bytes ({smallest / 2**20:.2f} MiB). Raise memory_budget to at least that, "
        "or use more microbatches so each task holds fewer activations.",
        smallest,
    )
