"""The host's side of running a compiled model: the masters, the gradients that land beside them,
and the program events whose host work lands them.

``HostState`` lives as long as the session: each pack's masters (the tensors the device copies
read) and what copying them costs in bytes. ``HostGradients`` lives for one iteration: the weight
gradients the devices copied back, summed in an order that does not depend on the threads.
``GradientBuffers`` lives as long as a ``Trainer``: the tensors those copies land in, step after
step (one set of host gradients, not one per step). An
``Event`` is what a program's op returns: the device's (or a peer hand-over's) event, plus host
work to run once the copy has landed (adding the gradients in, writing BatchNorm statistics back);
``land`` is how an update worker waits for the copies it needs and runs that work.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Mapping, Sequence

import torch

from harmony_fx.ir.pack import Pack

__all__ = ["HostState", "HostGradients", "GradientBuffers", "Event", "FutureEvent", "DONE", "land", "grad_dtype"]


@dataclasses.dataclass
class HostState:
    """Host-side tensors of one compiled model: per pack, its masters (params then buffers)."""

    masters: list[list[torch.Tensor]]
    # the masters stay on the device that computes (``CompileOptions.resident_weights``): a weight
    # copy hands the master over, and a weight gradient stays where it was made
    resident: bool = False
    # per pack, the key of each master's gradient in ``HostGradients`` (its ``id``)
    grad_keys: list[list[int]] = dataclasses.field(init=False)
    # bytes of a pack's weights or weight gradients as copied (``stats.DeviceRecorder.count``): the
    # same every iteration, and summing a hundred tensors' sizes at every copy showed in a step's time
    copy_bytes: dict[tuple, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.grad_keys = [[id(master) for master in masters] for masters in self.masters]

    @classmethod
    def of(cls, packs: Sequence[Pack], masters: Mapping[str, torch.Tensor], resident: bool = False) -> "HostState":
        """Each pack's masters in the order its weight copies use: parameters, then buffers."""
        return cls([[masters[name] for name in pack.params + pack.buffers] for pack in packs], resident)


def grad_dtype(master: torch.Tensor) -> torch.dtype:
    """The dtype of ``master``'s gradient: its own, unless set apart (a parameter whose fp32 master
    is on the NVMe tier holds its bf16 copy, with fp32 gradients: ``runtime.tier``)."""
    return getattr(master, "grad_dtype", None) or master.dtype


class HostGradients:
    """Weight gradients summed on the host: per parameter (``id`` of its master), each device's
    copies summed in the order they land, then the devices' sums in device order when first read.
    The order of the sum is then the program's, not the threads' (a tied weight's shares from two
    packs on two devices add up to the same bits every run), and it is the order in which one
    process per device would sum them (``distributed``)."""

    def __init__(self) -> None:
        self._by_device: dict[int, dict[int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def add_all(self, keys: Sequence[int], grads: Sequence[torch.Tensor], device: int) -> None:
        """Each ``grads[i]`` added to ``keys[i]``'s (``keys`` may run on: a pack's masters), under one lock."""
        with self._lock:
            landed = self._by_device.setdefault(device, {})
            for key, grad in zip(keys, grads):
                existing = landed.get(key)
                landed[key] = grad if existing is None else existing.add_(grad)

    def get(self, key: int, default: torch.Tensor | None = None) -> torch.Tensor | None:
        with self._lock:
            got = self._summed([key])[0]
            return default if got is None else got

    def get_all(self, keys: Sequence[int]) -> list[torch.Tensor | None]:
        """``get`` of each key (``None`` where none landed), under one lock."""
        with self._lock:
            return self._summed(keys)

    def _summed(self, keys: Sequence[int]) -> list[torch.Tensor | None]:
        by_device = self._by_device
        if len(by_device) <= 1:  # one device: its sums as they are
            landed = next(iter(by_device.values()), {})
            return [landed.get(key) for key in keys]
        devices = sorted(by_device)
        first = by_device[devices[0]]
        totals = []
        for key in keys:
            total = first.get(key)
            for device in devices[1:]:
                part = by_device[device].pop(key, None)
                if part is not None:
                    total = part if total is None else total.add_(part)
            if total is not None:
                first[key] = total  # read again: summed once
            totals.append(total)
        return totals


class GradientBuffers:
    """The host tensors a Trainer's weight gradients land in, reused from step to step: each step's
    copy of a parameter's gradient is written into the tensor that held the last step's (its
    ``.grad``, which the update set), instead of a fresh one. The last step's gradients would
    otherwise stay alive (as ``.grad``) while this step's land, two sets of host memory (pinned on
    a GPU: ``CudaDevice.to_host``, the scarcest there is) where one does.

    Keyed as ``HostGradients`` (``id`` of the master). ``take_all`` hands each key's tensor to one
    copy a step (it leaves the pool: a tied weight's second share, or another device's, lands in a
    fresh tensor, and they are summed in ``HostGradients``' order, into either); ``keep`` puts back
    the summed gradient the update stepped with, which ``.grad`` holds until the next step writes
    into it. With one device that is the same tensor every step; with several, whichever share held
    the sum (one set still, the other shares freed once summed)."""

    def __init__(self) -> None:
        self._by_key: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # the devices' copy threads take, the update worker keeps

    def take_all(self, keys: Sequence[int]) -> list[torch.Tensor | None]:
        """Each key's tensor (``None`` where there is none: the first step, or one taken already)."""
        with self._lock:
            return [self._by_key.pop(key, None) for key in keys]

    def keep(self, key: int, grad: torch.Tensor) -> None:
        with self._lock:
            self._by_key[key] = grad

    def __len__(self) -> int:
        return len(self._by_key)


class Event:
    """A program's event: the device's (or a peer hand-over's) plus host work that runs once the
    copy has landed, exactly once, by whichever host wait comes first (a program's, or an update
    worker's; the others wait for it to finish)."""

    __slots__ = ("device_event", "on_host", "_lock")

    def __init__(self, device_event) -> None:
        self.device_event = device_event
        self.on_host: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def run_host_work(self) -> None:
        with self._lock:
            callbacks, self.on_host = self.on_host, []
            for callback in callbacks:
                callback()


class FutureEvent:
    """A host worker's future as a program's event (the NVMe tier's reads and writes): waiting for
    it re-raises the worker's error."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future

    def synchronize(self) -> None:
        self.future.result()


class _Done:
    """A device event that is already complete (``done``: what a chaos stream waits on)."""

    done = threading.Event()
    done.set()

    def synchronize(self) -> None:
        return None


DONE = _Done()


def land(copies: Sequence[Event]) -> float:
    """Wait on this thread until ``copies`` have landed, and run their host work (summing gradients
    into the host gradients): what an update worker does before it steps. Returns the seconds it
    waited for the NVMe tier's reads among them."""
    tier_waited = 0.0
    for copy in copies:
        if isinstance(copy.device_event, FutureEvent):
            started = time.perf_counter()
            copy.device_event.synchronize()
            tier_waited += time.perf_counter() - started
        else:
            copy.device_event.synchronize()
        copy.run_host_work()
    return tier_waited
