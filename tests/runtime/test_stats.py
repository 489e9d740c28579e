"""An iteration's statistics: bytes by direction and kind, the per-device recorder's byte count and
timeline, and the figures ``hm.stats`` derives from them."""
from __future__ import annotations

import torch

from harmony_fx.program.actions import Key, KeyKind, Stream
from harmony_fx.runtime.devices import HostDevice
from harmony_fx.runtime.stats import DeviceRecorder, Stats
from tests.helpers import TickingStreams


def _device(name: str = "host:0") -> HostDevice:
    device = HostDevice(name)
    device.streams = TickingStreams()
    return device


def test_bytes_are_counted_by_direction_and_kind_per_device():
    stats, copy_bytes = Stats(), {}
    first, second = DeviceRecorder(stats, 0, _device("host:0"), copy_bytes), DeviceRecorder(stats, 1, _device("host:1"), copy_bytes)
    first.count(Stream.H2D, Key(KeyKind.ACT, "x", 0), torch.zeros(4))  # 16 bytes
    first.count(Stream.D2H, Key(KeyKind.ACT, "x", 0), (torch.zeros(2), torch.zeros(2, dtype=torch.float64)))  # 8 + 16
    second.count(Stream.PEER, Key(KeyKind.GRAD, "y", 1), torch.zeros(3))  # 12
    assert stats.bytes_by_kind == {("h2d", "act"): 16, ("d2h", "act"): 24, ("peer", "grad"): 12}
    assert stats.bytes_h2d == 16 and stats.bytes_d2h == 24
    assert stats.bytes_by_device == {("host:0", "h2d", "act"): 16, ("host:0", "d2h", "act"): 24,
                                     ("host:1", "peer", "grad"): 12}
    assert stats.as_dict()["bytes_by_device"] == {"host:0 d2h/act": 24, "host:0 h2d/act": 16, "host:1 peer/grad": 12}


def test_a_packs_weight_bytes_are_summed_once_and_kept_across_iterations():
    copy_bytes: dict = {}
    weights = [torch.zeros(10), torch.zeros(5)]  # 60 bytes
    key = Key(KeyKind.WEIGHTS, "p0")
    DeviceRecorder(Stats(), 0, _device(), copy_bytes).count(Stream.H2D, key, weights)
    assert copy_bytes == {(key, 2): 60}
    # the next iteration's recorder reads the size kept, not the tensors (these are larger)
    stats = Stats()
    DeviceRecorder(stats, 0, _device(), copy_bytes).count(Stream.H2D, key, [torch.zeros(100), torch.zeros(100)])
    assert stats.bytes_by_kind == {("h2d", "weights"): 60}
    # an activation's size is read each time
    DeviceRecorder(stats, 0, _device(), copy_bytes).count(Stream.H2D, Key(KeyKind.ACT, "x", 0), torch.zeros(100))
    assert stats.bytes_by_kind[("h2d", "act")] == 400


def test_without_the_timeline_work_is_submitted_as_it_is():
    stats = Stats()
    recorder = DeviceRecorder(stats, 0, _device(), {})

    def work() -> None:
        return None

    assert recorder.timed(Stream.COMPUTE, work, "FWD p{}@{}", (0, 1)) is work
    assert stats.marks == {} and stats.clocks == {} and stats.spans == []


def test_the_timeline_has_a_span_per_op_by_the_device_clock_and_memory_after_it():
    stats = Stats(recording=True)
    device = _device()
    device.cheap_live_bytes = False  # as on a GPU: memory is sampled after compute tasks only
    recorder = DeviceRecorder(stats, 0, device, {})
    kept = []
    recorder.timed(Stream.COMPUTE, lambda: kept.append(device.to_device(torch.zeros(8))), "FWD p{}@{}", (0, 1))()
    recorder.timed(Stream.H2D, lambda: None, "PREFETCH {}", ("W[p1]",))()
    # the clock's mark at the iteration's start is tick 0; each op takes two ticks: 1-2, 3-4
    assert [(i, stream, label, end - start) for i, stream, label, start, end in stats.spans] == [
        (0, "compute", "FWD p0@1", 1.0), (0, "h2d", "PREFETCH W[p1]", 1.0)]
    assert [live for _, live in stats.memory[0]] == [32]
    assert stats.busy_seconds == {"compute": 1.0, "h2d": 1.0}
    recorder.timed(Stream.D2H, lambda: None, "OFFLOAD {}", ("A[x]@0",))()
    assert len(stats.spans) == 3  # read again once more ops were recorded


def test_busy_time_counts_the_handoff_to_the_host_optimizer_as_the_host_streams():
    stats = Stats(handoff_seconds=0.25)
    assert stats.busy_seconds == {"host": 0.25}
    assert stats.as_dict()["busy_seconds"] == {"host": 0.25}
