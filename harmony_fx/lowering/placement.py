"""Where tasks run, with several devices: the one place that decides it.

* Data-parallel: device ``d`` runs every pack on a contiguous share of the microbatches
  (``data_parallel_microbatches``: 6 microbatches over 4 devices are ``(0, 1) (2, 3) (4,) (5,)``).
  With larger forward microbatches each device runs whole forward microbatches
  (``forward_parts``, ``data_parallel_shares``).
* The wrap-around pipeline (Harmony-PP): the forward's *u*-th task (a pack, or a group of packs
  run as one forward pack) runs on device ``u mod N``; the backward continues the wrap from the
  last pack, whose forward kept its graph and weights there: pack *p*'s backward runs on
  ``(U + P-1 - p) mod N``, where ``U`` is the last pack's forward task. Without groups that is
  ``(2(P-1) - p) mod N``, and consecutive tasks always sit on neighbouring devices.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["forward_device", "backward_device", "forward_tasks", "data_parallel_microbatches", "forward_parts",
           "data_parallel_shares", "device_forward_parts"]


def forward_device(task: int, num_devices: int) -> int:
    """The device of the forward's ``task``-th task (a pack, or a group of packs)."""
    return task % num_devices


def forward_tasks(group_starts: Sequence[int], num_packs: int, last_apart: bool) -> list[range]:
    """The forward's tasks in order: groups of packs (``group_starts``, the first pack of each;
    empty: a pack each), and, ``last_apart``, the last pack alone (its forward runs in the backward
    program, with larger forward microbatches)."""
    end = num_packs - 1 if last_apart else num_packs
    starts = [start for start in group_starts if start < end] or list(range(end))
    tasks = [range(start, stop) for start, stop in zip(starts, [*starts[1:], end])]
    return tasks + [range(end, num_packs)] if last_apart else tasks


def backward_device(pack: int, num_packs: int, num_devices: int, last_task: int | None = None) -> int:
    """``last_task``: the forward task of the last pack (``None``: ``num_packs - 1``, no groups)."""
    last_task = num_packs - 1 if last_task is None else last_task
    return (last_task + num_packs - 1 - pack) % num_devices


def data_parallel_microbatches(num_microbatches: int, num_devices: int) -> list[tuple[int, ...]]:
    """The microbatches each device runs: contiguous shares, as even as they can be."""
    if num_microbatches < num_devices:
        raise ValueError(f"microbatches={num_microbatches} is fewer than the {num_devices} devices: "
                         "data-parallel needs at least one microbatch per device; pass parallel='pp' (the "
                         "devices run every microbatch in turn, as a pipeline) or at least that many microbatches.")
    shares, start = [], 0
    for device in range(num_devices):
        count = num_microbatches // num_devices + (1 if device < num_microbatches % num_devices else 0)
        shares.append(tuple(range(start, start + count)))
        start += count
    return shares


def forward_parts(num_microbatches: int, forward_microbatches: int | None) -> tuple[tuple[int, ...], ...]:
    """The backward microbatches each of ``forward_microbatches`` larger forward microbatches
    joins (contiguous, as many each); () when the forward runs the backward's microbatches."""
    if not forward_microbatches or forward_microbatches >= num_microbatches:
        return ()
    each = num_microbatches // forward_microbatches
    return tuple(tuple(range(i * each, (i + 1) * each)) for i in range(forward_microbatches))


def data_parallel_shares(num_microbatches: int, num_devices: int,
                         parts: Sequence[tuple[int, ...]] = ()) -> tuple[tuple[int, ...], ...]:
    """Each device's backward microbatches: whole forward microbatches ``parts`` per device where
    the forward's are larger, else ``data_parallel_microbatches``."""
    if not parts:
        return tuple(data_parallel_microbatches(num_microbatches, num_devices))
    return tuple(tuple(j for i in share for j in parts[i])
                 for share in data_parallel_microbatches(len(parts), num_devices))


def device_forward_parts(parts: Sequence[tuple[int, ...]], num_microbatches: int,
                         microbatches: Sequence[int]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The forward microbatches of a device that runs the backward ``microbatches``: each as (its
    index, after the backward's, and the backward microbatches it joins)."""
    mine = set(microbatches)
    return tuple((num_microbatches + i, part) for i, part in enumerate(parts) if part[0] in mine)
