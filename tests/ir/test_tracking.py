"""AllocationTracker: byte-exact accounting of the tensors a task creates."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.utils import _pytree as pytree

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


def test_a_storage_counts_until_its_last_alias_dies_not_its_first_tensor():
    """Counting follows storages: a detached alias made outside the tracked scope keeps the bytes."""
    tracker = AllocationTracker()
    with tracker.mode():
        x = torch.empty(512, 512)
    alias = x.detach()  # not an op under the mode: a new tensor object on the same storage
    del x
    gc.collect()
    assert tracker.live == MIB
    del alias
    assert tracker.live == 0


def test_a_kernel_result_in_a_larger_buffer_is_compacted():
    """CPU mse_loss hands its scalar back inside the buffer of the elementwise losses; the tracked
    result is a scalar of its own, so what stays alive is what a plan from shapes counts."""
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    assert torch.nn.functional.mse_loss(x, y).untyped_storage().nbytes() > 4  # the kernel's own behaviour
    tracker = AllocationTracker()
    with tracker.mode():
        loss = torch.nn.functional.mse_loss(x, y)
    assert loss.untyped_storage().nbytes() == 4
    assert tracker.live == 4
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(x, y))


def test_a_fake_run_sizes_an_rnn_workspace_as_the_real_kernel_does():
    """oneDNN's LSTM keeps a workspace for its backward whose size its meta kernel cannot know."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8)
    x = torch.randn(5, 3, 8)
    fake_mode = FakeTensorMode()
    with torch.no_grad():
        fake_lstm = copy.deepcopy(lstm)
        fake_lstm._apply(fake_mode.from_tensor)
    real_tracker, fake_tracker = AllocationTracker(), AllocationTracker()
    with real_tracker.mode():
        real_out = lstm(x)
    with fake_mode, fake_tracker.mode():
        fake_out = fake_lstm(fake_mode.from_tensor(x))
    assert real_tracker.live > sum(t.numel() * 4 for t in pytree.tree_leaves(real_out))  # a workspace is kept
    assert fake_tracker.live == real_tracker.live
    assert fake_tracker.peak == real_tracker.peak
    del fake_out, real_out


def test_storages_since_a_mark_are_the_ones_counted_after_it_even_at_a_dead_ones_address():
    """A storage that dies hands its key (its address) to the next: what was counted after a mark
    is told by when it was counted, not by its key."""
    tracker = AllocationTracker()
    kept = tracker.register(torch.empty(4))
    dying = tracker.register(torch.empty(8))
    mark = tracker.registrations
    del dying
    gc.collect()
    fresh = [tracker.register(torch.empty(8)) for _ in range(3)]
    since = tracker.storages_since(mark)
    assert list(since.values()) == [32, 32, 32]
    assert kept.untyped_storage()._cdata not in since
    assert set(since) == {t.untyped_storage()._cdata for t in fresh}


def test_an_lstm_backward_counts_on_fake_tensors_what_it_holds_on_real_ones():
    """oneDNN's RNN backward returns its two bias gradients in one storage on FakeTensors (only in
    some runs: FakeTensor's cache of op results makes them apart), in two on real tensors: counted
    apart, every run, as the real kernel holds them."""
    torch.manual_seed(0)
    lstm, x = nn.LSTM(8, 8, batch_first=True), torch.randn(4, 5, 8, requires_grad=True)

    def held_after_backward(fake: bool) -> int:
        tracker = AllocationTracker()
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad():
            pass
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        with (mode or torch.enable_grad()):
            inputs = mode.from_tensor(x) if fake else x.detach().requires_grad_()
            with tracker.mode():
                out, (h, c) = lstm(inputs)
                grads = torch.autograd.grad(out.sum() + h.sum() + c.sum(), [inputs, *lstm.parameters()])
            return tracker.live - sum(t.untyped_storage().nbytes() for t in (out, h, c))

    real = held_after_backward(fake=False)
    assert [held_after_backward(fake=True) for _ in range(3)] == [real] * 3


def test_a_sparse_tensor_counts_its_indices_and_values():
    """A sparse tensor has no storage of its own (``untyped_storage()`` raises): a model with a sparse
    adjacency input crashed under ``track_memory=True`` (sweep vv's class C)."""
    tracker = AllocationTracker()
    adjacency = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.ones(3), (3, 3)).coalesce()
    tracker.register(adjacency)
    assert tracker.live == 2 * 3 * 8 + 3 * 4  # int64 indices [2, 3] and float32 values [3]
    with tracker.mode():
        product = torch.sparse.mm(adjacency, torch.ones(3, 4))
    assert tracker.live == 2 * 3 * 8 + 3 * 4 + product.numel() * 4


def test_a_model_with_a_sparse_input_trains_as_eager_with_its_memory_tracked():
    import harmony_fx

    class SparseGCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x, adjacency):
            return torch.sparse.mm(adjacency, self.second(torch.relu(torch.sparse.mm(adjacency, self.first(x)))))

    torch.manual_seed(0)
    edges = torch.randint(0, 12, (2, 30))
    adjacency = torch.sparse_coo_tensor(edges, torch.rand(30), (12, 12)).coalesce()
    x, model = torch.randn(12, 16), SparseGCN()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x, adjacency), devices=["host:0"], pack_boundaries=(0, 2), microbatches=1,
                            track_memory=True)
    hm(x, adjacency).square().sum().backward()
    reference(x, adjacency).square().sum().backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)
    assert 0 < hm.stats.peak_bytes["host:0"] <= hm.plan.predicted_peak["host:0"]
