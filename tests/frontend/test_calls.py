"""``frontend.calls``: what a call gets back. An input, parameter or buffer the model returns
unchanged is the caller's own tensor, as in eager (it was refused: "return a copy"), and its
gradient reaches the caller as eager's does."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import harmony_fx
from tests.helpers import assert_grads_equal


class _ReturnsWhatItGot(nn.Module):
    """Returns its input, a parameter and a buffer unchanged beside what it computes (a
    temperature returned for logging, the input kept for a residual loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 2)
        self.temperature = nn.Parameter(torch.tensor(2.0))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> dict:
        hidden = torch.tanh(self.first(x))
        return {"input": x, "temperature": self.temperature, "scale": self.scale,
                "logits": self.second(hidden) / self.temperature, "hidden": hidden}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_what_the_model_returns_unchanged_is_the_callers_own_tensor(microbatches):
    torch.manual_seed(0)
    model = _ReturnsWhatItGot()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        # the state returned as it is does not keep the batch from being cut: no "may differ" warning
        warnings.simplefilter("error")
        hm = harmony_fx.compile(model, (x.detach(),), devices=["host:0"], microbatches=microbatches,
                                pack_boundaries=(0, 2))
    out, ref = hm(x), reference(x_ref)
    assert out["input"] is x and out["temperature"] is model.temperature and out["scale"] is model.scale

    def loss(o):
        return o["logits"].square().sum() + (o["input"] * o["hidden"]).sum() + 3 * o["temperature"] * o["scale"]

    loss(out).backward()
    loss(ref).backward()
    assert_grads_equal(model, reference, inputs=[x], ref_inputs=[x_ref])


class _Identity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return x


class _ComputesAndDropsIt(_Identity):
    def forward(self, x):
        self.unused(x)
        return x


@pytest.mark.parametrize("model", [_Identity, _ComputesAndDropsIt])
def test_a_model_that_computes_nothing_it_returns_says_so(model):
    """Said in words (the planner failed with "min() arg is an empty sequence")."""
    with pytest.raises(ValueError, match="computes nothing"):
        harmony_fx.compile(model(), (torch.randn(4, 2),), devices=["host:0"])


class _PicksRows(nn.Module):
    """Returns the rows a mask picks (``h[h[:, 0] > 0]``): each microbatch gives as many as its mask."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        hidden = self.first(x)
        return self.second(hidden), self.second(hidden[hidden[:, 0] > 0])


def test_rows_picked_by_a_mask_get_their_gradients_back_per_microbatch():
    """The gradient of the picked rows was cut by the inputs' microbatch sizes (4, 4) where the
    microbatches gave 3 and 3 rows: backward raised from split_with_sizes."""
    torch.manual_seed(0)
    model = _PicksRows()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cutting by hand where the analysis cannot show it safe
        hm = harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=2)
    (a, b), (ref_a, ref_b) = hm(x), reference(x)
    assert b.shape[0] not in (0, 8)  # the masks picked some rows, not all
    torch.testing.assert_close(b, ref_b)
    (a.sum() + b.pow(2).sum()).backward()
    (ref_a.sum() + ref_b.pow(2).sum()).backward()
    assert_grads_equal(model, reference, rtol=1e-5, atol=1e-6)


class _CountsItsBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        out = self.second(torch.tanh(self.first(x)))
        return {"logits": out, "samples": x.shape[0], "elements": out.numel()}


@pytest.mark.parametrize("options", [{"microbatches": 2}, {"memory_budget": 4544}], ids=["by hand", "planner"])
def test_a_number_the_model_returns_is_the_whole_batchs(options):
    """``x.shape[0]`` came back as a microbatch's size (4, or 2 where the planner cut 4 microbatches)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    hm = harmony_fx.compile(_CountsItsBatch(), (x,), devices=["host:0"], **options)
    assert hm.num_microbatches > 1
    got = hm(x)
    assert (got["samples"], got["elements"]) == (8, 32)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_call_whose_backward_never_comes_frees_the_device_when_its_output_dies(microbatches):
    """A metric computed without no_grad (``hm(x).argmax(-1)``): with one microbatch the returned
    tensor was the one the iteration held, so its grad_fn (holding the iteration) made a cycle,
    and the last pack stayed on the device until the cyclic collector ran (the next step: out of
    memory at a tight budget). The garbage collector is off here: only reference counts free it."""
    import gc

    from tests.memory_witness import DeviceMemoryWitness

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(4, 8)
    hm = harmony_fx.compile(model, x, devices=["host:0"], microbatches=microbatches, pack_boundaries=[0, 2, 4])
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with DeviceMemoryWitness() as witness:
            output = hm(x)
            assert witness.live_of(hm.devices[0]) > 0  # the last pack, kept for a backward
            predictions = output.argmax(-1)
            del output
        assert witness.live_of(hm.devices[0]) == 0 and predictions.shape == (4,)
    finally:
        if was_enabled:
            gc.enable()


class _BatchOnDimOne(nn.Module):
    """Returns its output with the batch moved to dim 1 (a sequence-first output); at one sample
    export drops the ``contiguous`` (a [4, 1, 5] transpose already is), so that sample's graph
    names its output otherwise than the whole batch's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).transpose(0, 1).contiguous()


@pytest.mark.parametrize("devices, microbatches", [(1, 3), (2, None)])
def test_an_output_is_joined_along_its_batch_dim_in_one_sample_microbatches(devices, microbatches):
    """It was joined along dim 0 where the sample's output name missed the analysis's: [12, 1, 5]
    for [4, 3, 5], silently."""
    torch.manual_seed(0)
    model = _BatchOnDimOne()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 8)
    hm = harmony_fx.compile(model, devices=[f"host:{i}" for i in range(devices)], microbatches=microbatches)
    out = hm(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected)  # shape [4, 3, 5] and values
    out.square().mean().backward()
    expected.square().mean().backward()
    assert_grads_equal(model, reference)


def test_outputs_that_cannot_be_joined_along_their_dim_say_which_and_what_to_do():
    """An unbatched query ([L, E]) cut by hand: the attention weights' microbatches are [3, 3] and
    [2, 2], and joining them raised torch.cat's own size error; refused at compile, by the shapes
    the whole batch's graph gives it."""
    attention, q = nn.MultiheadAttention(8, 2), torch.randn(5, 8)
    refused = r"output\[1\] \(\w+\) is \[5, 5\] on the whole batch of 5 and \[3, 3\].*batch_dims.*microbatches=1"
    with warnings.catch_warnings(), pytest.raises(ValueError, match=refused):
        warnings.simplefilter("ignore", harmony_fx.MicrobatchesComputeApart)  # said at compile
        harmony_fx.compile(attention, (q, q, q), devices=["host:0"], microbatches=2)
