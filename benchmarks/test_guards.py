"""What the per-call guards cost (``frontend.guards.CallKey``) against a step of the small GPT, and
what a new sequence length costs against the first compile, measured in one run.

    python -m pytest benchmarks/test_guards.py -s

The step is forward, loss and backward on one HostDevice at 25% of what eager training needs (the
demo's setting); the guards are every call's ``CallKey.of`` (module walk, parameters, autocast,
inputs). Target: guards under 2% of a step.
"""
from __future__ import annotations

import statistics
import time

import torch

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.frontend.guards import CallKey
from harmony_fx.models import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, n_embd=64, dropout=0.0)


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def test_guard_cost_against_a_step(benchmark):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    idx = torch.randint(0, CONFIG.vocab_size, (16, CONFIG.block_size))
    loss_of = lambda out: out.float().pow(2).mean()  # noqa: E731
    budget = eager_training_bytes(model, (idx,), loss_of) // 4
    hm = harmony_fx.compile(model, (idx,), memory_budget=budget, microbatches=4)

    def step():
        loss_of(hm(idx)).backward()

    step()
    step_seconds = _median_seconds(step, 5)
    guard_seconds = benchmark(lambda: CallKey.of(model, (idx,), {}))
    guard_seconds = benchmark.stats.stats.median
    ratio = guard_seconds / step_seconds
    print(f"\nguards {guard_seconds * 1e6:.0f} us a call, step {step_seconds * 1e3:.1f} ms: {100 * ratio:.2f}% of a step")
    benchmark.extra_info.update(step_seconds=step_seconds, guard_ratio=ratio)
    hm.close()


def test_new_sequence_length_against_the_first_compile():
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    hm = harmony_fx.compile(model, memory_budget="3MiB", microbatches=4)
    costs = []
    for length in (32, 24, 16):
        idx = torch.randint(0, CONFIG.vocab_size, (16, length))
        started = time.perf_counter()
        hm(idx)  # compiles for the new length (forward only: no_grad is not needed to see the cost)
        costs.append(time.perf_counter() - started)
    modules = [module for _, module in hm.variants]
    plans = 1 + sum("planned afresh" in list(m.passes)[-1].decision for m in modules[1:])
    print(f"\nfirst compile and call {costs[0]:.2f} s; new lengths {costs[1]:.2f} s, {costs[2]:.2f} s "
          f"({100 * costs[1] / costs[0]:.0f}%, {100 * costs[2] / costs[0]:.0f}% of the first); "
          f"{plans} plan(s) for {len(modules)} lengths")
    hm.close()
