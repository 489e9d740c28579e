"""The executor's measured timeline: spans are read from the device's own clock."""
from __future__ import annotations

import itertools

import torch

import harmony_fx
from harmony_fx.runtime.streams import HostStreams
from harmony_fx.testing.models import MLPChain


class _TickingStreams(HostStreams):
    """Inline streams whose clock ticks one second per mark: a span made from these marks lasts
    exactly one second, whatever the host's time says."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def mark(self, stream=None) -> int:
        return next(self._ticks)

    @staticmethod
    def seconds(origin: int, mark: int) -> float:
        return float(mark - origin)


def test_spans_and_busy_time_come_from_the_device_clock():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    x = torch.randn(8, 16)
    hm = harmony_fx.compile(model, x, devices=["host:0"], microbatches=2, pack_boundaries=(0, 2), timeline=True)
    hm.device.streams = _TickingStreams()
    hm(x).sum().backward()
    spans = hm.stats.spans
    assert spans and all(end - start == 1.0 for _, _, _, start, end in spans)
    compute = [span for span in spans if span[1] == "compute"]
    assert hm.stats.busy_seconds["compute"] == len(compute)
    # a HostDevice samples its memory after every op, at the op's end by the same clock
    assert [t for t, _ in hm.stats.memory[0]] == sorted(end for *_, end in spans)


def test_host_gradients_sum_in_device_order_whatever_order_they_land():
    from harmony_fx.runtime.executor import HostGradients

    grads = HostGradients()
    # float32: (1e8 + -1e8) + 1 == 1, but 1 + -1e8 == -1e8 and then + 1e8 == 0
    for device, value in ((2, 1.0), (1, -1e8), (0, 1e8)):
        grads.add(7, torch.tensor([value]), device)
    assert grads.get(7).item() == 1.0
    assert grads.get(8) is None
