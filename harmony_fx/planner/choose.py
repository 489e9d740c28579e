"""``compile``'s use of the planner: ``microbatches=None`` and ``parallel="auto"`` are searched.

The model's own graph is profiled (FLOPs and bytes per layer), the device described by a spec
(fixed round figures for HostDevices, so a model plans the same on every run; the closest preset
for a GPU), and ``search`` picks
microbatches, data- or pipeline-parallel over the devices given, and the pack boundaries. ``compile``
still lowers and runs the choice on FakeTensors, so the budget is checked exactly; if the
planner's estimate was optimistic, or its microbatches capture another graph at some size, it
falls back to the planner's next schedule, and last to its own defaults.

When the graph does not treat the samples apart (``analysis.batch_dims``: a softmax over the batch,
an unbatched sequence, a loss it cannot put back together, ...) the batch is not cut: one
microbatch, and several devices form a pipeline. When cutting it only changes the random numbers,
the batch statistics or the state (dropout draws per microbatch, BatchNorm normalises per
microbatch, a buffer updated in place is updated once per microbatch), the planner keeps one
microbatch per device.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from harmony_fx.config import CompileOptions, format_size
from harmony_fx.analysis.buffer_writes import first_buffer_write
from harmony_fx.analysis.random_ops import draws_random
from harmony_fx.planner.chain import Schedule
from harmony_fx.planner.profile import profile_graph
from harmony_fx.planner.search import PlanChoice, PlanningError, search
from harmony_fx.planner.specs import PRESETS, DeviceSpec, HostSpec, host_nominal

__all__ = ["choose_schedules", "cutting_changes_results", "device_spec"]


def choose_schedules(gm: fx.GraphModule, model: nn.Module, batch_size: int, devices: list, budget: int | None,
                     options: CompileOptions, separable: bool = True, trainer: bool = False) -> tuple[Schedule, ...]:
    """The planner's schedules, best first, or none when it finds none; ``compile`` tries them in
    turn, then its defaults. ``separable``: the graph treats the samples apart
    (``analysis.batch_dims``); if not, the batch is never cut (one microbatch, several devices in a
    pipeline). ``trainer``: the loss is in the graph, so the forward may run larger microbatches
    than the backward (where the samples are apart and nothing random is drawn) and the last pack
    runs forward and backward per microbatch; without it, the last pack's graphs of every
    microbatch wait for the caller's backward, and the schedules are simulated so.

    After the fastest schedule come simpler ones, for when it cannot be captured or packed after
    all: the planner sees one graph, and export may capture another at a microbatch size (a
    ``contiguous`` that is a no-op on a size-1 dim disappears), so every microbatch size more is
    a risk: the same schedule without its larger forward microbatches and packs (which the
    search simulated too), then with microbatches of one size."""
    # captured in the compute dtype: the graph's bytes are the devices' (no itemsize to apply)
    profile = profile_graph("model", gm, batch_size, None, options.precision, devices[0].torch_device.type)
    microbatches = options.microbatches
    parallel = None if options.parallel == "auto" or len(devices) == 1 else options.parallel
    changes_results = cutting_changes_results(gm, model)
    if microbatches is None and not separable:
        microbatches = 1
        if parallel is None and len(devices) > 1:
            parallel = "pp"
    elif microbatches is None and changes_results:
        microbatches = len(devices)
    spec = device_spec(devices[0], budget)
    settings = dict(batch_size=batch_size, devices=len(devices), budget=budget, parallel=parallel, simulate_top=3,
                    all_devices=True, forward_apart=trainer and separable and not changes_results,
                    handoff=options.handoff, fuse_last=trainer)
    try:
        choice = search(profile, spec, HostSpec(), microbatches=microbatches, **settings)
    except PlanningError as error:
        # the estimate of a peak stays above the planning run's exact count (a T5 at a quarter of
        # eager's memory: every schedule estimated over its 2.14 MiB, the closest at 2.18; counted,
        # that one peaks at 1.56): the closest two are still worth the exact count before the
        # options' own settings
        usable = spec.usable(budget)
        return tuple(dataclasses.replace(schedule, budget_note=(
            f"the planner's estimate of every schedule it simulated passed the {format_size(usable)} it may use "
            f"(this one's: {format_size(peak)}); the planning run's exact count, which the plan's peak is, "
            "accepted it")) for schedule, peak in error.closest[:2])
    fixed = (f"microbatches={microbatches} was given" if options.microbatches is not None
             else "the batch is not cut (its samples are not apart)" if not separable
             else f"{microbatches} microbatch(es), one per device (cutting the batch further changes its random "
                  "numbers or batch statistics)" if microbatches is not None else None)
    note = _budget_note(choice, profile, spec, settings, microbatches, fixed)
    schedules = [dataclasses.replace(choice.schedule, budget_note=note)]
    if choice.schedule.forward_microbatches or choice.schedule.forward_groups:
        schedules.append(dataclasses.replace(choice.schedule, forward_groups=(), forward_microbatches=None))
    if microbatches is None and batch_size % schedules[-1].microbatches:
        # more microbatches (less memory each), all of one size
        even = next(n for n in range(schedules[-1].microbatches + 1, batch_size + 1) if batch_size % n == 0)
        schedules.append(dataclasses.replace(schedules[-1], microbatches=even))
    return tuple(schedules)


def _budget_note(choice: PlanChoice, profile, spec: DeviceSpec, settings: dict, microbatches: int | None,
                 fixed: str | None) -> str:
    """Why ``choice`` may leave more than half of the budget unused (the plan says it where it
    does): the planner's estimate of its peak was higher (the exact count comes later, from the
    planning run); or its packing is the fastest the cost model finds within the budget (the
    largest packs that fit simulate no faster), and half as many microbatches, each twice the
    memory, do not fit or simulate no faster, or the microbatches were fixed (``microbatches``,
    and ``fixed`` says why; ``settings``: the search's other arguments)."""
    budget = settings["budget"]
    if budget is None:
        return ""
    peak, usable = max(choice.simulation.peak_bytes), spec.usable(budget)
    if 2 * peak > usable:  # the exact peak, from the planning run, may still be under half
        return (f"the planner chose it on its estimate of {format_size(peak)} ({peak / usable:.0%} of the "
                f"{format_size(usable)} it may use; the estimate is the layers' profile, the plan's peak the planning "
                "run's exact count), by which a schedule that holds more does not fit")
    reasons = []
    largest = choice.compared.get("largest packs")
    if largest is not None and largest != float("inf") and choice.policy != "largest packs":
        reasons.append(f"the largest packs that fit simulate at {largest * 1e3:.3g} ms, no faster")
    fewer = choice.schedule.microbatches // 2
    if choice.schedule.microbatches == 1:
        reasons.append("the batch is already whole (one microbatch)")
    elif microbatches is not None:
        reasons.append(fixed or f"{microbatches} microbatches are fixed")
    elif fewer >= (choice.schedule.devices if choice.schedule.parallel == "dp" else 1):
        try:
            other = search(profile, spec, HostSpec(), microbatches=fewer, **{**settings, "simulate_top": 1})
        except PlanningError:
            reasons.append(f"{fewer} microbatches (twice the memory each) do not fit")
        else:
            reasons.append(f"{fewer} microbatches (twice the memory each) simulate at {other.seconds * 1e3:.3g} ms, "
                           f"peak {format_size(max(other.simulation.peak_bytes))}")
    return (f"the fastest schedule the planner simulated takes {choice.seconds * 1e3:.3g} ms and needs no more"
            + (f" ({'; '.join(reasons)})" if reasons else ""))


def cutting_changes_results(gm: fx.GraphModule, model: nn.Module) -> bool:
    """Whether microbatches change the results even where the samples are apart: random draws
    (dropout draws per microbatch), a BatchNorm in training (statistics per microbatch) or any
    buffer the forward updates in place (once per microbatch: a step counter, spectral_norm)."""
    random = any(draws_random(node) for node in gm.graph.nodes)
    batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())
    return random or batch_norm or first_buffer_write(gm) is not None


def device_spec(device, budget: int | None) -> DeviceSpec:
    torch_device = device.torch_device
    if torch_device.type == "cuda":
        # the preset of this GPU's model, the one whose memory is closest (A100 40 GB vs 80 GB)
        name = torch.cuda.get_device_name(torch_device).lower().replace(" ", "")
        memory = torch.cuda.get_device_properties(torch_device).total_memory
        matching = [spec for key, spec in PRESETS.items() if key.split("-")[0] in name] or [PRESETS["a100-80gb"]]
        return min(matching, key=lambda spec: abs(spec.memory - memory))
    return host_nominal(budget)
