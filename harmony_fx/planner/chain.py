"""A profile's layer chain as packs the lowering passes accept, and their device programs.

The planner needs programs for models it never captures whole (a 175B-parameter preset) and for
thousands of candidates. ``chain_packs`` makes packs that carry only what lowering reads (indices,
input and output names, whether they have parameters): pack ``p`` over layers ``[a, b)`` reads
``x{a}`` and makes ``x{b}``. The programs are the ones ``lower_program`` / ``lower_pipeline``
emit for a real model, so the simulator sees the real schedule: transfers, waits, frees, updates,
and the NVMe tier's reads and writes (``insert_tier_io``, the runtime's pass).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from harmony_fx.ir.pack import Pack
from harmony_fx.frontend.microbatch import microbatch_sizes
from harmony_fx.lowering.pipeline import lower_pipeline
from harmony_fx.lowering.placement import data_parallel_shares, device_forward_parts, forward_parts, forward_tasks
from harmony_fx.lowering.single import lower_program
from harmony_fx.lowering.tasks import ProgramSignature
from harmony_fx.lowering.tier_io import insert_tier_io
from harmony_fx.planner.costs import PackCosts, chain_key_bytes
from harmony_fx.planner.profile import ModelProfile
from harmony_fx.planner.specs import DeviceSpec, HostSpec
from harmony_fx.planner.host_memory import plan_host_memory
from harmony_fx.program.actions import Action, KeyKind

__all__ = ["Schedule", "chain_packs", "chain_schedule", "pack_layers"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What the planner chooses."""

    boundaries: tuple[int, ...]   # first layer of each pack
    microbatches: int             # per iteration, over all devices
    parallel: str                 # "single" | "dp" | "pp"
    devices: int
    # the forward's larger packs: the first (backward) pack of each group; () = the same packs
    forward_groups: tuple[int, ...] = ()
    # the forward's larger microbatches: how many (``None``: the backward's)
    forward_microbatches: int | None = None
    handoff: str = "peer"  # a pipeline's: device to device, or through the host
    # the loss is in the graph (a Trainer): the last pack runs forward and backward per microbatch.
    # False for ``compile`` without a Trainer: every microbatch's forward of the last pack runs
    # first and keeps its graph until the caller's backward
    fuse_last: bool = True
    # why the schedule leaves more than half of the budget unused, where it does (``choose``)
    budget_note: str = dataclasses.field(default="", compare=False, repr=False)

    @property
    def forward_packs(self) -> int:
        """The forward's tasks per microbatch (Harmony's Pfwd): its groups of packs, without the
        last pack where it runs in the backward (larger forward microbatches)."""
        tasks = forward_tasks(self.forward_groups, len(self.boundaries), bool(self.forward_microbatches))
        return len(tasks) - 1 if self.forward_microbatches else len(tasks)

    def describe(self) -> str:
        mode = "one device" if self.parallel == "single" else f"{self.parallel} over {self.devices} devices"
        forward = f" ({len(self.forward_groups)} in the forward)" if self.forward_groups else ""
        forward_mbs = f" ({self.forward_microbatches} in the forward)" if self.forward_microbatches else ""
        handoff = ", handing on through the host" if self.parallel == "pp" and self.handoff == "host" else ""
        return f"{len(self.boundaries)} packs{forward}, {self.microbatches} microbatches{forward_mbs}, {mode}{handoff}"


def pack_layers(boundaries: Sequence[int], num_layers: int) -> list[range]:
    ends = [*boundaries[1:], num_layers]
    return [range(start, end) for start, end in zip(boundaries, ends)]


def chain_packs(profile: ModelProfile, boundaries: Sequence[int]) -> list[Pack]:
    packs = []
    for index, layers in enumerate(pack_layers(boundaries, len(profile.layers))):
        has_params = any(profile.layers[i].num_params for i in layers)
        packs.append(Pack(index=index, layers=tuple(layers), layer_names=tuple(profile.layers[i].name for i in layers),
                          gm=None, act_inputs=(f"x{layers.start}",), state_inputs=(), outputs=(f"x{layers.stop}",),
                          params=(f"w{index}",) if has_params else (), buffers=(), mutated_buffers=(), random=False,
                          state_slot=()))
    return packs


def chain_schedule(profile: ModelProfile, schedule: Schedule, batch_size: int, spec: DeviceSpec,
                   host: HostSpec) -> tuple[list[list[Action]], PackCosts]:
    """Every device's program (forward and backward, concatenated) and the costs of its tasks, for
    an iteration with the host updating each pack's parameters: a Trainer's (loss in the last pack,
    run fused) or, where ``schedule.fuse_last`` is False, a compiled module's called then
    backpropagated (the last pack's graphs of every microbatch kept for the backward)."""
    num_layers, count = len(profile.layers), schedule.microbatches
    packs = chain_packs(profile, schedule.boundaries)
    sizes = microbatch_sizes(batch_size, count)
    parts = forward_parts(count, schedule.forward_microbatches)
    sizes += [sum(sizes[j] for j in part) for part in parts]  # the forward's larger microbatches after
    signature = ProgramSignature(
        model_inputs=("x0",), model_outputs=(f"x{num_layers}",), inputs_requiring_grad=frozenset(),
        differentiable=frozenset(f"x{i}" for i in range(1, num_layers + 1)),
        microbatches=tuple(range(count)), fuse_last=schedule.fuse_last,
        update_packs=frozenset(pack.index for pack in packs if pack.params), forward_groups=schedule.forward_groups,
        handoff=schedule.handoff)
    if schedule.parallel == "pp":
        every = tuple(range(count))
        pairs = lower_pipeline(packs, dataclasses.replace(
            signature, forward_parts=device_forward_parts(parts, count, every)), schedule.devices)
    else:
        pairs = [lower_program(packs, dataclasses.replace(signature, microbatches=mbs,
                                                          forward_parts=device_forward_parts(parts, count, mbs)))
                 for mbs in data_parallel_shares(count, schedule.devices, parts)]
    layers = pack_layers(schedule.boundaries, num_layers)
    levels = plan_host_memory(profile, schedule.boundaries, batch_size, host,
                              schedule.devices if schedule.parallel == "pp" else 1)
    tiered = frozenset(p for p, nbytes in enumerate(levels.pack_nvme_bytes) if nbytes)
    if tiered:
        pairs = insert_tier_io(pairs, tiered)
    key_bytes = chain_key_bytes(profile, layers, sizes)
    costs = PackCosts(profile, layers, sizes, spec, host,
                      lambda key: levels.pack_nvme_bytes[int(key.name[1:])] if key.kind == KeyKind.STATE else key_bytes(key))
    return [forward + backward for forward, backward in pairs], costs
