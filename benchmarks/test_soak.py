"""Soak: 1,000 Trainer steps of a small GPT on 2 HostDevices in chaos mode (every stream on its own
thread, with random delays), data-parallel, next to eager training of an identical copy.

Checks every step's loss against eager, that host memory stays flat after warm-up (resident set
size, from /proc), and that no thread is left once the trainer is closed. Run:
``python -m pytest benchmarks/test_soak.py -s`` (about two minutes; not part of the default run).
"""
from __future__ import annotations

import copy
import os
import threading

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.models import GPTConfig, TinyGPT

STEPS = int(os.environ.get("HARMONY_SOAK_STEPS", 1000))
WARM_UP = 100


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@pytest.mark.slow
def test_soak_chaos_two_devices(benchmark):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.0)
    model = TinyGPT(config)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (8, 16), generator=generator) for _ in range(16)]
    x = batches[0]
    budget = int(0.35 * eager_training_bytes(model, (x,), lambda out: _loss(out, torch.roll(x, 1, 1))))
    threads_before = set(threading.enumerate())
    trainer = harmony_fx.Trainer(model, _loss, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                 ((x,), torch.roll(x, 1, 1)), devices=["host:0", "host:1"], parallel="dp",
                                 microbatches=4, memory_budget=budget, chaos=7)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    worst, rss = 0.0, {}

    def soak():
        nonlocal worst
        for step in range(STEPS):
            x = batches[step % len(batches)]
            target = torch.roll(x, 1, 1)
            loss = trainer.step(((x,), target))
            reference_loss = _loss(reference(x), target)
            reference_loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            worst = max(worst, abs(loss.item() - reference_loss.item()) / abs(reference_loss.item()))
            if step + 1 in (WARM_UP, STEPS):
                rss[step + 1] = _rss_bytes()

    benchmark.pedantic(soak, rounds=1, iterations=1)
    trainer.close()
    left = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    growth = rss[STEPS] / rss[WARM_UP] - 1
    benchmark.extra_info.update(steps=STEPS, worst_relative_loss_difference=worst, rss_warm=rss[WARM_UP],
                                rss_end=rss[STEPS], rss_growth=growth, threads_left=len(left))
    print(f"\nsoak: {STEPS} steps, worst relative loss difference vs eager {worst:.2e}, host RSS after "
          f"{WARM_UP} steps {rss[WARM_UP] / 2**20:.1f} MiB, after {STEPS} {rss[STEPS] / 2**20:.1f} MiB "
          f"({growth:+.2%}), threads left {len(left)}")
    assert worst < 1e-4
    assert growth < 0.02
    assert not left, left
