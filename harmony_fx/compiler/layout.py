"""The layout of an iteration: how many microbatches, of what sizes, on which devices.

One frozen record, decided once from the planner's schedule (or the options where there is none),
instead of attributes set one by one.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from harmony_fx.config import CompileOptions
from harmony_fx.frontend.microbatch import microbatch_sizes
from harmony_fx.lowering.placement import data_parallel_microbatches
from harmony_fx.planner.chain import Schedule

__all__ = ["Layout", "decide_layout"]


@dataclasses.dataclass(frozen=True)
class Layout:
    parallel: str                                   # "single" | "dp" | "pp"
    num_microbatches: int
    mb_sizes: tuple[int | None, ...]                # None: one microbatch, the whole batch
    device_microbatches: tuple[tuple[int, ...], ...]  # the microbatches each device runs
    update_arrivals: int                            # devices reporting each pack's UPDATE
    # larger forward packs: (the backward boundaries they group, the first pack of each group)
    forward_groups: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def describe(self) -> str:
        sizes = "the whole batch" if self.mb_sizes == (None,) else "sizes " + ", ".join(map(str, self.mb_sizes))
        mode = {"single": "one device", "dp": "data-parallel", "pp": "pipeline"}[self.parallel]
        return f"{self.num_microbatches} microbatch(es) ({sizes}), {mode}"


def decide_layout(schedule: Schedule | None, options: CompileOptions, num_devices: int,
                  batch_size: Callable[[], int]) -> Layout:
    """``batch_size()``: the samples in the example batch (asked only when the batch is cut; it
    raises, saying why, when the inputs have no batch to cut)."""
    num_microbatches = options.microbatches or num_devices
    parallel = options.parallel
    if schedule is not None:
        num_microbatches, parallel = schedule.microbatches, schedule.parallel
    parallel = "single" if num_devices == 1 else ("pp" if parallel == "pp" else "dp")
    if parallel == "pp":  # every device runs its packs on every microbatch
        device_microbatches = (tuple(range(num_microbatches)),) * num_devices
    else:
        device_microbatches = tuple(data_parallel_microbatches(num_microbatches, num_devices))
    if num_microbatches > 1:
        mb_sizes = tuple(microbatch_sizes(batch_size(), num_microbatches))
    else:
        mb_sizes = (None,)
    forward_groups = None
    if options.forward_groups is not None:
        forward_groups = (tuple(options.pack_boundaries), tuple(options.forward_groups))
    elif schedule is not None and schedule.forward_groups:
        forward_groups = (schedule.boundaries, schedule.forward_groups)
    return Layout(parallel, num_microbatches, mb_sizes, device_microbatches,
                  num_devices if parallel == "dp" else 1, forward_groups)
