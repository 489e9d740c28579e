"""Devices: where packs run. One interface, two implementations.

* ``HostDevice``: a stand-in GPU in host memory. Its copies are clones, its streams run inline,
  and its memory account counts every tensor resident on it and every temporary of the running
  task (``ir.tracking.AllocationTracker``); going past the budget raises ``DeviceOutOfMemoryError``.
* ``CudaDevice``: a real GPU: non-blocking copies from/to pinned host memory on their own streams,
  events between streams, and ``torch.cuda.max_memory_allocated`` as the measured peak.

``resolve_devices`` turns the user's ``devices=`` option into devices.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from harmony_fx.config import format_size
from harmony_fx.ir.tracking import AllocationTracker
from harmony_fx.runtime.streams import ChaosStreams, CudaStreams, HostStreams

__all__ = ["Device", "HostDevice", "CudaDevice", "DeviceOutOfMemoryError", "resolve_devices"]


_HOST_RNG_LOCK = threading.RLock()


class DeviceOutOfMemoryError(RuntimeError):
    """A task needed more device memory than the budget allows."""


class Device:
    """What the executor needs from a device."""

    name: str
    budget: int | None
    streams: HostStreams | ChaosStreams | CudaStreams
    planned_peak: int | None = None  # the static peak of the program running here, if known
    # bytes a plan keeps free below the budget, for allocations its FakeTensor run cannot see
    margin: int = 0
    margin_note: str = ""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_scope(self):
        raise NotImplementedError

    def get_rng_state(self) -> object:
        raise NotImplementedError

    def set_rng_state(self, state: object) -> None:
        raise NotImplementedError

    def rng_lock(self):
        """Held while a pack that draws random numbers saves, replays or uses the RNG state."""
        return contextlib.nullcontext()

    def reset_peak(self) -> None:
        raise NotImplementedError

    def live_bytes(self) -> int:
        raise NotImplementedError

    def peak_bytes(self) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        budget = "unlimited" if self.budget is None else format_size(self.budget)
        return f"{type(self).__name__}({self.name!r}, budget={budget})"


class HostDevice(Device):
    """A GPU stand-in in host memory (see the module docstring)."""

    margin_note = ("none needed: a HostDevice counts the tensors the program holds, which the planning run "
                   "counts the same way; kernels' scratch space is not device memory here")

    def __init__(self, name: str = "host:0", budget: int | None = None, track_memory: bool = True,
                 chaos: int | None = None) -> None:
        """``chaos``: a seed; streams then run on worker threads with random delays."""
        self.name = name
        self.torch_device = torch.device("cpu")
        self.streams = HostStreams() if chaos is None else ChaosStreams(chaos)
        self.tracker = AllocationTracker(budget, self._out_of_memory)
        self.track_memory = track_memory
        self.context = ""  # what is running, for the out-of-memory message
        # the static peak of the program running here (set by the compiled module), for that message
        self.planned_peak: int | None = None

    @property
    def budget(self) -> int | None:
        return self.tracker.cap

    @budget.setter
    def budget(self, budget: int | None) -> None:
        self.tracker.cap = budget  # the account enforces whatever the budget is now

    def _out_of_memory(self, live: int, cap: int) -> None:
        planned = ""
        if self.planned_peak is not None:
            planned = f"; the plan's static peak here is {self.planned_peak:,} bytes"
            if self.planned_peak > cap:
                planned += (" (the budget was lowered below the plan after compiling: compile again under "
                            f"memory_budget={cap})")
        raise DeviceOutOfMemoryError(
            f"{self.name}: out of memory{self.context}: {live:,} bytes ({format_size(live)}) in use, budget "
            f"{cap:,} bytes ({format_size(cap)}){planned}. Give a larger memory_budget, or more microbatches so "
            "each task holds less."
        )

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        copy = host.detach().clone()
        return self.tracker.register(copy) if self.track_memory else copy

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach().clone()

    def compute_scope(self):
        return self.tracker.mode() if self.track_memory else contextlib.nullcontext()

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def rng_lock(self):
        # Every HostDevice draws from the one CPU generator: two devices' random packs must not
        # interleave, or a recompute would replay numbers another device drew in between.
        return _HOST_RNG_LOCK

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def live_bytes(self) -> int:
        return self.tracker.live

    def peak_bytes(self) -> int:
        return self.tracker.peak


class CudaDevice(Device):
    """A real GPU (see the module docstring)."""

    def __init__(self, name: str = "cuda:0", budget: int | None = None) -> None:
        self.name = name
        self.torch_device = torch.device(name)
        self.budget = budget if budget is not None else torch.cuda.get_device_properties(self.torch_device).total_memory
        self.streams = CudaStreams(self.torch_device)
        self._baseline = torch.cuda.memory_allocated(self.torch_device)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Runs on the h2d stream. The block is allocated in compute-stream order (where it will be
        used and freed), and the copy waits for that point."""
        with torch.cuda.stream(self.streams.compute):
            copy = torch.empty_like(host, device=self.torch_device)
            allocated = torch.cuda.Event()
            allocated.record()
        copy_stream = torch.cuda.current_stream(self.torch_device)
        copy_stream.wait_event(allocated)
        copy.copy_(host if host.is_pinned() else host.pin_memory(), non_blocking=True)
        copy.record_stream(copy_stream)
        return copy

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        """Runs on the d2h stream, into pinned memory."""
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value.detach(), non_blocking=True)
        value.record_stream(torch.cuda.current_stream(self.torch_device))
        return host

    def compute_scope(self):
        return torch.cuda.device(self.torch_device)

    def get_rng_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        # a pack may draw on the host's generator too (a CPU randperm in the model): keep both
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.torch_device)

    def set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        torch.set_rng_state(state[0])
        torch.cuda.set_rng_state(state[1], self.torch_device)

    def rng_lock(self):
        return _HOST_RNG_LOCK  # the host's generator is shared by every device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.torch_device)
        self._baseline = torch.cuda.memory_allocated(self.torch_device)
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device) - self._baseline

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device) - self._baseline


def resolve_devices(devices: object, budget: int | None, track_memory: bool = True,
                    chaos: int | None = None) -> list[Device]:
    """``None``: every CUDA GPU, else one HostDevice; an int N; or names ``cuda:i`` / ``host:i``."""
    if devices is None:
        count = torch.cuda.device_count()
        names = [f"cuda:{i}" for i in range(count)] or ["host:0"]
    elif isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        prefix = "cuda" if torch.cuda.is_available() else "host"
        names = [f"{prefix}:{i}" for i in range(devices)]
    elif isinstance(devices, (list, tuple)) and devices:
        names = [str(d) for d in devices]
    elif isinstance(devices, str):
        names = [devices]
    else:
        raise ValueError(f"devices must be None, an int, or a list like ['cuda:0', 'host:0'], got {devices!r}")
    result: list[Device] = []
    for name in names:
        kind, _, index = name.partition(":")
        if kind == "host" and (index == "" or index.isdigit()):
            seed = None if chaos is None else chaos + len(result)
            result.append(HostDevice(f"host:{index or 0}", budget, track_memory, seed))
        elif kind == "cuda" and (index == "" or index.isdigit()):
            if not torch.cuda.is_available() or int(index or 0) >= torch.cuda.device_count():
                raise ValueError(
                    f"unknown device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s). "
                    "Use 'host:0' for a GPU stand-in in host memory."
                )
            result.append(CudaDevice(f"cuda:{index or 0}", budget))
        else:
            raise ValueError(f"unknown device {name!r}: write 'cuda:N' for a GPU or 'host:N' for a HostDevice")
    return result
