"""The NVMe tier's policy: what goes to it, in what order, and how far ahead it is read.

Written once, for the three that apply it: the compiler's host-memory stage
(``compiler.host_memory``, on the model's own parameters), the planner's (``planner.host_memory``,
on a profile of hardware that need not be at hand) and the tier's store at run time
(``runtime.tier``), with the lowering pass that places the reads (``lowering.tier_io``).

* **What, in what order** (``choose_tiered``): packs' optimizer state, the largest first (the
  fewest packs, so the fewest files and reads), until host memory fits; if every pack's state is
  there and it still does not fit, the fp32 masters of packs whose weights travel in a narrower
  compute dtype (``masters_may_move``), again the largest first.
* **How far ahead**: a pack's state streams through its update one parameter at a time, the
  reader ``READ_AHEAD`` parameters ahead of the one being stepped; the programs open a tiered
  pack's stream ``PACKS_READ_AHEAD`` tiered pack(s) ahead of its update.
* **The bound on staged parameters**: so host memory holds at most ``staged_params(devices)``
  parameters' tier bytes on the tier's way (``staging_bytes``), not a pack's.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = ["READ_AHEAD", "PACKS_READ_AHEAD", "staged_params", "staging_bytes", "largest_first", "choose_tiered",
           "masters_may_move"]

READ_AHEAD = 2  # parameters a pack's state stream reads ahead of the one being stepped
PACKS_READ_AHEAD = 1  # tiered packs whose stream is opened ahead of the update in progress


def staged_params(devices: int) -> int:
    """Parameters' state the tier holds in host memory at most (``runtime.tier``): ``READ_AHEAD``
    for each pack a device's program opened ahead of its update (one per device) and for the pack
    being updated, the parameter being stepped, and the one in the writer's hands."""
    return READ_AHEAD * (devices + 1) + 2


def staging_bytes(devices: int, per_param: Iterable[float]) -> float:
    """Host memory the tier's streams hold at most: ``staged_params(devices)`` times the largest of
    ``per_param``, each tiered pack's largest tier bytes of one parameter (its state, and its fp32
    master where that is on the tier too)."""
    return staged_params(devices) * max(per_param, default=0)


def largest_first(sizes: Mapping[int, float]) -> list[int]:
    """The packs with bytes to move, the largest first (ties: the later pack first)."""
    return sorted((pack for pack in sizes if sizes[pack]), key=lambda pack: (-sizes[pack], -pack))


def choose_tiered(state: Mapping[int, float], masters: Mapping[int, float],
                  fits: Callable[[Sequence[int], Sequence[int]], bool],
                  capacity: float | None = None) -> tuple[list[int], list[int]]:
    """``(packs whose state goes to the tier, packs whose fp32 masters go too)``, in the order they
    were taken: state by ``largest_first(state)`` until ``fits(state packs, master packs)``, then
    masters by ``largest_first(masters)`` until it fits. ``capacity``: the tier's bytes (``None``:
    unbounded); a pack that would pass it is passed over for the next."""
    chosen: tuple[list[int], list[int]] = ([], [])
    used = 0  # stays an int where the sizes are
    for taken, sizes in zip(chosen, (state, masters)):
        for pack in largest_first(sizes):
            if fits(*chosen):
                break
            if capacity is None or used + sizes[pack] <= capacity:
                taken.append(pack)
                used += sizes[pack]
    return chosen


def masters_may_move(param: nn.Parameter, compute_dtype: torch.dtype | None) -> bool:
    """Whether ``param``'s master can live on the tier: weights travel in a narrower floating
    ``compute_dtype``, and torch keeps a gradient's dtype apart from its tensor's
    (``Tensor.grad_dtype``), so the host copy may be that dtype while gradients stay fp32."""
    return (compute_dtype is not None and param.is_floating_point() and hasattr(param, "grad_dtype")
            and param.element_size() > torch.empty((), dtype=compute_dtype).element_size())
