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
from typing import Sequence

import torch

from harmony_fx.config import CUDA_RESERVE_CAP, CUDA_RESERVE_FIXED, CUDA_RESERVE_FRACTION, cuda_reserve, format_size
from harmony_fx.ir.tracking import AllocationTracker
from harmony_fx.runtime.streams import ChaosStreams, CudaStreams, HostStreams

__all__ = ["Device", "HostDevice", "CudaDevice", "DeviceOutOfMemoryError", "StagingBuffers", "resolve_devices",
           "pinned_source", "visible_gpus"]


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
    context: object = ""  # the running task (its ``str``), for an out-of-memory message
    # reading the live bytes is cheap (a HostDevice's own count), so the timeline samples it after
    # every op; on a GPU it builds the allocator's statistics, so only after compute tasks
    cheap_live_bytes: bool = True

    @property
    def counts_memory(self) -> bool:
        """Whether ``live_bytes`` is the device's memory now (a HostDevice's only while it tracks
        every tensor): the timeline samples it only then."""
        return True

    def to_device(self, source: torch.Tensor, slot: object = None, read_only: bool = False) -> torch.Tensor:
        """A device copy of ``source`` (``slot``: the staging buffer it was read from, if any;
        ``read_only``: nothing writes the copy, so a device in host memory may hand ``source``)."""
        raise NotImplementedError

    def to_host(self, value: torch.Tensor, last_use: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of ``value`` (``last_use``: the device frees it next and never writes it
        again, so a device in host memory may hand ``value`` itself), written into ``into`` where
        that is a host tensor this device can copy into (``landing_fits``), else into a new one."""
        raise NotImplementedError

    def stage(self, slot: object, master: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """The host tensor a copy of the weight ``master`` reads, in the compute ``dtype``."""
        raise NotImplementedError

    def weights_to_device(self, pack_index: int, masters: Sequence[torch.Tensor],
                          dtypes: Sequence[torch.dtype] | None, written: frozenset[int],
                          params: int) -> list[torch.Tensor]:
        """A pack's weights on the device: each master staged in its dtype of ``dtypes`` (``None``:
        its own) and copied, read-only but for the slots in ``written`` (BatchNorm statistics, which
        the device updates); the copy of each of the first ``params`` (the parameters) records
        gradients where its master does."""
        return [self.to_device(self.stage((pack_index, slot), master, None if dtypes is None else dtypes[slot]),
                               (pack_index, slot),
                               read_only=slot not in written).requires_grad_(slot < params and master.requires_grad)
                for slot, master in enumerate(masters)]

    def resident_weights(self, masters: Sequence[torch.Tensor], written: frozenset[int],
                         params: int) -> list[torch.Tensor]:
        """A pack's weights where the masters already live on this device (resident weights): each
        master itself, recording gradients where it does, but a copy of each slot in ``written`` (a
        BatchNorm statistic), which the forward updates and the recompute must not update again."""
        return [self.to_device(master) if slot in written
                else master.detach().requires_grad_(slot < params and master.requires_grad)
                for slot, master in enumerate(masters)]

    def grads_to_host(self, grads: Sequence[torch.Tensor],
                      into: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Host copies of weight gradients the device frees next (``to_host(last_use=True)`` each),
        ``grads[i]`` into ``into[i]`` where it fits (the last step's gradient: ``GradientBuffers``)."""
        into = into if into is not None else [None] * len(grads)
        return [self.to_host(grad, last_use=True, into=buffer) for grad, buffer in zip(grads, into)]

    def landing_fits(self, into: torch.Tensor | None, value: torch.Tensor) -> bool:
        """Whether a copy of ``value`` may be written into the host tensor ``into``."""
        return (into is not None and into.device.type == "cpu" and into.shape == value.shape
                and into.dtype == value.dtype)

    def bind_thread(self) -> None:
        """Called by a controller thread before it issues this device's program."""

    def record_event(self) -> object:
        """On the current stream: an event a peer's copy waits for (``None``: work runs in order)."""
        return None

    def wait_event(self, event: object) -> None:
        """Make the current stream wait for a peer's ``record_event``."""

    def check_budget(self) -> None:
        """After a compute task: raise ``DeviceOutOfMemoryError`` if the device holds more than the budget."""

    def out_of_memory(self, error: BaseException) -> DeviceOutOfMemoryError:
        """The error to raise for the framework's own out-of-memory ``error``."""
        return DeviceOutOfMemoryError(f"{out_of_memory_message(self, self.live_bytes(), self.budget or 0)} "
                                      f"({str(error).splitlines()[0]})")

    def memory_peaks(self) -> dict[str, int]:
        """The device's peaks since ``reset_peak`` by kind (a GPU's allocator keeps several)."""
        return {"allocated": self.peak_bytes()}

    def pinned_bytes(self) -> int:
        """Host memory pinned for this device's copies."""
        return 0

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


def out_of_memory_message(device: Device, live: int, cap: int) -> str:
    planned = ""
    if device.planned_peak is not None:
        planned = f"; the plan's static peak here is {device.planned_peak:,} bytes"
        if device.planned_peak > cap:
            planned += (" (the budget was lowered below the plan after compiling: compile again under "
                        f"memory_budget={cap})")
    return (f"{device.name}: out of memory{getattr(device, 'context', '')}: {live:,} bytes ({format_size(live)}) "
            f"in use, budget {cap:,} bytes ({format_size(cap)}){planned}. Give a larger memory_budget, or more "
            "microbatches so each task holds less.")


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
        self.staging = StagingBuffers(pin=False)
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
        raise DeviceOutOfMemoryError(out_of_memory_message(self, live, cap))

    def stage(self, slot: object, master: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        if dtype is None or not master.is_floating_point() or master.dtype == dtype:
            return master
        return self.staging.stage(slot, master, dtype)  # the cast, into a buffer reused every iteration

    def to_device(self, source: torch.Tensor, slot: object = None, read_only: bool = False) -> torch.Tensor:
        if read_only and self.shares_host_memory:
            return source.detach()
        copy = source.detach().clone()
        return self.tracker.register(copy) if self.track_memory else copy

    def to_host(self, value: torch.Tensor, last_use: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        if last_use and self.shares_host_memory:
            return value.detach()
        return into.copy_(value.detach()) if self.landing_fits(into, value) else value.detach().clone()

    def resident_weights(self, masters: Sequence[torch.Tensor], written: frozenset[int],
                         params: int) -> list[torch.Tensor]:
        if self.track_memory:
            # there before the program, as a GPU's baseline: a view of one (a weight's ``t()``) would
            # otherwise count its storage as the program's, for as long as the model lives
            for master in masters:
                self.tracker.register(master, nbytes=0)
        return super().resident_weights(masters, written, params)

    # one check for a pack's tensors, not one per tensor: these run for every weight every step
    def weights_to_device(self, pack_index: int, masters: Sequence[torch.Tensor],
                          dtypes: Sequence[torch.dtype] | None, written: frozenset[int],
                          params: int) -> list[torch.Tensor]:
        if dtypes is None and not written and self.shares_host_memory:
            return ([master.detach().requires_grad_(master.requires_grad) for master in masters[:params]]
                    + [master.detach() for master in masters[params:]])
        return super().weights_to_device(pack_index, masters, dtypes, written, params)

    def grads_to_host(self, grads: Sequence[torch.Tensor],
                      into: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        if self.shares_host_memory:
            # handed over, no copy: the device frees them next (``into``, the last step's, goes
            # once the update replaces ``.grad``: one set still, and no copy made)
            return list(grads)
        return super().grads_to_host(grads, into)

    @property
    def shares_host_memory(self) -> bool:
        """Without its account or chaos streams, this device's memory is the host's: a weight it only
        reads, or a gradient it hands over and frees, need no copy. (With the account on, every copy
        is counted as a GPU's would be; with chaos streams, a copy made too early shows as a wrong
        number.)"""
        return not self.track_memory and isinstance(self.streams, HostStreams)

    def compute_scope(self):
        return self.tracker.mode() if self.track_memory else contextlib.nullcontext()

    @property
    def counts_memory(self) -> bool:
        return self.track_memory

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


def visible_gpus() -> int:
    """How many GPUs ``devices=None`` takes (the test suite pins its unmarked tests to 0)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class CudaDevice(Device):
    """A real GPU (see the module docstring)."""

    margin_note = ("kept for cuBLAS/cuDNN workspaces, the caching allocator's rounding and fragmentation: "
                   f"{format_size(CUDA_RESERVE_FIXED)} + {CUDA_RESERVE_FRACTION:.0%} of the budget, at most "
                   f"{CUDA_RESERVE_CAP:.0%} of it")

    def __init__(self, name: str = "cuda:0", budget: int | None = None, account: "GpuAccount | None" = None) -> None:
        self.name = name
        self.torch_device = torch.device(name)
        if budget is None:
            budget = default_cuda_budget(self.torch_device)
        self.budget = budget
        self.margin = cuda_reserve(budget)
        self.streams = CudaStreams(self.torch_device)
        self.staging = StagingBuffers(pin=True)
        self.cheap_live_bytes = False
        # the caching allocator counts per GPU: every device on this GPU shares one account
        self.account = account if account is not None else GpuAccount(self.torch_device)
        self.account.add(self)

    def bind_thread(self) -> None:
        """Called by a controller thread before it issues this device's program: its workspaces
        are taken on its first call and counted with the baseline."""
        torch.cuda.set_device(self.torch_device)
        self.account.warm_up(self.streams.compute)

    def record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    def wait_event(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(event)

    def stage(self, slot: object, master: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """The host tensor a weight copy reads: the master itself when it is pinned and of the
        dtype it is staged in, else its reused pinned buffer, refreshed in one pass (cast included)."""
        dtype = dtype if dtype is not None and master.is_floating_point() else master.dtype
        if master.is_pinned() and master.dtype == dtype:
            return master
        return self.staging.stage(slot, master, dtype)

    def to_device(self, source: torch.Tensor, slot: object = None, read_only: bool = False) -> torch.Tensor:
        """Runs on the h2d (or peer) stream. The block is allocated in compute-stream order (where
        it will be used and freed), and the copy waits for that point. A host source is copied
        from pinned memory; a tensor already on a GPU (an input, a peer's value) directly."""
        source = source.detach()
        with torch.cuda.stream(self.streams.compute):
            copy = torch.empty_like(source, device=self.torch_device)
            allocated = torch.cuda.Event()
            allocated.record()
        copy_stream = torch.cuda.current_stream(self.torch_device)
        copy_stream.wait_event(allocated)
        copy.copy_(pinned_source(source), non_blocking=True)
        if slot is not None:
            self.staging.in_use(slot, copy_stream)
        if source.is_cuda:
            # a peer's value (or a caller's input): its owner may free it once this copy is issued,
            # so its block must not be reused before this stream has read it
            source.record_stream(copy_stream)
        # No record_stream on the copy: the program frees it only after the compute stream waited for it.
        return copy

    def to_host(self, value: torch.Tensor, last_use: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        """Runs on the d2h stream, into pinned memory: ``into`` where it fits (pinned, a weight
        gradient's buffer of the last step, which nothing reads until this copy has landed), else a
        new pinned tensor. No record_stream: the program frees the device value only after the
        compute stream waited for this copy."""
        host = into if self.landing_fits(into, value) else torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value.detach(), non_blocking=True)
        return host

    def landing_fits(self, into: torch.Tensor | None, value: torch.Tensor) -> bool:
        # a pageable tensor would make the copy synchronous (and slow): a new pinned one instead
        return super().landing_fits(into, value) and into.is_pinned()

    def compute_scope(self):
        return torch.cuda.device(self.torch_device)

    def check_budget(self) -> None:
        """After a compute task: the allocator holds no more than the budget for our tensors (on a
        GPU that several devices share, no more than their budgets together)."""
        live = self.live_bytes()
        if self.account.budget is not None and live > self.account.budget:
            raise DeviceOutOfMemoryError(out_of_memory_message(self, live, self.account.budget))

    def get_rng_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        # a pack may draw on the host's generator too (a CPU randperm in the model): keep both
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.torch_device)

    def set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        torch.set_rng_state(state[0])
        torch.cuda.set_rng_state(state[1], self.torch_device)

    def rng_lock(self):
        return _HOST_RNG_LOCK  # the host's generator is shared by every device

    def reset_peak(self) -> None:
        self.account.reset_peak()

    def live_bytes(self) -> int:
        return self.account.live_bytes()

    def peak_bytes(self) -> int:
        return self.account.peak_bytes()

    def memory_peaks(self) -> dict[str, int]:
        return self.account.memory_peaks()

    def pinned_bytes(self) -> int:
        """Host memory pinned by torch's pinned allocator (masters, staging, offloaded copies)."""
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def default_cuda_budget(device: torch.device) -> int:
    """What is free on the GPU now (not the card's size), and no more than the process may reserve
    under ``torch.cuda.set_per_process_memory_fraction``, less what it has reserved already."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
    return min(free, int(fraction * total) - torch.cuda.memory_reserved(device))


class GpuAccount:
    """The bytes of one physical GPU, which every ``CudaDevice`` on it shares: the caching allocator
    counts per GPU, so two devices on one GPU (``devices=["cuda:0", "cuda:0"]``) each see both's
    tensors. One baseline, one peak reset, and one budget, their budgets' sum (``None`` if any is
    unlimited); each device reports the GPU's figures."""

    def __init__(self, torch_device: torch.device) -> None:
        self.torch_device = torch_device
        self.index = torch_device.index or 0
        self.budgets: list[int | None] = []
        self._warmed: set[tuple] = set()  # the (thread, stream) pairs whose workspaces are taken
        self.baseline = self.requested_baseline = 0
        self.warm_up(None)
        self.reset_peak()

    def add(self, device: "CudaDevice") -> None:
        self.budgets.append(device.budget)

    @property
    def budget(self) -> int | None:
        return None if None in self.budgets else sum(self.budgets)

    def warm_up(self, stream) -> None:
        """Take now, once per thread and stream, what the first matmul allocates through the caching
        allocator and keeps: cuBLAS's and cuBLASLt's workspaces (a Linear with a bias takes the Lt
        path) for this thread on ``stream`` (``None``: the current one), and, through a backward,
        those of autograd's device thread. They are added to the baseline, not charged as a task's
        bytes, which a small budget would refuse."""
        key = (threading.get_ident(), None if stream is None else id(stream))
        if key in self._warmed:
            return
        self._warmed.add(key)
        device = self.torch_device
        before, requested = torch.cuda.memory_allocated(device), self._requested()
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.enable_grad():
            weight = torch.ones(8, 8, device=device, requires_grad=True)
            bias = torch.zeros(8, device=device, requires_grad=True)
            torch.nn.functional.linear(torch.ones(4, 8, device=device), weight, bias).sum().backward()
            del weight, bias
        torch.cuda.synchronize(device)
        self.baseline += torch.cuda.memory_allocated(device) - before
        self.requested_baseline += self._requested() - requested

    def _requested(self) -> int:
        return torch.cuda.memory_stats(self.torch_device).get("requested_bytes.all.current", 0)

    def reset_peak(self) -> None:
        # no synchronize: the caching allocator counts at allocation and free, on the host
        self.baseline = torch.cuda.memory_allocated(self.torch_device)
        self.requested_baseline = self._requested()
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def live_bytes(self) -> int:
        # read after every compute task: the allocator's nested stats, without the flattening into
        # one dict of every figure that ``memory_allocated`` does in Python (~0.1 ms a call)
        return torch._C._cuda_memoryStats(self.index)["allocated_bytes"]["all"]["current"] - self.baseline

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device) - self.baseline

    def memory_peaks(self) -> dict[str, int]:
        """Peaks since ``reset_peak``, as the caching allocator counts them: ``allocated`` (blocks
        handed out, rounded) and ``requested`` (the bytes asked for), both above what was there
        before (the budget's terms), and ``reserved`` (all the process holds from CUDA)."""
        stats = torch.cuda.memory_stats(self.torch_device)
        return {"allocated": stats.get("allocated_bytes.all.peak", 0) - self.baseline,
                "requested": stats.get("requested_bytes.all.peak", 0) - self.requested_baseline,
                "reserved": stats.get("reserved_bytes.all.peak", 0)}


def pinned_source(source: torch.Tensor) -> torch.Tensor:
    """What a host-to-device copy reads: a GPU tensor as it is (CUDA refuses to pin it, and a
    device-to-device copy needs no staging), a pinned host tensor as it is, a pageable one pinned."""
    if source.device.type != "cpu" or source.is_pinned():
        return source
    return source.pin_memory()


class StagingBuffers:
    """One reused host buffer per slot (a pack's weight, in the compute dtype), pinned on a GPU:
    allocated (and pinned) once, refreshed by each copy, and never overwritten while a copy from
    it may still be running (``in_use`` records the stream that reads it)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        # a fresh buffer for every slot staged while set: a call waiting for its backward may have
        # saved the last one (a HostDevice hands its buffer to the pack), whose copy_ would change it
        self.fresh = False
        self.allocations = 0  # buffers allocated so far (each once)
        self.nbytes = 0
        self._buffers: dict[object, torch.Tensor] = {}
        self._readers: dict[object, object] = {}  # slot -> event of the last copy reading it

    def stage(self, slot: object, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != dtype or self.fresh:
            buffer = torch.empty(source.shape, dtype=dtype, pin_memory=self.pin)
            self._buffers[slot] = buffer
            self.allocations += 1
            self.nbytes += buffer.numel() * buffer.element_size()
        reader = self._readers.pop(slot, None)
        if reader is not None:
            reader.synchronize()  # the last copy from this buffer has finished reading it
        buffer.copy_(source.detach())
        return buffer

    def in_use(self, slot: object, stream) -> None:
        if slot in self._buffers and self.pin:
            event = torch.cuda.Event()
            event.record(stream)
            self._readers[slot] = event


def resolve_devices(devices: object, budget: int | None, track_memory: bool = True,
                    chaos: int | None = None) -> list[Device]:
    """``None``: every CUDA GPU, else one HostDevice; an int N; or names ``cuda:i`` / ``host:i``."""
    if devices is None:
        names = [f"cuda:{i}" for i in range(visible_gpus())] or ["host:0"]
    elif isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        prefix = "cuda" if visible_gpus() else "host"
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
            if any(d.name == f"host:{index or 0}" for d in result):
                raise ValueError(f"{name!r} is named twice: each HostDevice stands for a GPU of its own, with its own "
                                 "budget; name them host:0, host:1, ... (several devices on one GPU are cuda:0 twice, "
                                 "which share its budget)")
            seed = None if chaos is None else chaos + len(result)
            result.append(HostDevice(f"host:{index or 0}", budget, track_memory, seed))
        elif kind == "cuda" and (index == "" or index.isdigit()):
            if not torch.cuda.is_available() or int(index or 0) >= torch.cuda.device_count():
                raise ValueError(
                    f"unknown device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s). "
                    "Use 'host:0' for a GPU stand-in in host memory."
                )
            gpu = int(index or 0)
            shared = next((d.account for d in result if isinstance(d, CudaDevice) and d.torch_device.index == gpu), None)
            result.append(CudaDevice(f"cuda:{gpu}", budget, shared))
        else:
            raise ValueError(f"unknown device {name!r}: write 'cuda:N' for a GPU or 'host:N' for a HostDevice")
    return result
