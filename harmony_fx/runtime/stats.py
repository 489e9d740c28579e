"""What an iteration measured: bytes moved, peaks, and (when recorded) the timeline of every op.

``Stats`` is the iteration's, read by ``hm.stats``; each device's runtime writes its own part of it
through a ``DeviceRecorder``: the bytes its copies moved by direction and key kind, and, with the
timeline on, a span per op read from the device's own clock.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

from harmony_fx.ir import values as pytrees
from harmony_fx.program.actions import Key, KeyKind, Stream
from harmony_fx.runtime.devices import Device

__all__ = ["Stats", "DeviceRecorder"]


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
    # per device that counts its memory (a GPU; a HostDevice with track_memory=True), the most it held
    peak_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # per such device, the peaks its allocator keeps apart (a GPU: allocated, requested, reserved)
    memory_peaks: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    pinned_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # host memory pinned for copies
    budget: dict[str, int | None] = dataclasses.field(default_factory=dict)
    # the time the issuing threads spent handing updates to the host optimizer
    handoff_seconds: float = 0.0
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
        }


class DeviceRecorder:
    """One device's part of ``stats``: the bytes its copies move, and its timeline when recorded.

    ``copy_bytes``: the sizes of packs' weights and weight gradients as copied, kept across
    iterations (``HostState.copy_bytes``)."""

    __slots__ = ("device", "moved", "marks", "_copy_bytes")

    def __init__(self, stats: Stats, index: int, device: Device, copy_bytes: dict[tuple, int]) -> None:
        self.device = device
        self._copy_bytes = copy_bytes
        stats.device_names[index] = device.name
        self.moved = stats.moved.setdefault(index, collections.Counter())
        self.marks: list | None = None  # this device's timeline entries, when the timeline is recorded
        if stats.recording:
            stats.clocks[index] = (device.streams, device.streams.mark(Stream.COMPUTE), time.perf_counter())
            self.marks = stats.marks.setdefault(index, [])

    def count(self, stream: Stream, key: Key, value: object) -> None:
        """Bytes a copy moved, by its direction (the stream it ran on) and its key's kind."""
        if key.kind in (KeyKind.WEIGHTS, KeyKind.WGRAD):
            sizes, size_key = self._copy_bytes, (key, len(value))
            nbytes = sizes.get(size_key)
            if nbytes is None:
                nbytes = sizes[size_key] = pytrees.value_bytes(value)
        else:
            nbytes = pytrees.value_bytes(value)
        self.moved[(stream.value, _KIND_NAMES[key.kind])] += nbytes

    def timed(self, stream: Stream, work: Callable[[], None], label: str,
              label_args: Sequence[object]) -> Callable[[], None]:
        """``work`` as submitted to ``stream``: as it is when the timeline is off; else timed by the
        device's clock, its span (``label.format(*label_args)``, formatted only then) and the
        device's memory after it going to the measured timeline (``Stats.spans``)."""
        entries = self.marks
        if entries is None:
            return work
        device = self.device
        clock = device.streams

        def timed() -> None:
            started = clock.mark()
            try:
                work()
            finally:
                ended = clock.mark()
                sampled = device.counts_memory and (device.cheap_live_bytes or stream == Stream.COMPUTE)
                live = device.live_bytes() if sampled else None
                entries.append((stream.value, label.format(*label_args), started, ended, live))  # list.append: atomic

        return timed


_KIND_NAMES = {kind: kind.name.lower() for kind in KeyKind}  # the stats' names of key kinds
