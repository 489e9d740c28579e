"""A device's static peak: its programs run on FakeTensors through the real executor.

No formula: the forward and backward programs of one device run on a HostDevice that tracks memory
exactly as the runtime does (``ir.tracking``), with FakeTensors in place of every value, so the
peak it reaches is the peak the real run will reach. Each compute task's net and peak bytes are
recorded on the way (the planner's memory profile), and the action after which the device first
holds its peak (what ``check_peak`` names).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
from torch._subclasses import FakeTensorMode

from harmony_fx.compiler.shapes import Shapes, fake_like
from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.tasks import ProgramSignature, grad_inputs
from harmony_fx.program.actions import Action, Key, KeyKind
from harmony_fx.program.codegen import generate_program
from harmony_fx.program.ops import OP_OF_KIND
from harmony_fx.runtime.devices import HostDevice
from harmony_fx.runtime.executor import HostState, Runtime, Stats

__all__ = ["DeviceEstimate", "estimate_device", "host_state"]


@dataclasses.dataclass(frozen=True)
class DeviceEstimate:
    peak: int
    # (kind, pack, microbatch) -> (net bytes, peak bytes above the start) of each compute task
    task_memory: dict[tuple[str, int, int], tuple[int, int]]
    # (index in forward + backward, action) after which the program first holds its peak
    peak_at: tuple[int, Action] | None


def host_state(packs: Sequence[Pack], masters: Mapping[str, torch.Tensor]) -> HostState:
    """Each pack's masters in the order its weight copies use: parameters, then buffers."""
    return HostState([[masters[name] for name in pack.params + pack.buffers] for pack in packs])


def estimate_device(forward: Sequence[Action], backward: Sequence[Action], microbatches: Sequence[int],
                    packs_by_size: Mapping[int | None, Sequence[Pack]], shapes: Shapes, signature: ProgramSignature,
                    target: torch.device) -> DeviceEstimate:
    """Run one device's ``forward`` and ``backward`` programs (over its ``microbatches``) on
    FakeTensors placed on ``target``, the device the packs run on."""
    forward, backward = list(forward), list(backward)
    packs = packs_by_size[shapes.mb_sizes[0]]
    device = HostDevice("fake", None)
    programs = [generate_program(actions, [""] * len(actions), "Fake") for actions in (forward, backward)]
    task_memory: dict[tuple[str, int, int], tuple[int, int]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), torch.random.fork_rng(devices=[]):
        fake_masters = {name: fake_like(t, target) for name, t in shapes.masters.items()}
        runtime = Runtime([packs_by_size[size] for size in shapes.mb_sizes], device, host_state(packs, fake_masters),
                          [grad_inputs(pack, signature) for pack in packs], Stats(),
                          compute_dtype=shapes.compute_dtype, standalone=lambda key: shapes.fake_value(key, target),
                          task_memory=task_memory, split_dims=shapes.split_dims,
                          keeps_last_graph=not signature.forward_only)
        for mb in microbatches:
            for name in signature.model_inputs:
                key = Key(KeyKind.ACT, name, mb)
                runtime.host_values[key] = shapes.fake_value(key, target)
            for name in signature.model_outputs:
                if name in signature.differentiable:
                    key = Key(KeyKind.GRAD, name, mb)
                    runtime.host_values[key] = shapes.fake_value(key, target)
        traced = _PeakTrace(runtime)
        programs[0](traced)
        programs[1](traced)
    peak = max(device.peak_bytes(), runtime.probe_peak)
    first = next((i for i, seen in enumerate(traced.peaks) if seen >= peak), None)
    actions = forward + backward
    return DeviceEstimate(peak, task_memory, None if first is None else (first, actions[first]))


class _PeakTrace:
    """The runtime as a program sees it, recording the device's high-water mark after every
    action (a FakeTensor run on HostStreams: each op's work is done when it returns)."""

    _ACTION_OPS = frozenset(OP_OF_KIND.values())

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.peaks: list[int] = []  # one entry per action, in program order

    def __getattr__(self, name: str):
        op = getattr(self._runtime, name)
        if name not in self._ACTION_OPS:
            return op  # remote/publish: not actions of their own

        def traced(*args):
            result = op(*args)
            runtime = self._runtime
            # the per-task probes reset the device's peak: their running maximum is kept aside
            self.peaks.append(max(runtime.device.peak_bytes(), runtime.probe_peak))
            return result

        return traced
