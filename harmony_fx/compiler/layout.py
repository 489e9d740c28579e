"""The layout of an iteration: how many microbatches, of what sizes, on which devices.

One frozen record, decided once from the planner's schedule (or the options where there is none),
instead of attributes set one by one.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from harmony_fx.config import CompileOptions
from harmony_fx.frontend.microbatch import microbatch_sizes
from harmony_fx.lowering.placement import data_parallel_shares, device_forward_parts, forward_parts
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
    # larger forward microbatches: the backward microbatches each one joins (forward microbatch i
    # is microbatch ``num_microbatches + i`` in keys and ``sizes``); empty: the forward runs the
    # backward's microbatches
    forward_parts: tuple[tuple[int, ...], ...] = ()
    handoff: str = "peer"  # how a pipeline hands values on (``ProgramSignature.handoff``)

    @property
    def sizes(self) -> tuple[int | None, ...]:
        """The size of every microbatch a key may name: the backward's, then the larger forward's."""
        return self.mb_sizes + tuple(sum(self.mb_sizes[j] for j in parts) for parts in self.forward_parts)

    def device_forward_parts(self, device: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The forward microbatches ``device`` runs, each with the backward microbatches it joins."""
        return device_forward_parts(self.forward_parts, self.num_microbatches, self.device_microbatches[device])

    def describe(self) -> str:
        sizes = "the whole batch" if self.mb_sizes == (None,) else "sizes " + ", ".join(map(str, self.mb_sizes))
        mode = {"single": "one device", "dp": "data-parallel", "pp": "pipeline"}[self.parallel]
        forward = ""
        if self.forward_parts:
            forward = (f"; the forward runs {len(self.forward_parts)} of "
                       + ", ".join(map(str, self.sizes[self.num_microbatches:])))
        return f"{self.num_microbatches} microbatch(es) ({sizes}){forward}, {mode}"


def decide_layout(schedule: Schedule | None, options: CompileOptions, num_devices: int,
                  batch_size: Callable[[], int]) -> Layout:
    """``batch_size()``: the samples in the example batch (asked only when the batch is cut; it
    raises, saying why, when the inputs have no batch to cut)."""
    num_microbatches = options.microbatches or num_devices
    parallel = options.parallel
    if schedule is not None:
        num_microbatches, parallel = schedule.microbatches, schedule.parallel
    asked = num_microbatches
    if num_microbatches > 1:  # a batch of fewer samples than microbatches (a loader's last): one sample each
        num_microbatches = min(num_microbatches, max(batch_size(), 1))
    # where those are fewer than the devices, data parallelism would leave a device without work:
    # every device runs its packs on each, as a pipeline (unless data parallelism was asked for by name,
    # with that many microbatches: then it is refused, saying so)
    short = num_microbatches < min(asked, num_devices) or (parallel == "auto" and num_microbatches < num_devices)
    parallel = "single" if num_devices == 1 else ("pp" if parallel == "pp" or short else "dp")
    parts = forward_parts(num_microbatches, options.forward_microbatches if schedule is None
                          else schedule.forward_microbatches)
    if parallel == "pp":  # every device runs its packs on every microbatch
        device_microbatches = (tuple(range(num_microbatches)),) * num_devices
    else:
        device_microbatches = data_parallel_shares(num_microbatches, num_devices, parts)
    if num_microbatches > 1:
        mb_sizes = tuple(microbatch_sizes(batch_size(), num_microbatches))
    else:
        mb_sizes = (None,)
    forward_groups = None
    if options.forward_groups is not None:
        forward_groups = (tuple(options.pack_boundaries), tuple(options.forward_groups))
    elif schedule is not None and schedule.forward_groups:
        forward_groups = (schedule.boundaries, schedule.forward_groups)
    handoff = options.handoff or (schedule.handoff if schedule is not None else "peer")
    return Layout(parallel, num_microbatches, mb_sizes, device_microbatches,
                  num_devices if parallel == "dp" else 1, forward_groups, parts, handoff)
