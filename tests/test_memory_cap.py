"""The budget is a hard cap, checked by a count the runtime does not make.

For every zoo model at 100%, 50%, 25% of eager's memory and at the tightest budget harmony_fx
accepts, on one device and on two in data-parallel and in the pipeline (and for an LSTM stack and an
attention stack), one training step runs under ``DeviceMemoryWitness`` (tests/memory_witness.py:
its own dispatch mode and storage bookkeeping). Its peak must equal the runtime's measured peak,
which must equal the plan's, and all must be within the budget. Because the witness is independent,
``peak <= budget`` here can fail: the runtime's tracker raising first cannot hide an overshoot.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import harmony_fx
from tests.helpers import SEED, ZOO, LSTMStack, eager_bytes, smallest_budget
from tests.memory_witness import DeviceMemoryWitness

DEVICES = {"single": None, "dp": ["host:0", "host:1"], "pp": ["host:0", "host:1"]}


def _options(mode: str) -> dict:
    return {} if mode == "single" else {"devices": DEVICES[mode], "parallel": mode, "microbatches": 2}


def _step_under_witness(model: nn.Module, inputs: tuple, loss_of, budget: int, **options):
    hm = harmony_fx.compile(model, inputs, memory_budget=budget, **options)
    torch.manual_seed(SEED)
    with DeviceMemoryWitness() as witness:
        loss_of(hm(*inputs)).backward()
    return hm, witness


def _assert_capped(hm, witness, budget: int) -> None:
    for device in hm.devices:
        measured, witnessed = hm.stats.peak_bytes[device.name], witness.peak_of(device)
        assert witnessed == measured, (
            f"{device.name}: the witness counted a peak of {witnessed:,} bytes, the runtime {measured:,}")
        assert measured == hm.plan.predicted_peak[device.name]
        assert witnessed <= budget
        assert witness.live_of(device) == 0  # nothing stays on the device after the step


@functools.lru_cache(maxsize=None)
def _tightest(name: str, mode: str) -> int:
    model, inputs, _ = ZOO[name].build(0)
    return smallest_budget(model, inputs, **_options(mode))


def _budget(name: str, fraction: float | str, mode: str) -> int:
    return _tightest(name, mode) if fraction == "tightest" else int(eager_bytes(name) * fraction)


# the tightest budgets of the two larger models search the longest (10-27 s each): slow on two
# devices, and the small GPT's on one too, so that the default suite stays under 8 minutes on 2 cores;
# the small GPT at 25% on two devices too (11-12 s each; on one device it stays)
_SLOW = {("tiny_gpt", "tightest"), ("residual_mlp", "tightest"), ("tiny_gpt", 0.25)}
CASES = [pytest.param(name, fraction, "single", id=f"{name}-{fraction}-single",
                      marks=[pytest.mark.slow] if (name, fraction) == ("tiny_gpt", "tightest") else [])
         for name in ZOO for fraction in (1.0, 0.5, 0.25, "tightest")]
CASES += [pytest.param(name, fraction, mode, id=f"{name}-{fraction}-{mode}",
                       marks=[pytest.mark.slow] if (name, fraction) in _SLOW else [])
          for name in ZOO for fraction in (0.25, "tightest") for mode in ("dp", "pp")]


@pytest.mark.parametrize("name,fraction,mode", CASES)
def test_zoo_stays_within_the_budget_by_an_independent_count(name, fraction, mode):
    entry = ZOO[name]
    model, inputs, target = entry.build(0)
    budget = _budget(name, fraction, mode)
    try:
        hm, witness = _step_under_witness(model, inputs, lambda out: entry.loss_fn(out, target), budget,
                                          **_options(mode))
    except harmony_fx.BudgetTooSmallError:
        pytest.skip(f"{budget:,} bytes is below what {mode} accepts for {name}")
    _assert_capped(hm, witness, budget)


class _AttentionStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.MultiheadAttention(16, 4, batch_first=True) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x, x, x)[0]
        return x


def _in_place_on_sequences() -> tuple[nn.Module, torch.Tensor]:
    """ReLU(inplace=True) after a Linear over [B, T, F]: the Linear's output is a view of its matmul,
    which real tensors differentiated through as_strided (one more matmul-sized tensor in backward
    than the plan's FakeTensors held: out of memory at the tightest budget)."""
    return (nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=True), nn.Linear(64, 16), nn.Linear(16, 64),
                          nn.ReLU(inplace=True), nn.Linear(64, 16)), torch.randn(4, 8, 16))


class _SpectralFilter(nn.Module):
    """A complex weight over the sequence's frequencies (S4D's, FNet-like filters): its gradient and
    what autograd saves for it were left out of the plan (16% over it, out of memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.filter = nn.Parameter(torch.randn(5, 16, dtype=torch.cfloat) * 0.1)
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        spectrum = torch.fft.rfft(x, dim=1, norm="ortho") * self.filter
        return torch.tanh(x + self.linear(torch.fft.irfft(spectrum, n=x.shape[1], dim=1, norm="ortho")))


class _TransposedOutput(nn.Module):
    """Returns a transposed view (as ``torch.vmap(f, in_dims=1)(x).transpose(0, 1)`` captures): the
    plan ran its backward with a gradient of the output's strides, the caller's is contiguous, and
    the backward copied it where the plan did not (out of memory at the smallest budget)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = x.transpose(0, 1).reshape(-1, 8) @ self.first.weight.t()
        h = self.second(torch.relu(h.view(x.shape[1], x.shape[0], 8) + self.first.bias))
        return (h * 2).transpose(0, 1)


@pytest.mark.parametrize("mode", list(DEVICES))
@pytest.mark.parametrize("build", [lambda: (LSTMStack(head=4), torch.randn(4, 5, 8)),
                                   lambda: (_AttentionStack(), torch.randn(4, 6, 16)), _in_place_on_sequences,
                                   lambda: (nn.Sequential(*[_SpectralFilter() for _ in range(3)]), torch.randn(4, 8, 16)),
                                   lambda: (_TransposedOutput(), torch.randn(4, 6, 8))],
                         ids=["lstm", "attention", "in-place-on-a-view", "complex-weights", "transposed-output"])
def test_lstm_and_attention_stacks_at_their_tightest_budget(build, mode):
    torch.manual_seed(0)
    model, x = build()
    budget = smallest_budget(copy.deepcopy(model), (x,), **_options(mode))
    hm, witness = _step_under_witness(model, (x,), lambda out: out.pow(2).mean(), budget, **_options(mode))
    assert len(hm.packs) > 1
    _assert_capped(hm, witness, budget)


def test_the_witness_sees_what_the_runtime_would_miss():
    """Break the runtime's count (a device copy it does not register) and watch the witness differ."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(4, 8)
    hm = harmony_fx.compile(model, (x,), microbatches=1)
    device = hm.devices[0]
    device.track_memory = False  # copies no longer registered, compute no longer watched
    with DeviceMemoryWitness() as witness:
        hm(x).sum().backward()
    assert witness.peak_of(device) > 0 and device.name not in hm.stats.peak_bytes  # nothing counted: no peak
