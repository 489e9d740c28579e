"""Larger forward microbatches than the backward's, measured on this machine: step time and the
plan's peak of the small GPT's Trainer with one microbatch size against the forward on 2x and 4x
larger microbatches. Run: ``python -m pytest benchmarks/test_microbatch_sizes.py -s``.

Five fixed packs (so the forward runs four of them), no dropout, AdamW, one HostDevice without
per-tensor tracking. Each step is timed after two warm-up steps; the figures are ratios to the
first case, measured in one run.
"""
from __future__ import annotations

import time

import pytest
import torch

import harmony_fx
from harmony_fx.models import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, n_embd=64, dropout=0.0)
BATCH = 32
CASES = {"16": 16, "16 (forward 8)": {"forward": 8, "backward": 16}, "16 (forward 4)": {"forward": 4, "backward": 16},
         "8": 8, "8 (forward 2)": {"forward": 2, "backward": 8}}
_first: dict[str, float] = {}


def _loss(output, target):
    return torch.nn.functional.cross_entropy(output.reshape(-1, CONFIG.vocab_size), target.reshape(-1))


@pytest.mark.benchmark(group="microbatch sizes")
@pytest.mark.parametrize("case", CASES)
def test_step_time(benchmark, case):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    batch = (idx, torch.roll(idx, 1, dims=1))
    trainer = harmony_fx.Trainer(model, _loss, torch.optim.AdamW(model.parameters(), lr=1e-3), batch,
                                 microbatches=CASES[case], pack_boundaries=(0, 2, 4, 6, 8), devices=["host:0"],
                                 track_memory=False)
    try:
        for _ in range(2):
            trainer.step(batch)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            trainer.step(batch)
            times.append(time.perf_counter() - start)
        benchmark.pedantic(trainer.step, (batch,), rounds=1, iterations=1)
        seconds = sorted(times)[len(times) // 2]
        _first.setdefault("seconds", seconds)
        figures = {"median step ms": round(seconds * 1e3, 1), "vs first": round(seconds / _first["seconds"], 3),
                   "plan peak B": trainer.plan.predicted_peak["host:0"],
                   "forward microbatches": trainer.plan.forward_microbatches}
        benchmark.extra_info.update(figures)
        print(f"\nmicrobatches {case}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    finally:
        trainer.close()
