"""Step time of harmony_fx vs eager and vs ``torch.compile(model)``, as ratios measured in one run.

    python -m pytest benchmarks/test_step_time.py --benchmark-json=.benchmarks/step_time.json
    python benchmarks/report.py .benchmarks/step_time.json

One step is forward, loss, backward (gradients into the model's host parameters). harmony_fx runs
on one HostDevice: at an unlimited budget (one pack, no recompute: the overhead of the harmony
runtime alone) and at 25% of what eager training needs (many packs: copies and recompute).
``track_memory`` off measures the runtime without the HostDevice's per-tensor accounting, which a
CudaDevice does not have. ``compiled``: ``compile_packs=True`` (every pack through inductor),
against ``torch.compile(model)`` with the same inductor. The small GPT has 8 layers; ``gpt12`` is
the same at 12 layers. Each compiled run warms up (compiles) before it is timed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import statistics
import time

import pytest
import torch

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.models import GPTConfig, TinyGPT

def _pin_malloc_thresholds() -> None:
    """glibc's malloc serves a large block with fresh pages (mmap) until a free raises its threshold,
    so which of a step's tensors are faulted in anew differed from process to process: the same
    code's step moved by ±2% against eager between runs. Fixed thresholds (what
    ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` set) make every process allocate alike;
    both sides of every ratio run under them."""
    libc_name = ctypes.util.find_library("c")
    if libc_name and "libc.so" in libc_name:
        libc = ctypes.CDLL(libc_name)
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 25)  # 32 MiB: the most every glibc takes
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


_pin_malloc_thresholds()

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, n_embd=64, dropout=0.0)
BATCH = 16


def _setup(layers: int = CONFIG.n_layer):
    torch.manual_seed(0)
    model = TinyGPT(dataclasses.replace(CONFIG, n_layer=layers))
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    target = torch.roll(idx, 1, dims=1)
    return model, idx, target


def _loss(output, target):
    return torch.nn.functional.cross_entropy(output.reshape(-1, CONFIG.vocab_size), target.reshape(-1))


def _budget(model, idx, target, fraction: float | None) -> int | None:
    """``fraction`` of what eager training needs (``None``: unlimited)."""
    if fraction is None:
        return None
    return int(fraction * eager_training_bytes(model, (idx,), lambda out: _loss(out, target)))


def _step(fn, idx, target, model):
    _loss(fn(idx), target).backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.benchmark(group="tiny_gpt step")
def test_eager(benchmark):
    model, idx, target = _setup()
    benchmark(_step, model, idx, target, model)


@pytest.mark.benchmark(group="tiny_gpt step")
@pytest.mark.parametrize("fraction", [None, 0.25], ids=["unlimited", "budget25"])
@pytest.mark.parametrize("track_memory", [True, False], ids=["tracked", "untracked"])
def test_harmony(benchmark, fraction, track_memory):
    model, idx, target = _setup()
    budget = _budget(model, idx, target, fraction)
    # one microbatch, the fewest balanced packs: the runtime's own overhead against eager (the planner
    # would choose microbatches and packs for speed on a GPU, not for this comparison)
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], memory_budget=budget, track_memory=track_memory,
                            microbatches=1)
    benchmark(_step, hm, idx, target, model)


# ---------------------------------------------------------------------- compiled


@pytest.mark.benchmark(group="compiled step")
@pytest.mark.parametrize("layers", [8, 12], ids=["gpt8", "gpt12"])
def test_torch_compile(benchmark, layers):
    model, idx, target = _setup(layers)
    compiled = torch.compile(model)
    _step(compiled, idx, target, model)  # compiles
    benchmark(_step, compiled, idx, target, model)


@pytest.mark.benchmark(group="compiled step")
@pytest.mark.parametrize("layers", [8, 12], ids=["gpt8", "gpt12"])
@pytest.mark.parametrize("fraction", [None, 0.25], ids=["unlimited", "budget25"])
def test_harmony_compiled(benchmark, fraction, layers):
    model, idx, target = _setup(layers)
    budget = _budget(model, idx, target, fraction)
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], memory_budget=budget, microbatches=1,
                            compile_packs=True, track_memory=False)
    _step(hm, idx, target, model)  # compiles
    benchmark(_step, hm, idx, target, model)


# ---------------------------------------------------------------------- paired ratios

ROUNDS, STEPS_PER_ROUND = 21, 8


def _paired_ratio(candidate, baseline, idx, target, model) -> float:
    """The median over rounds of (candidate's step time / baseline's), the two alternating round by
    round: the machine's drift during a run (other load, clocks) moves both sides of each ratio,
    where separate benchmarks measured minutes apart move by ±5% here."""
    def round_seconds(fn) -> float:
        started = time.perf_counter()
        for _ in range(STEPS_PER_ROUND):
            _step(fn, idx, target, model)
        return time.perf_counter() - started

    round_seconds(candidate), round_seconds(baseline)  # warm
    return statistics.median(round_seconds(candidate) / round_seconds(baseline) for _ in range(ROUNDS))


@pytest.mark.benchmark(group="paired ratio")
@pytest.mark.parametrize("layers", [8, 12], ids=["gpt8", "gpt12"])
@pytest.mark.parametrize("fraction", [None, 0.25], ids=["unlimited", "budget25"])
@pytest.mark.parametrize("compiled", [False, True], ids=["vs_eager", "vs_torch_compile"])
def test_paired(benchmark, compiled, fraction, layers):
    """harmony (untracked) against eager, or with ``compile_packs`` against ``torch.compile(model)``,
    alternating; the ratio goes to the JSON's ``extra_info`` and is printed."""
    model, idx, target = _setup(layers)
    budget = _budget(model, idx, target, fraction)
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], memory_budget=budget, microbatches=1,
                            compile_packs=compiled, track_memory=False)
    baseline = torch.compile(model) if compiled else model
    _step(hm, idx, target, model), _step(baseline, idx, target, model)  # compiles
    ratio = _paired_ratio(hm, baseline, idx, target, model)
    benchmark.extra_info["ratio"] = ratio
    print(f"\n{'torch.compile' if compiled else 'eager'}, {layers} layers, "
          f"{'unlimited' if fraction is None else f'{fraction:.0%}'}: harmony / baseline = {ratio:.3f}")
    benchmark.pedantic(_step, (hm, idx, target, model), rounds=STEPS_PER_ROUND)


class _BareFunction(torch.autograd.Function):
    """The least any runtime of this design can do at an unlimited budget, with no runtime at all:
    the pack's graph on detached aliases of the weights inside one autograd function whose inputs
    are the parameters, and ``torch.autograd.grad`` of its output in the backward, handed to
    autograd to accumulate into ``.grad``."""

    @staticmethod
    def forward(ctx, pack, masters, idx, *params):
        weights = [m.detach().requires_grad_(m.requires_grad) for m in masters]
        with torch.enable_grad():
            (out,) = pack.gm(idx, *[weights[slot] for slot in pack.state_slot])
        ctx.saved = (out, [w for w in weights if w.requires_grad])
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, weights = ctx.saved
        return (None, None, None, *torch.autograd.grad(out, weights, grad))


@pytest.mark.benchmark(group="paired ratio")
@pytest.mark.parametrize("layers", [8, 12], ids=["gpt8", "gpt12"])
def test_paired_floor(benchmark, layers):
    """``_BareFunction`` against eager, alternating: the floor under harmony's unlimited-budget ratio."""
    model, idx, target = _setup(layers)
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], microbatches=1, track_memory=False)
    (pack,) = hm.packs
    masters = [hm.compiled.masters[name] for name in pack.params + pack.buffers]
    params = [m for m in masters if m.requires_grad]
    bare = lambda x: _BareFunction.apply(pack, masters, x, *params)  # noqa: E731
    ratio = _paired_ratio(bare, model, idx, target, model)
    benchmark.extra_info["ratio"] = ratio
    print(f"\neager, {layers} layers: a bare autograd function over the pack's graph / eager = {ratio:.3f}")
    benchmark.pedantic(_step, (bare, idx, target, model), rounds=STEPS_PER_ROUND)
