"""AllocationTracker: byte-exact accounting of the tensors a task creates."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch._subclasses import FakeTensorMode

from harmony_fx.ir.tracking import AllocationTracker

MIB = 1 << 20


def test_a_512x512_float32_tensor_is_one_mib():
    tracker = AllocationTracker()
    with tracker.mode():
        x = torch.empty(512, 512)
    assert tracker.live == MIB == 1048576
    assert tracker.peak == MIB
    del x
    assert tracker.live == 0
    assert tracker.peak == MIB


def test_views_and_in_place_results_add_nothing():
    tracker = AllocationTracker()
    with tracker.mode():
        x = torch.zeros(512, 512)
        views = [x.view(-1), x[0], x.t(), x[:, 1:], x.reshape(512, 512), x.add_(1), x.unsqueeze(0)]
        assert tracker.live == MIB
    del x
    assert tracker.live == MIB  # the views keep the storage alive
    views.clear()
    assert tracker.live == 0
    assert tracker.peak == MIB


def test_register_counts_a_storage_once():
    tracker = AllocationTracker()
    x = torch.empty(256, 256)
    tracker.register(x)
    tracker.register(x)
    tracker.register(x[1])
    assert tracker.live == 256 * 256 * 4


def test_reset_peak_starts_from_what_is_live():
    tracker = AllocationTracker()
    with tracker.mode():
        keep = torch.empty(512, 512)
        temp = torch.empty(512, 512)
    del temp
    assert tracker.peak == 2 * MIB
    tracker.reset_peak()
    assert tracker.peak == tracker.live == MIB
    del keep


def test_saved_tensors_count_until_backward():
    a = torch.ones(512, 512, requires_grad=True)  # created outside: not counted
    tracker = AllocationTracker()
    with tracker.mode():
        b = a * 2          # 1 MiB, saved by sin for its backward
        c = b.sin()        # 1 MiB
        del b
        assert tracker.live == 2 * MIB  # autograd still holds b
        loss = c.sum()
        del c
        assert tracker.live == MIB + 4  # b (saved) and the scalar loss
        loss.backward()
        del loss
    gc.collect()
    assert a.grad is not None
    assert tracker.live == MIB  # only a.grad, made during backward, is left; the saved b is gone
    assert tracker.peak >= 3 * MIB


def test_cap_calls_on_exceed_when_crossed():
    seen = []

    def on_exceed(live, cap):
        seen.append((live, cap))
        raise MemoryError("over")

    tracker = AllocationTracker(cap=MIB + 100, on_exceed=on_exceed)
    with tracker.mode():
        x = torch.empty(512, 512)
        assert not seen
        with pytest.raises(MemoryError):
            torch.empty(512, 512)
    assert seen == [(2 * MIB, MIB + 100)]
    del x


def test_refused_allocation_is_not_counted_afterwards():
    def on_exceed(live, cap):
        raise MemoryError("over")

    tracker = AllocationTracker(cap=MIB + 100, on_exceed=on_exceed)
    with tracker.mode():
        x = torch.empty(512, 512)
        with pytest.raises(MemoryError):
            torch.empty(512, 512)
    gc.collect()
    assert tracker.live == MIB
    del x
    assert tracker.live == 0


def _training_step(weight: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    """A small forward and backward; returns the tracker's peak and what stays live."""
    weight.requires_grad_(True)
    tracker = AllocationTracker()
    with tracker.mode():
        hidden = torch.relu(x @ weight)
        out = nn.functional.layer_norm(hidden, (32,))
        loss = out.square().mean()
        loss.backward()
        del hidden, out, loss
    return tracker.peak, tracker.live


def test_fake_and_real_runs_give_identical_peaks():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 32), torch.randn(16, 64)
    fake_mode = FakeTensorMode()
    fake_weight, fake_x = fake_mode.from_tensor(weight), fake_mode.from_tensor(x)
    real = _training_step(weight, x)
    with fake_mode:
        fake = _training_step(fake_weight, fake_x)
    assert real[0] > 16 * 32 * 4  # at least the activations
    assert fake == real
