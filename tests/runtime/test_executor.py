"""The executor: the measured timeline, a device that shares host memory, gradients autograd shares."""
from __future__ import annotations

import pytest
import torch

import harmony_fx
from harmony_fx.models import MLPChain
from tests.helpers import TickingStreams


def test_spans_and_busy_time_come_from_the_device_clock():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    x = torch.randn(8, 16)
    hm = harmony_fx.compile(model, x, devices=["host:0"], microbatches=2, pack_boundaries=(0, 2), timeline=True)
    hm.devices[0].streams = TickingStreams()
    hm(x).sum().backward()
    spans = hm.stats.spans
    assert spans and all(end - start == 1.0 for _, _, _, start, end in spans)
    compute = [span for span in spans if span[1] == "compute"]
    assert hm.stats.busy_seconds["compute"] == len(compute)
    # a HostDevice samples its memory after every op, at the op's end by the same clock
    assert [t for t, _ in hm.stats.memory[0]] == sorted(end for *_, end in spans)


@pytest.mark.parametrize("name", ["small_cnn", pytest.param("tiny_gpt", marks=pytest.mark.slow)])  # 12 s: slow
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
    assert trainer.hm.devices[0].shares_host_memory and len(trainer.hm.packs) > 2
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


class _SharedGradients(torch.nn.Module):
    """Weights whose gradients autograd hands out in shared memory once the batch is cut into
    microbatches of one sample: ``h + w_a + w_b`` gives ``h``, ``w_a`` and ``w_b`` one tensor (the
    shapes match, nothing is summed), ``cat([w_c, w_d])`` gives two views of one buffer; ``h``
    also feeds the residual, so its gradient is summed in place from two packs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.w_a = torch.nn.Parameter(torch.randn(1, 4))
        self.w_b = torch.nn.Parameter(torch.randn(1, 4))
        self.w_c = torch.nn.Parameter(torch.randn(2))
        self.w_d = torch.nn.Parameter(torch.randn(2))
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.out((h + self.w_a + self.w_b) * torch.cat([self.w_c, self.w_d])) + h


@pytest.mark.parametrize("track_memory", [False, True], ids=["shared-memory", "tracked"])
def test_weight_gradients_autograd_hands_out_in_shared_memory_sum_like_eager(track_memory):
    """Each weight's gradient is summed over four microbatches into a tensor of its own: one that
    another weight's or an input's gradient shares is copied before anything adds into it."""
    import copy

    torch.manual_seed(0)
    model, x = _SharedGradients(), torch.randn(4, 4)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=4, pack_boundaries=[0, 1, 5],
                            track_memory=track_memory)
    assert len(hm.packs) == 3
    for _ in range(2):  # the second call sums into .grad the first left
        hm(x).square().sum().backward()
        reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_clipping_scales_each_weight_gradient_once_when_autograd_shared_them():
    """``max_grad_norm`` scales the host gradients in place: two weights handed one tensor by
    autograd must not get it scaled twice."""
    import copy

    torch.manual_seed(0)
    model, x = _SharedGradients(), torch.randn(1, 4)
    reference = copy.deepcopy(model)
    loss_fn = lambda out, target: (out - target).square().sum()  # noqa: E731
    target = torch.zeros(1, 4)
    trainer = harmony_fx.Trainer(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), (x, target),
                                 devices=["host:0"], microbatches=1, max_grad_norm=0.01, pack_boundaries=[0, 1, 5],
                                 track_memory=False)  # gradients handed over as autograd made them
    assert trainer.hm.devices[0].shares_host_memory
    trainer.step((x, target))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_fn(reference(x), target).backward()
    assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01) > 0.1  # the clip takes effect
    optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # the clipped gradients are ~1e-3: compared relative to their own size
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-12, msg=name)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


class _ScaleShift(torch.nn.Module):
    """DiT/PixArt's modulation: ``table[None] + emb.reshape(B, 2, -1)`` with ``emb`` from the pack
    before. On a one-sample microbatch nothing is summed over the batch, so autograd hands the
    table's gradient and ``emb``'s as two views of one buffer (each a tensor of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(4, 8)
        self.table = torch.nn.Parameter(torch.randn(2, 4))

    def forward(self, x, t):
        emb = self.emb(t)
        shift, scale = (self.table[None] + emb.reshape(x.shape[0], 2, -1)).chunk(2, dim=1)
        return x * (1 + scale) + shift


def test_an_input_gradient_in_a_weights_gradient_buffer_is_not_added_into():
    """AccumulateGrad keeps the table's first microbatch gradient as autograd made it, a view of
    the buffer ``emb``'s gradient is a view of too: the second microbatch's ``+=`` into the
    table's ``.grad`` must not reach ``emb``'s gradient, still held for the pack before."""
    import copy

    torch.manual_seed(0)
    model, x, t = _ScaleShift(), torch.randn(2, 3, 4), torch.randn(2, 4)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x, t), devices=["host:0"], microbatches=2, pack_boundaries=(0, 1))
    assert len(hm.packs) == 2 and hm.mb_sizes == [1, 1]
    hm(x, t).square().sum().backward()
    reference(x, t).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)


class _Sign(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1, 6))

    def forward(self, x):
        return torch.sgn(x * self.w) + x * self.w.sgn()


def test_a_storage_less_zero_gradient_sums_over_microbatches_like_eager():
    """``sgn`` of a real tensor hands autograd's storage-less zero (a ZeroTensor) back as its
    gradient: passed on to the pack before as its output's gradient, it became the weight's first
    ``.grad``, which the second microbatch's ``+=`` could not write ("ZeroTensors are immutable")."""
    import copy

    torch.manual_seed(0)
    model, x = _Sign(), torch.randn(4, 6)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=2, pack_boundaries=(0, 1))
    assert len(hm.packs) == 2
    hm(x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(model.w.grad, reference.w.grad)


@pytest.mark.parametrize("track_memory", [False, True])
def test_a_buffer_the_forward_resizes_in_place_is_resized_on_the_host_as_in_eager(track_memory):
    """Quantization-aware training (``prepare_qat`` with the default qconfig): each per-channel
    weight observer's min/max buffers start empty and its first forward resizes them in place
    (``aten.fused_moving_avg_obs_fake_quant``); writing the new values back into the host's
    empty buffers raised 'The size of tensor a (0) must match the size of tensor b (16)'."""
    import copy
    import warnings

    import torch.ao.quantization as tq
    from torch import nn

    from tests.helpers import assert_backward_equal

    class Quantized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
            self.layers = nn.ModuleList(nn.Linear(8 if i == 0 else 16, 16) for i in range(3))

        def forward(self, x):
            x = self.quant(x)
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.dequant(x)

    torch.manual_seed(0)
    model = Quantized().train()
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        tq.prepare_qat(model, inplace=True)
    reference = copy.deepcopy(model)
    assert model.layers[0].weight_fake_quant.activation_post_process.min_val.shape == (0,)
    hm = harmony_fx.compile(model, torch.randn(4, 8), devices=["host:0"], microbatches=1, pack_boundaries=(0, 2, 4),
                            track_memory=track_memory)
    assert len(hm.packs) == 3
    for step in range(2):
        x = torch.randn(4, 8)
        assert_backward_equal(hm, model, reference, x)
    assert model.layers[0].weight_fake_quant.activation_post_process.min_val.shape == (16,)
