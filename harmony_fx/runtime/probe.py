"""The FakeTensor planning run: one device's programs, alone, through the executor's own ops.

A ``Probe`` is a ``Runtime`` with nothing around it: what the host or another device would hold is
made when first read (``make(key)``, a FakeTensor of the key's shape), its links are
``StandaloneLinks`` (a peer's value is made when received, a send goes nowhere, other devices'
events are done), and each compute task's net and peak bytes are recorded on the way (the
planner's memory profile, ``task_memory``). ``run_programs`` also notes the device's high-water
mark after every action, so that the action after which the device first holds its peak can be
named (``compiler.estimate``). The live runtime has none of this: it runs what it is given.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from harmony_fx.ir.pack import Pack
from harmony_fx.ir.values import empty_fake
from harmony_fx.program.actions import Key
from harmony_fx.program.ops import OP_OF_KIND
from harmony_fx.runtime.devices import Device, HostDevice
from harmony_fx.runtime.executor import Runtime
from harmony_fx.runtime.host import Event, HostState
from harmony_fx.runtime.links import StandaloneLinks
from harmony_fx.runtime.stats import Stats

__all__ = ["Probe", "FakeHostDevice"]


class Probe(Runtime):
    """One device's programs run alone (see the module docstring); ``make(key)``: the value of
    ``key`` as the host holds it (the dtype the graph has for it), made when first read."""

    def __init__(self, packs_for_mb: Sequence[Sequence[Pack]], device: Device, host: HostState,
                 grad_inputs: Sequence[tuple[str, ...]], make: Callable[[Key], object], *,
                 compute_dtype: torch.dtype | None = None,
                 split_dims: Callable[[Key, Sequence[int]], Sequence] | None = None,
                 keeps_last_graph: bool = True) -> None:
        super().__init__(packs_for_mb, device, host, grad_inputs, Stats(), compute_dtype=compute_dtype,
                         split_dims=split_dims, keeps_last_graph=keeps_last_graph)
        self.host_values = _MadeOnDemand(make)
        self.links = StandaloneLinks(make)
        # (kind, pack, microbatch) -> (net bytes, peak bytes above the start) of each compute task
        self.task_memory: dict[tuple[str, int, int], tuple[int, int]] = {}
        self.peak_after_action: list[int] = []  # ``peak`` after each action, in program order
        self._tasks_peak = 0  # the device's peak across the per-task resets of ``_compute``

    @property
    def peak(self) -> int:
        """The device's peak so far (the per-task resets included)."""
        return max(self.device.peak_bytes(), self._tasks_peak)

    def run_programs(self, programs: Sequence[Callable[[object], None]]) -> None:
        """Run ``programs`` in order (generated programs, or anything that calls the runtime's ops
        as one would: ``program.codegen.run_actions``), noting ``peak`` after every action (a
        FakeTensor run on HostStreams: each op's work is done when it returns)."""
        traced = _PeakTrace(self)
        for program in programs:
            program(traced)

    def _compute(self, kind: str, pack_index: int, mb: int, task: Callable[[int, int], None]) -> Event:
        """The task, recording its net bytes and its peak above what was live when it started."""

        def probed(pack_index: int, mb: int) -> None:
            device = self.device
            self._tasks_peak = max(self._tasks_peak, device.peak_bytes())
            before = device.live_bytes()
            device.reset_peak()
            task(pack_index, mb)
            peak = device.peak_bytes()
            self._tasks_peak = max(self._tasks_peak, peak)
            self.task_memory[(kind, pack_index, mb)] = (device.live_bytes() - before, peak - before)

        return super()._compute(kind, pack_index, mb, probed)


class _MadeOnDemand(dict):
    """Host values of a standalone run: what other devices would have put on the host is made when
    first read."""

    def __init__(self, make: Callable[[Key], object]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: Key) -> object:
        value = self[key] = self._make(key)
        return value


class _PeakTrace:
    """The probe as a program sees it, noting ``probe.peak`` after every action."""

    _ACTION_OPS = frozenset(OP_OF_KIND.values())

    def __init__(self, probe: Probe) -> None:
        self._probe = probe

    def __getattr__(self, name: str):
        op = getattr(self._probe, name)
        if name not in self._ACTION_OPS:
            return op  # remote/publish: not actions of their own

        def traced(*args):
            result = op(*args)
            self._probe.peak_after_action.append(self._probe.peak)
            return result

        return traced


def _fresh_copy(value: torch.Tensor) -> torch.Tensor:
    """What ``value.detach().clone()`` gives, for a planning run: a new storage of the same layout
    (a dense value keeps its strides; another is cloned as it is)."""
    if isinstance(value, FakeTensor) and value.is_contiguous():
        return empty_fake(value.shape, value.stride(), value.dtype, value.device)
    return value.detach().clone()


class FakeHostDevice(HostDevice):
    """The planning run's device: a HostDevice counting every tensor, whose copies are made as new
    FakeTensors directly (``empty_fake``) rather than through the mode's ``clone``: the same
    storages and bytes, a fraction of the time."""

    def __init__(self, name: str, budget: int | None) -> None:
        super().__init__(name, budget, track_memory=True)

    def to_device(self, source: torch.Tensor, slot: object = None, read_only: bool = False) -> torch.Tensor:
        return self.tracker.register(_fresh_copy(source))

    def to_host(self, value: torch.Tensor, last_use: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        if self.landing_fits(into, value):
            return super().to_host(value, last_use, into)
        return _fresh_copy(value)
