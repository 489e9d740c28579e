"""The executor: the measured timeline, host gradients, and a device that shares host memory."""
from __future__ import annotations

import itertools

import pytest
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
        grads.add_all([(7, torch.tensor([value]))], device)
    assert grads.get(7).item() == 1.0
    assert grads.get(8) is None


@pytest.mark.parametrize("name", ["small_cnn", "tiny_gpt"])
def test_a_device_sharing_host_memory_trains_like_eager(name):
    """``track_memory=False``: a HostDevice hands the masters of weights it only reads and takes
    the weight gradients it frees without copies. BatchNorm statistics (written in place) still get
    the device's own copy, and tied weights are read from one master by two packs."""
    import copy

    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.testing.models import zoo

    entry = zoo()[name]
    model, inputs, target = entry.build(0)
    reference = copy.deepcopy(model)
    budget = int(0.25 * eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    trainer = harmony_fx.Trainer(model, entry.loss_fn, optimizer, (inputs, target), devices=["host:0"],
                                 memory_budget=budget, microbatches=1, track_memory=False)
    assert trainer.hm.device.shares_host_memory and len(trainer.hm.packs) > 2
    for _ in range(3):
        torch.manual_seed(0)
        loss = trainer.step((inputs, target))
        torch.manual_seed(0)
        reference_loss = entry.loss_fn(reference(*inputs), target)
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        torch.testing.assert_close(loss, reference_loss.detach(), rtol=1e-5, atol=1e-6)
    for (pname, p), q in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q[1], rtol=1e-5, atol=1e-6, msg=pname)
    for b, c in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
