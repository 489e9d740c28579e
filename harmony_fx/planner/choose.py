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
microbatch, and several devices form a pipeline. When cutting it only changes the random numbers
or the batch statistics (dropout draws per microbatch, BatchNorm normalises per microbatch), the
planner keeps one microbatch per device.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from harmony_fx.config import CompileOptions
from harmony_fx.analysis.random_ops import draws_random
from harmony_fx.planner.chain import Schedule
from harmony_fx.planner.profile import profile_graph
from harmony_fx.planner.search import PlanningError, search
from harmony_fx.planner.specs import PRESETS, DeviceSpec, HostSpec, host_nominal

__all__ = ["choose_schedules", "device_spec"]


def choose_schedules(gm: fx.GraphModule, model: nn.Module, batch_size: int, devices: list, budget: int | None,
                     options: CompileOptions, separable: bool = True, trainer: bool = False) -> tuple[Schedule, ...]:
    """The planner's schedules, best first, or none when it finds none; ``compile`` tries them in
    turn, then its defaults. ``separable``: the graph treats the samples apart
    (``analysis.batch_dims``); if not, the batch is never cut (one microbatch, several devices in a
    pipeline). ``trainer``: the loss is in the graph, so the forward may run larger microbatches
    than the backward (where the samples are apart and nothing random is drawn).

    After the fastest schedule come simpler ones, for when it cannot be captured or packed after
    all: the planner sees one graph, and export may capture another at a microbatch size (a
    ``contiguous`` that is a no-op on a size-1 dim disappears), so every microbatch size more is
    a risk: the same schedule without its larger forward microbatches and packs (which the
    search simulated too), then with microbatches of one size."""
    dtype = options.compute_dtype
    profile = profile_graph("model", gm, batch_size, None if dtype is None else dtype.itemsize, options.precision)
    microbatches = options.microbatches
    parallel = None if options.parallel == "auto" or len(devices) == 1 else options.parallel
    changes_results = _split_changes_results(gm, model)
    if microbatches is None and not separable:
        microbatches = 1
        if parallel is None and len(devices) > 1:
            parallel = "pp"
    elif microbatches is None and changes_results:
        microbatches = len(devices)
    try:
        choice = search(profile, device_spec(devices[0], budget), HostSpec(), batch_size=batch_size,
                        devices=len(devices), budget=budget, parallel=parallel, microbatches=microbatches,
                        simulate_top=3, all_devices=True,
                        forward_apart=trainer and separable and not changes_results, handoff=options.handoff)
    except PlanningError:
        return ()
    schedules = [choice.schedule]
    if choice.schedule.forward_microbatches or choice.schedule.forward_groups:
        schedules.append(dataclasses.replace(choice.schedule, forward_groups=(), forward_microbatches=None))
    if microbatches is None and batch_size % schedules[-1].microbatches:
        # more microbatches (less memory each), all of one size
        even = next(n for n in range(schedules[-1].microbatches + 1, batch_size + 1) if batch_size % n == 0)
        schedules.append(dataclasses.replace(schedules[-1], microbatches=even))
    return tuple(schedules)


def _split_changes_results(gm: fx.GraphModule, model: nn.Module) -> bool:
    random = any(draws_random(node) for node in gm.graph.nodes)
    batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())
    return random or batch_norm


def device_spec(device, budget: int | None) -> DeviceSpec:
    torch_device = device.torch_device
    if torch_device.type == "cuda":
        # the preset of this GPU's model, the one whose memory is closest (A100 40 GB vs 80 GB)
        name = torch.cuda.get_device_name(torch_device).lower().replace(" ", "")
        memory = torch.cuda.get_device_properties(torch_device).total_memory
        matching = [spec for key, spec in PRESETS.items() if key.split("-")[0] in name] or [PRESETS["a100-80gb"]]
        return min(matching, key=lambda spec: abs(spec.memory - memory))
    return host_nominal(budget)
