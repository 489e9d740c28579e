"""Where a recorded step's time went: compute, recompute, copies exposed, the optimizer exposed,
and the runtime's own time (what no span covers: Python between tasks, waits, the step's own
bookkeeping). ``harmony-fx demo`` explains its gap to eager with it.

Each instant of the step goes to one part, the first that applies: a forward or backward task
runs on some device (compute); a recompute runs (recompute); a copy runs (copies exposed: the
copies no compute hides; on a HostDevice every copy, as its streams run inline). The optimizer's
time the step waited for once its iteration ended is its own part (``StepStats.update_exposed_seconds``),
and the rest of the step is the runtime's. The parts add up to the step's time.
"""
from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["PARTS", "step_breakdown"]

PARTS = ("compute", "recompute", "copies exposed", "optimizer exposed", "runtime")

_COPY_STREAMS = frozenset({"h2d", "d2h", "peer"})


def step_breakdown(spans: Iterable[Sequence], step_seconds: float, optimizer_exposed: float = 0.0) -> dict[str, float]:
    """``{part: seconds}`` over ``PARTS`` for a step of ``step_seconds`` whose iteration recorded
    ``spans`` (``Stats.spans``: device, stream, label, start and end seconds from the iteration's
    start) and waited ``optimizer_exposed`` seconds for the optimizer after it."""
    compute, recompute, copies = [], [], []
    for _, stream, label, start, end in spans:
        kind = label.split(" ", 1)[0]
        if stream in _COPY_STREAMS:
            copies.append((start, end))
        elif kind in ("FWD", "BWD"):
            compute.append((start, end))
        elif kind == "RECOMPUTE":
            recompute.append((start, end))
    covered: list[tuple[float, float]] = []
    parts = {}
    for name, intervals in (("compute", compute), ("recompute", recompute), ("copies exposed", copies)):
        before = _length(covered)
        covered = _union(covered + intervals)
        parts[name] = _length(covered) - before
    parts["optimizer exposed"] = optimizer_exposed
    parts["runtime"] = max(step_seconds - sum(parts.values()), 0.0)
    return parts


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)
