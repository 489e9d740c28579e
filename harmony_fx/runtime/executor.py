"""The executor: the runtime object ``rt`` that generated programs call (the harmony ops).

One ``Runtime`` drives one device through one iteration: ``run(forward_program)`` then, if
gradients are wanted, ``run(backward_program)``. Device values live in ``self.device_values`` under
schedule ``Key``s; host values (stash, outputs, gradients for the caller) in ``self.host_values``.
Work that must happen on the host once a copy has landed (writing BatchNorm statistics back to the
master buffers, summing weight gradients of tied parameters) is attached to the copy's event and
runs at the program's ``HOST`` wait for it.

Counters: bytes per direction and key kind (``Stats``) and the device's measured peak.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Callable, Sequence

import torch
from torch import fx

from harmony_fx.ir.pack import Pack
from harmony_fx.ir import values as pytrees
from harmony_fx.ir.tracking import storage_key
from harmony_fx.runtime import ambient
from harmony_fx.runtime.devices import Device
from harmony_fx.runtime.direct import direct_forward
from harmony_fx.runtime.inductor import PackCompiler
from harmony_fx.program.actions import Key, KeyKind, Stream, parse_key

__all__ = ["Runtime", "Stats", "HostState", "land"]


@dataclasses.dataclass
class Stats:
    """Measured over the last iteration (forward + backward)."""

    # per device (its index in the iteration): its name, and bytes moved by (direction, key kind).
    # Each device's runtime writes only its own counters, and each of its copy streams only its
    # own direction's keys, so counting takes no lock.
    device_names: dict[int, str] = dataclasses.field(default_factory=dict)
    moved: dict[int, collections.Counter] = dataclasses.field(default_factory=dict)
    # whether spans and memory samples are recorded (``compile(timeline=True)``,
    # ``record_timeline()``): off, a task costs no bookkeeping at all
    recording: bool = False
    peak_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # per device, the peaks its allocator keeps apart (a GPU: allocated, requested, reserved)
    memory_peaks: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    pinned_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # host memory pinned for copies
    budget: dict[str, int | None] = dataclasses.field(default_factory=dict)
    # the host optimizer's time (Trainer), and the part of it the iteration waited for at its end
    update_seconds: float = 0.0
    update_exposed_seconds: float = 0.0
    # bytes this process sent to other processes (Trainer across servers), per collective
    network_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # the time the issuing threads spent handing updates to the host optimizer
    handoff_seconds: float = 0.0
    # the NVMe tier (Trainer(nvme_path=...)): bytes read and written, the reader's and writer's busy time, and
    # the time the updates waited for state the tier had not read yet (the last step's commit included)
    tier_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    tier_seconds: float = 0.0
    tier_wait_seconds: float = 0.0
    tier_staged_peak: int = 0  # the most state bytes in host memory on the tier's way at once
    origin: float = dataclasses.field(default_factory=time.perf_counter)  # the iteration's start
    # per device: its clock (the streams), the clock's mark at the iteration's start and that mark's
    # host time, and per op (stream, label, start mark, end mark, live bytes after it or None).
    # Marks are the device's own: host seconds on a HostDevice, CUDA timing events on a GPU, so a
    # GPU's spans are its own time, not the host's issue time. They are read into seconds on first
    # use (``spans``), once the work has run, never on the issuing path.
    clocks: dict[int, tuple[object, object, float]] = dataclasses.field(default_factory=dict)
    marks: dict[int, list[tuple[str, str, object, object, int | None]]] = dataclasses.field(default_factory=dict)
    _resolved: tuple | None = dataclasses.field(default=None, repr=False)

    def _timeline(self) -> tuple[list[tuple[int, str, str, float, float]], dict[int, list[tuple[float, int]]]]:
        size = sum(len(entries) for entries in self.marks.values())
        if self._resolved is None or self._resolved[0] != size:
            spans: list[tuple[int, str, str, float, float]] = []
            memory: dict[int, list[tuple[float, int]]] = {}
            for index, entries in sorted(self.marks.items()):
                clock, origin, at = self.clocks[index]
                offset = at - self.origin
                for stream, label, start, end, live in list(entries):
                    started = offset + clock.seconds(origin, start)
                    ended = offset + clock.seconds(origin, end)
                    spans.append((index, stream, label, started, ended))
                    if live is not None:
                        memory.setdefault(index, []).append((ended, live))
            for timeline in memory.values():
                timeline.sort()
            self._resolved = (size, spans, memory)
        return self._resolved[1], self._resolved[2]

    @property
    def spans(self) -> list[tuple[int, str, str, float, float]]:
        """The measured timeline: (device index, stream, label, start s, end s) per op, from the
        iteration's start."""
        return self._timeline()[0]

    @property
    def memory(self) -> dict[int, list[tuple[float, int]]]:
        """Per device, (time s, bytes live) after each op that samples memory."""
        return self._timeline()[1]

    @property
    def busy_seconds(self) -> dict[str, float]:
        """Seconds each stream was busy (summed over devices), by the device's own clock; ``host``
        is the issuing threads' time handing updates to the optimizer."""
        busy: dict[str, float] = collections.defaultdict(float)
        for _, stream, _, started, ended in self.spans:
            busy[stream] += ended - started
        if self.handoff_seconds:
            busy[Stream.HOST.value] += self.handoff_seconds
        return busy

    @property
    def bytes_by_kind(self) -> dict[tuple[str, str], int]:
        total: collections.Counter = collections.Counter()
        for counts in self.moved.values():
            total.update(counts)
        return dict(total)

    @property
    def bytes_by_device(self) -> dict[tuple[str, str, str], int]:
        return {(self.device_names[index], direction, kind): n for index, counts in self.moved.items()
                for (direction, kind), n in counts.items()}

    @property
    def bytes_h2d(self) -> int:
        return sum(n for (direction, _), n in self.bytes_by_kind.items() if direction == Stream.H2D.value)

    @property
    def bytes_d2h(self) -> int:
        return sum(n for (direction, _), n in self.bytes_by_kind.items() if direction == Stream.D2H.value)

    def as_dict(self) -> dict:
        return {
            "bytes_h2d": self.bytes_h2d,
            "bytes_d2h": self.bytes_d2h,
            "bytes_by_kind": {f"{d}/{k}": n for (d, k), n in sorted(self.bytes_by_kind.items())},
            "bytes_by_device": {f"{dev} {d}/{k}": n for (dev, d, k), n in sorted(self.bytes_by_device.items())},
            "peak_bytes": dict(self.peak_bytes),
            "memory_peaks": {name: dict(peaks) for name, peaks in self.memory_peaks.items()},
            "pinned_bytes": dict(self.pinned_bytes),
            "budget": dict(self.budget),
            "busy_seconds": dict(self.busy_seconds),
            "update_seconds": self.update_seconds,
            "update_exposed_seconds": self.update_exposed_seconds,
            "network_bytes": dict(self.network_bytes),
        }


@dataclasses.dataclass
class HostState:
    """Host-side tensors of one compiled model: per pack, its masters (params then buffers)."""

    masters: list[list[torch.Tensor]]
    # per pack, the key of each master's gradient in ``HostGradients`` (its ``id``)
    grad_keys: list[list[int]] = dataclasses.field(init=False)
    # bytes of a pack's weights or weight gradients as copied (``Runtime._count``): the same every
    # iteration, and summing a hundred tensors' sizes at every copy showed in a step's time
    copy_bytes: dict[tuple, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.grad_keys = [[id(master) for master in masters] for masters in self.masters]


def land(copies: Sequence["_Event"]) -> float:
    """Wait on this thread until ``copies`` have landed, and run their host work (summing gradients
    into ``host_grads``): what an update worker does before it steps. Returns the seconds it
    waited for the NVMe tier's reads among them."""
    tier_waited = 0.0
    for copy in copies:
        if isinstance(copy.device_event, _Waited):
            started = time.perf_counter()
            copy.device_event.synchronize()
            tier_waited += time.perf_counter() - started
        else:
            copy.device_event.synchronize()
        copy.run_host_work()
    return tier_waited


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


class _Event:
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


class _Waited:
    """A host worker's future as a program's event: waiting for it re-raises the worker's error."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future

    def synchronize(self) -> None:
        self.future.result()


class Runtime:
    """``rt`` in the generated programs (implements ``ir.ops.HarmonyOps``); one per iteration."""

    def __init__(self, packs_for_mb: Sequence[Sequence[Pack]], device: Device, host: HostState,
                 grad_inputs: Sequence[tuple[str, ...]], stats: Stats,
                 on_update: Callable[["Runtime", int, Sequence["_Event"]], None] | None = None,
                 compute_dtype: torch.dtype | None = None, shared: "Runtime | None" = None, index: int = 0,
                 standalone: Callable[[Key], object] | None = None,
                 task_memory: dict[tuple[str, int, int], tuple[int, int]] | None = None,
                 compiler: "PackCompiler | None" = None,
                 split_dims: Callable[[Key, Sequence[int]], Sequence] | None = None,
                 on_tier: Callable[["Runtime", str, int], object] | None = None, keeps_last_graph: bool = True) -> None:
        """``packs_for_mb[mb]``: the packs compiled at microbatch ``mb``'s size (same boundaries and
        names for every size). ``on_update(runtime, pack)``: the host's optimizer step for the parameters
        whose gradients are complete after ``pack``'s backward. ``shared``: another device's runtime of
        the same iteration, whose host side (inputs, stash, host gradients) this one shares; ``index``:
        this device's number among them (what ``send``/``recv`` name as peers).

        ``standalone(key)``: this runtime runs one device's program alone (the FakeTensor planning
        run): what the host or another device would hold is made by it when first read, and other
        devices' events count as done. ``task_memory``: filled with each compute task's net and
        peak bytes (see ``_probed``). ``split_dims(key, parts)``: how ``SPLIT`` cuts a key
        (``compiler.shapes.Shapes.split_dims``). ``on_tier(runtime, "read" | "write", pack)``: hands
        a ``READ``/``WRITE`` of a pack's optimizer state to the tier's reader and writer and returns what to
        wait on (a ``concurrent.futures.Future``). ``keeps_last_graph``: the last pack's forward
        keeps its graph for the backward (``False``: a forward-only program, with no backward).

        The autocast state current on the constructing thread is the one every forward and
        recompute of this iteration runs under (``runtime.ambient``)."""
        self.autocast = ambient.Autocast.current()
        self.keeps_last_graph = keeps_last_graph
        self.packs_for_mb = packs_for_mb
        self.packs = packs_for_mb[0]
        self.on_update = on_update
        self.on_tier = on_tier
        self.compute_dtype = compute_dtype
        self.device = device
        self.host = host
        self.grad_inputs = grad_inputs
        self.stats = stats
        self.last = len(self.packs) - 1
        self.device_values: dict[Key, object] = {}
        if shared is None:
            self.host_values: dict[Key, object] = {} if standalone is None else _MadeOnDemand(standalone)
            self.host_grads = HostGradients()  # id(master) -> summed gradient
            self._host_lock = threading.Lock()
            self._stats_lock = threading.Lock()
            self.links = _Links()
            # (pack, microbatch) -> RNG state before its forward; the recompute may run elsewhere
            self.rng_states: dict[tuple[int, int], torch.Tensor] = {}
        else:
            self.host_values, self.host_grads = shared.host_values, shared.host_grads
            self._host_lock, self._stats_lock = shared._host_lock, shared._stats_lock
            self.links = shared.links
            self.rng_states = shared.rng_states
        self.index = index  # this device's number in the iteration
        stats.device_names[index] = device.name
        self.moved = stats.moved.setdefault(index, collections.Counter())
        self._marks = None  # this device's timeline entries, when the timeline is recorded
        if stats.recording:
            stats.clocks[index] = (device.streams, device.streams.mark(Stream.COMPUTE), time.perf_counter())
            self._marks = stats.marks.setdefault(index, [])
        self.peer_value = standalone
        self.task_memory = task_memory
        self.compiler = compiler  # packs compiled by inductor (``compile_packs``), else run as graphs
        self.split_dims = split_dims
        self.probe_peak = 0  # the device's peak across the per-task resets of ``_probed``

    # ------------------------------------------------------------------ running programs
    def run(self, program: fx.GraphModule) -> None:
        """Issue every op of ``program``, then wait until the device's streams ran them all (and
        raise the first error any of them hit)."""
        try:
            program(self)
        finally:
            self.device.streams.end_program()

    def release(self) -> None:
        """Drop everything the device still holds (after a forward that needs no backward, or an
        error)."""
        try:
            self.device.streams.synchronize()
        except BaseException:  # noqa: BLE001 - the error that got us here is already on its way up
            pass
        self.device_values.clear()
        self.links.drop_values()  # what a failed iteration sent and no peer picked up

    def key(self, text: str) -> Key:
        return parse_key(text)  # cached: programs name the same keys every iteration

    def _submit(self, stream: Stream, work: Callable[[], None], event: "_Event | None" = None,
                label: str = "", *label_args: object) -> "_Event":
        """Run ``work`` on ``stream`` (inline, on a stream thread, or issued to the GPU); when the
        timeline is recorded, timed, with the span (``label.format(*label_args)``, formatted only
        then) and the device's memory after it going to the measured timeline (``Stats.spans``)."""
        event = event or _Event(None)
        entries = self._marks
        if entries is None:
            event.device_event = self.device.streams.submit(stream, work)
            return event
        clock = self.device.streams

        def timed() -> None:
            started = clock.mark()
            try:
                work()
            finally:
                ended = clock.mark()
                device = self.device
                live = device.live_bytes() if device.cheap_live_bytes or stream == Stream.COMPUTE else None
                entries.append((stream.value, label.format(*label_args), started, ended, live))  # list.append: atomic

        event.device_event = self.device.streams.submit(stream, timed)
        return event

    # ------------------------------------------------------------------ harmony ops
    def prefetch(self, key_text: str, stream: str) -> _Event:
        key = self.key(key_text)

        def work() -> None:
            device = self.device
            if key.kind == KeyKind.WEIGHTS:
                pack = self.packs[int(key.name[1:])]
                masters = self.host.masters[pack.index]
                with _DeviceContext(device, " while copying the weights of {} ({}) to the device", pack.name,
                                    pack.describe_layers):
                    value = device.weights_to_device(pack.index, masters, self.compute_dtype, pack.written_slots,
                                                     len(pack.params))
            else:
                with _DeviceContext(device, " while copying {} to the device", key_text):
                    value = pytrees.map_tensors(lambda t: device.to_device(self._compute_dtype(t)), self.host_values[key])
            self._count(Stream.H2D, key, value)
            self.device_values[key] = value

        return self._submit(Stream.H2D, work, None, "PREFETCH {}", key_text)

    def offload(self, key_text: str, stream: str) -> _Event:
        key = self.key(key_text)
        event = _Event(None)

        def work() -> None:
            device = self.device
            if key.kind == KeyKind.BUFFERS:
                pack = self.packs[int(key.name[1:])]
                weights = self.device_values[Key(KeyKind.WEIGHTS, key.name)]
                first_buffer = len(pack.params)
                pairs = [(self.host.masters[pack.index][first_buffer + i], device.to_host(weights[first_buffer + i]))
                         for i, name in enumerate(pack.buffers) if name in pack.mutated_buffers]
                self._count(Stream.D2H, key, [copy for _, copy in pairs])
                event.on_host.append(lambda: self._write_buffers(pairs))
            elif key.kind == KeyKind.WGRAD:
                pack = self.packs[int(key.name[1:])]
                grads = self.device_values[key]
                keys = self.host.grad_keys[pack.index]
                if any(g is None for g in grads):  # weights frozen, or unused by this backward
                    keys = [k for k, g in zip(keys, grads) if g is not None]
                    grads = [g for g in grads if g is not None]
                # the program frees dW right after this copy, and nothing adds to it any more
                copies = device.grads_to_host(grads)
                self._count(Stream.D2H, key, copies)
                # already in each master's gradient dtype: the backward summed them in it
                event.on_host.append(lambda: self.host_grads.add_all(keys, copies, self.index))
            else:
                copy = pytrees.map_tensors(device.to_host, self.device_values[key])
                self._count(Stream.D2H, key, copy)
                if key.kind == KeyKind.GRAD:
                    # several readers' partial gradients meet on the host (pipeline); the sum is
                    # made when the program waits for this copy
                    event.on_host.append(lambda: self._add_host_value(key, copy))
                else:
                    self.host_values[key] = copy

        return self._submit(Stream.D2H, work, event, "OFFLOAD {}", key_text)

    def send(self, key_text: str, peer: int) -> _Event:
        key = self.key(key_text)
        parcel = self.links.parcel(key, self.index, peer)
        if self.peer_value is not None:
            return _Event(_PICKED_UP)

        def work() -> None:
            parcel.value = self.device_values[key]
            parcel.ready = self.device.record_event()  # on the peer stream, after the key was made
            parcel.posted.set()

        self._submit(Stream.PEER, work, None, "SEND {} -> d{}", key_text, peer)
        return _Event(parcel)

    def recv(self, key_text: str, peer: int) -> _Event:
        key = self.key(key_text)

        def work() -> None:
            if self.peer_value is not None:
                value = pytrees.map_tensors(lambda t: self.device.to_device(self._compute_dtype(t)), self.peer_value(key))
            else:
                parcel = self.links.parcel(key, peer, self.index)
                parcel.posted.wait()
                self.links.check()
                self.device.wait_event(parcel.ready)  # the sender's GPU has made the value
                value = pytrees.map_tensors(self.device.to_device, parcel.value)
                parcel.value = None
                parcel.picked_up()
            self._count(Stream.PEER, key, value)
            existing = self.device_values.get(key)
            self.device_values[key] = value if existing is None else pytrees.add_grads(existing, value, inplace=True)

        return self._submit(Stream.PEER, work, None, "RECV {} <- d{}", key_text, peer)

    def split(self, key_text: str, *microbatches: int) -> _Event:
        """The host value of ``key`` (a larger forward microbatch's) as views, one per backward
        microbatch: no copy, no new memory."""
        key = self.key(key_text)
        value = self.host_values[key]
        leaves, cuts = pytrees.leaves(value), self.split_dims(key, microbatches)
        offsets = [0] * len(leaves)
        for index, mb in enumerate(microbatches):
            parts = []
            for i, (leaf, cut) in enumerate(zip(leaves, cuts)):
                if cut is None:  # not batched: every part holds it whole
                    parts.append(leaf)
                    continue
                dim, sizes = cut
                parts.append(leaf.narrow(dim, offsets[i], sizes[index]))
                offsets[i] += sizes[index]
            self.host_values[key._replace(mb=mb)] = pytrees.with_leaves(value, parts)
        return _Event(_PICKED_UP)

    def publish(self, event: _Event, number: int) -> None:
        if self.peer_value is None:
            self.links.publish(number, event)

    def remote(self, number: int) -> _Event:
        return _Event(_PICKED_UP) if self.peer_value is not None else self.links.remote(number)

    def wait(self, event: _Event, stream: str) -> None:
        stream = _STREAMS[stream]
        if isinstance(event.device_event, _Waited):  # the tier's work runs on host threads
            event.device_event.synchronize()
            return
        self.device.streams.wait(event.device_event, stream)
        if stream == Stream.HOST:
            event.run_host_work()

    def free(self, key_text: str) -> None:
        key = self.key(key_text)
        self._submit(Stream.COMPUTE, lambda: self._free(key), None, "FREE {}", key_text)

    def _free(self, key: Key) -> None:
        self.device_values.pop(key)
        if key.kind == KeyKind.WGRAD:  # the weights' ``.grad`` autograd summed them in (``_backward``) go too
            for weight in self.device_values.get(Key(KeyKind.WEIGHTS, key.name), ()):
                weight.grad = None

    def update(self, pack_index: int, *copies: _Event) -> None:
        """Hand ``pack_index``'s update to the host: ``on_update`` gets the weight-gradient copies to
        wait for (``land``) before it steps; this thread goes on issuing."""
        if self.on_update is not None:
            started = time.perf_counter()
            self.on_update(self, pack_index, copies)
            with self._stats_lock:
                self.stats.handoff_seconds += time.perf_counter() - started

    def read(self, key_text: str) -> _Event:
        """Hand the read of a pack's optimizer state from the NVMe tier to the tier's reader."""
        return self._tier("read", key_text)

    def write(self, key_text: str) -> _Event:
        """The write of a pack's optimizer state back to the tier (done once the pack's update has
        streamed it all to the tier's writer)."""
        return self._tier("write", key_text)

    def _tier(self, what: str, key_text: str) -> _Event:
        if self.on_tier is None:
            raise ValueError(f"the program moves {key_text} to or from the NVMe tier, but this run has no tier: "
                             "programs with READ/WRITE run under harmony_fx.Trainer(nvme_path=...)")
        return _Event(_Waited(self.on_tier(self, what, int(self.key(key_text).name[1:]))))

    def fwd(self, pack_index: int, mb: int) -> _Event:
        return self._submit(Stream.COMPUTE, self._probed("FWD", pack_index, mb, lambda: self._forward(pack_index, mb)),
                            None, "FWD p{}@{}", pack_index, mb)

    def recompute(self, pack_index: int, mb: int) -> _Event:
        return self._submit(Stream.COMPUTE,
                            self._probed("RECOMPUTE", pack_index, mb, lambda: self._recompute(pack_index, mb)),
                            None, "RECOMPUTE p{}@{}", pack_index, mb)

    def bwd(self, pack_index: int, mb: int) -> _Event:
        return self._submit(Stream.COMPUTE, self._probed("BWD", pack_index, mb, lambda: self._backward(pack_index, mb)),
                            None, "BWD p{}@{}", pack_index, mb)

    def _probed(self, kind: str, pack_index: int, mb: int, work: Callable[[], None]) -> Callable[[], None]:
        """With ``task_memory`` set (the FakeTensor run that plans memory), record each compute
        task's net bytes and its peak above what was live when it started: the planner's memory
        profile. ``probe_peak`` keeps the device's overall peak across the per-task resets."""
        if self.task_memory is None:
            return work

        def probed() -> None:
            device = self.device
            self.probe_peak = max(self.probe_peak, device.peak_bytes())
            before = device.live_bytes()
            device.reset_peak()
            work()
            peak = device.peak_bytes()
            self.probe_peak = max(self.probe_peak, peak)
            self.task_memory[(kind, pack_index, mb)] = (device.live_bytes() - before, peak - before)
        return probed

    # ------------------------------------------------------------------ compute (on the compute stream)
    def _forward(self, pack_index: int, mb: int) -> None:
        pack = self.packs_for_mb[mb][pack_index]
        keep_graph = pack_index == self.last and self.keeps_last_graph
        values = self.device_values
        inputs = [values.pop(Key(KeyKind.ACT, v, mb)) if keep_graph else values[Key(KeyKind.ACT, v, mb)]
                  for v in pack.act_inputs]
        if keep_graph:
            inputs = [_leaf(x, flags) for x, flags in zip(inputs, pack.input_requires_grad)]
        with self.device.rng_lock() if pack.random else contextlib.nullcontext():
            if pack.random:
                self.rng_states[(pack_index, mb)] = self.device.get_rng_state()
            outputs = self._run_pack(pack, inputs, grad=keep_graph, what="forward")
        for name, value in zip(pack.outputs, outputs):
            values[Key(KeyKind.ACT, name, mb)] = pytrees.map_tensors(torch.Tensor.detach, value)
        if keep_graph:
            values[Key(KeyKind.GRAPH, pack.name, mb)] = (inputs, outputs)

    def _recompute(self, pack_index: int, mb: int) -> None:
        pack = self.packs_for_mb[mb][pack_index]
        inputs = [_leaf(self.device_values.pop(Key(KeyKind.ACT, v, mb)), flags)
                  for v, flags in zip(pack.act_inputs, pack.input_requires_grad)]
        if not pack.random:
            outputs = self._run_pack(pack, inputs, grad=True, what="recompute")
        else:
            with self.device.rng_lock():
                saved_state = self.device.get_rng_state()
                replayed = self.rng_states.pop((pack_index, mb), None)
                # only a standalone (FakeTensor) run of one device's program lacks the forward's state
                assert replayed is not None or self.peer_value is not None, f"no RNG state for p{pack_index}@{mb}"
                if replayed is not None:
                    self.device.set_rng_state(replayed)
                try:
                    outputs = self._run_pack(pack, inputs, grad=True, what="recompute")
                finally:
                    self.device.set_rng_state(saved_state)
        self.device_values[Key(KeyKind.GRAPH, pack.name, mb)] = (inputs, outputs)

    def _backward(self, pack_index: int, mb: int) -> None:
        pack = self.packs[pack_index]
        values = self.device_values
        inputs, outputs = values.pop(Key(KeyKind.GRAPH, pack.name, mb))
        if pack_index == self.last:
            for name in pack.outputs:
                values.pop(Key(KeyKind.ACT, name, mb))
        roots, root_grads = _roots(outputs, [values.pop(Key(KeyKind.GRAD, name, mb), None) for name in pack.outputs])
        del outputs
        weights = values[Key(KeyKind.WEIGHTS, pack.name)]
        wanted = set(self.grad_inputs[pack_index])
        input_targets = [(name, x) for name, x in zip(pack.act_inputs, inputs) if name in wanted]
        weight_targets = weights[: len(pack.params)]
        targets = [leaf for _, x in input_targets for leaf in _differentiable(x)]
        targets += [w for w in weight_targets if w.requires_grad]
        # In the compute dtype the masters' gradients keep, autograd sums each weight's gradient into
        # its device copy's ``.grad`` itself (AccumulateGrad, in C++: it takes autograd's tensor where
        # nothing else holds it, else a copy, and adds later microbatches in place), as eager does
        # for parameters; ``dW`` is then those ``.grad``. Under another compute dtype (bf16) each
        # microbatch's gradient is captured and summed in the master's dtype here.
        summed_by_autograd = self.compute_dtype is None
        wgrad_key = Key(KeyKind.WGRAD, pack.name)
        accumulated = values.get(wgrad_key)
        if summed_by_autograd and accumulated is not None:
            for weight, grad in zip(weight_targets, accumulated):
                if weight.grad is not grad:  # the weights were fetched again since the last microbatch
                    weight.grad = grad
        with self.device.compute_scope(), self._context(pack, "backward"), ambient.scope(ambient.OFF):
            with self.compiler.backward_scope() if self.compiler is not None else contextlib.nullcontext():
                if summed_by_autograd:
                    if roots and targets:
                        torch.autograd.backward(roots, root_grads)
                    grads = iter([target.grad for target in targets])
                else:
                    grads = iter(torch.autograd.grad(roots, targets, root_grads, allow_unused=True)
                                 if roots and targets else [None] * len(targets))
            del roots, root_grads, inputs
            stored: set[int] = set()
            for name, x in input_targets:
                leaf_grads = []
                for leaf in pytrees.leaves(x):
                    if not (isinstance(leaf, torch.Tensor) and leaf.requires_grad):
                        leaf_grads.append(None)
                        continue
                    grad = next(grads)
                    if grad is None:
                        grad = torch.zeros_like(leaf)
                    elif storage_key(grad) in stored:
                        # autograd hands one tensor to several inputs (e.g. both sides of an add);
                        # each key must own its gradient, since each is added to in place later
                        grad = grad.clone()
                    stored.add(storage_key(grad))
                    leaf_grads.append(grad)
                self._accumulate(Key(KeyKind.GRAD, name, mb), pytrees.with_leaves(x, leaf_grads))
            if summed_by_autograd:  # the sums so far
                values[wgrad_key] = [next(grads) if weight.requires_grad else None for weight in weight_targets]
            else:
                masters = self.host.masters[pack_index]
                accumulated = values.setdefault(wgrad_key, [None] * len(weight_targets))
                for i, weight in enumerate(weight_targets):
                    grad = next(grads) if weight.requires_grad else None
                    if grad is None:
                        continue
                    # summed over microbatches in the master's gradient dtype (fp32 under bf16 compute):
                    # each microbatch's gradient is rounded once, not the running sum at every step
                    if accumulated[i] is not None:
                        accumulated[i].add_(grad)
                    elif grad.dtype != grad_dtype(masters[i]):
                        accumulated[i] = grad.to(grad_dtype(masters[i]))
                    else:
                        accumulated[i] = _own(grad, stored)
            del grads
            self.device.check_budget()

    # ------------------------------------------------------------------ helpers
    def _run_pack(self, pack: Pack, inputs: list, grad: bool, what: str) -> tuple:
        weights = self.device_values[Key(KeyKind.WEIGHTS, pack.name)]
        state = [weights[slot] for slot in pack.state_slot]
        with (self.device.compute_scope(), self._context(pack, what), torch.set_grad_enabled(grad),
              ambient.scope(self.autocast)):
            if self.compiler is None:
                outputs = direct_forward(pack.gm)(pack.gm, *inputs, *state)
            else:
                outputs = self.compiler.run(pack, [*inputs, *state], grad)
            self.device.check_budget()
            return outputs

    def _context(self, pack: Pack, what: str):
        return _DeviceContext(self.device, " in the {} of {} ({})", what, pack.name, pack.describe_layers)

    def _accumulate(self, key: Key, grad: object) -> None:
        existing = self.device_values.get(key)
        self.device_values[key] = (pytrees.map_tensors(_own, grad) if existing is None
                                   else pytrees.add_grads(existing, grad, inplace=True))

    def _compute_dtype(self, value: object) -> object:
        """Floating tensors travel and compute in ``compute_dtype`` (bf16 halves the bytes);
        masters, optimizer state and what the caller gets back stay in their own dtype."""
        if self.compute_dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.compute_dtype)
        return value

    def _write_buffers(self, pairs) -> None:
        with self._host_lock:  # several devices may write the same master
            for master, copy in pairs:
                master.copy_(copy)

    def _add_host_value(self, key: Key, value: torch.Tensor) -> None:
        with self._host_lock:
            existing = self.host_values.get(key)
            self.host_values[key] = value if existing is None else pytrees.add_grads(existing, value, inplace=False)

    def _count(self, stream: Stream, key: Key, value: object) -> None:
        """Bytes a copy moved, by its direction (the stream it ran on) and its key's kind."""
        if key.kind in (KeyKind.WEIGHTS, KeyKind.WGRAD):
            sizes, size_key = self.host.copy_bytes, (key, len(value))
            nbytes = sizes.get(size_key)
            if nbytes is None:
                nbytes = sizes[size_key] = pytrees.value_bytes(value)
        else:
            nbytes = pytrees.value_bytes(value)
        self.moved[(stream.value, _KIND_NAMES[key.kind])] += nbytes


_KIND_NAMES = {kind: kind.name.lower() for kind in KeyKind}  # the stats' names of key kinds
_STREAMS = {stream.value: stream for stream in Stream}  # what ``Stream(name)`` finds, without Enum's lookup


def grad_dtype(master: torch.Tensor) -> torch.dtype:
    """The dtype of ``master``'s gradient: its own, unless set apart (a parameter whose fp32 master
    is on the NVMe tier holds its bf16 copy, with fp32 gradients: ``runtime.tier``)."""
    return getattr(master, "grad_dtype", None) or master.dtype


class _MadeOnDemand(dict):
    """Host values of a standalone run: what other devices would have put on the host is made when
    first read."""

    def __init__(self, make: Callable[[Key], object]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: Key) -> object:
        value = self[key] = self._make(key)
        return value


class _Parcel:
    """One key on its way from one device to another: posted by the sender's peer stream, taken
    by the receiver's; its "picked up" signal is what the sender waits for before freeing."""

    __slots__ = ("value", "ready", "posted", "done")

    def __init__(self) -> None:
        self.value = None
        self.ready = None  # the sender's device event after which the value is made
        self.posted = threading.Event()
        self.done = threading.Event()

    def picked_up(self) -> None:
        self.done.set()

    def synchronize(self) -> None:
        self.done.wait()
        if self.value is not None and not self.posted.is_set():
            raise RuntimeError("another device stopped the iteration")


class _Done:
    """An event that is already complete."""

    done = threading.Event()
    done.set()

    def synchronize(self) -> None:
        return None


_PICKED_UP = _Done()


class _Links:
    """What the devices of one iteration exchange: parcels, and events one program publishes for
    another's waits (looked up by their number in the schedule)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parcels: dict[tuple[Key, int, int], _Parcel] = {}
        self._events: dict[int, _Event] = {}
        self._published = threading.Condition(self._lock)
        self.failed: BaseException | None = None
        self._on_abort: list[Callable[[BaseException], None]] = []

    def parcel(self, key: Key, source: int, target: int) -> _Parcel:
        with self._lock:
            parcel = self._parcels.setdefault((key, source, target), _Parcel())
            if self.failed is not None:
                parcel.posted.set()
                parcel.done.set()
            return parcel

    def publish(self, number: int, event: "_Event") -> None:
        with self._published:
            self._events[number] = event
            self._published.notify_all()

    def remote(self, number: int) -> "_Event":
        with self._published:
            self._published.wait_for(lambda: number in self._events or self.failed is not None)
            self.check()
            return self._events[number]

    def drop_values(self) -> None:
        with self._lock:
            for parcel in self._parcels.values():
                parcel.value = None

    def abort(self, error: BaseException) -> None:
        """A device failed: wake every device waiting on another, so each stops with an error."""
        with self._published:
            self.failed = self.failed or error
            for parcel in self._parcels.values():
                parcel.posted.set()
                parcel.done.set()
            self._published.notify_all()
            callbacks, self._on_abort = self._on_abort, []
        for callback in callbacks:
            callback(error)

    def on_abort(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(error)`` once a device fails (now, if one has): a host worker whose work waits
        for what a failed device will never hand it (the NVMe tier's writes) is released by it."""
        with self._lock:
            failed = self.failed
            if failed is None:
                self._on_abort.append(callback)
        if failed is not None:
            callback(failed)

    def check(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"another device stopped the iteration: {self.failed!r}") from self.failed


class _DeviceContext:
    """Names the running task in an out-of-memory error: ``text.format(*args)``, a callable among
    ``args`` called, formatted only when an error is raised (a task runs hundreds of times a step)."""

    __slots__ = ("device", "text", "args")

    def __init__(self, device: Device, text: str, *args: object) -> None:
        self.device, self.text, self.args = device, text, args

    def __str__(self) -> str:
        return self.text.format(*[arg() if callable(arg) else arg for arg in self.args])

    def __enter__(self):
        self.device.context = self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if isinstance(error, torch.OutOfMemoryError):
                raise self.device.out_of_memory(error) from error  # named: the task, the plan, the budget
        finally:
            self.device.context = ""


def _leaf(value: object, requires_grad: Sequence[bool]) -> object:
    """A pack input in a graph we keep, detached without a copy: each tensor leaf records gradients
    where it required grad in the model (``requires_grad``, one flag per leaf), as in eager."""
    fresh = [leaf.detach().requires_grad_(flag) if isinstance(leaf, torch.Tensor) else leaf
             for leaf, flag in zip(pytrees.leaves(value), requires_grad, strict=True)]
    return pytrees.with_leaves(value, fresh)


def _roots(outputs: Sequence[object], grads: Sequence[object]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors to differentiate and their gradients: each output leaf that records gradients
    and has one. (A function of its own so that no loop variable keeps a gradient alive.)"""
    roots, root_grads = [], []
    for output, grad in zip(outputs, grads):
        if grad is None:
            continue
        for leaf, leaf_grad in zip(pytrees.leaves(output), pytrees.leaves(grad), strict=True):
            if leaf_grad is not None and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                roots.append(leaf)
                root_grads.append(leaf_grad)
    return roots, root_grads


def _differentiable(value: object) -> list[torch.Tensor]:
    return [leaf for leaf in pytrees.tensors(value) if leaf.requires_grad]


def _own(grad: torch.Tensor, handed: set | None = None) -> torch.Tensor:
    """A gradient we may add into in place: not an expanded or otherwise shared view. ``handed``:
    the storages of the gradients one backward already handed out; a contiguous view of a whole
    buffer no other of them shares (a weight's gradient as ``t()`` of a matmul's, a bias's as the
    view of a sum) is then owned as it is, without the copy."""
    if grad.is_contiguous():
        if grad._base is None and handed is None:
            return grad
        if handed is not None and (grad._base is None or grad._base.numel() == grad.numel()):
            key = storage_key(grad)
            if key not in handed:
                handed.add(key)
                return grad
    return grad.clone(memory_format=torch.contiguous_format)
