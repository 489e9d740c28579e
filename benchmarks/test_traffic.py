"""Bytes moved per iteration (exact counters, not timings) and the share of optimizer time hidden.

    python -m pytest benchmarks/test_traffic.py -s

Prints, for the small GPT at 25% of eager's memory with the Trainer:

* weight traffic with input-batch grouping off / on at 16 microbatches (target >= 10x);
* total bytes moved / the lower bound 2*W in + W grads out + 2*stash (target <= 1.1), where W
  is the bytes of the weights and stash the bytes of pack inputs sent to the host and back;
* the share of the host optimizer's time hidden behind the backward.
Each is also recorded in the benchmark's ``extra_info``.
"""
from __future__ import annotations

import pytest
import torch

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.models import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, n_embd=64, dropout=0.0)
BATCH = 32


def _loss(output, target):
    return torch.nn.functional.cross_entropy(output.reshape(-1, CONFIG.vocab_size), target.reshape(-1))


def _trainer(microbatches: int, grouping: bool, boundaries=None):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    target = torch.roll(idx, 1, dims=1)
    budget = int(0.25 * eager_training_bytes(model, (idx,), lambda out: _loss(out, target)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = harmony_fx.Trainer(model, _loss, optimizer, ((idx,), target), memory_budget=budget,
                                 microbatches=microbatches, grouping=grouping, pack_boundaries=boundaries)
    return trainer, ((idx,), target)


def test_grouping_traffic(benchmark):
    grouped, batch = _trainer(16, True)
    boundaries = tuple(pack.layers[0] for pack in grouped.hm.packs)
    ungrouped, _ = _trainer(16, False, boundaries)
    grouped.step(batch)
    benchmark.pedantic(ungrouped.step, (batch,), rounds=1, iterations=1)
    on = grouped.stats.as_dict()["bytes_by_kind"]["h2d/weights"]
    off = ungrouped.stats.as_dict()["bytes_by_kind"]["h2d/weights"]
    benchmark.extra_info.update(weights_in_grouped=on, weights_in_ungrouped=off, ratio=off / on)
    print(f"\nweights host->device per step at 16 microbatches: grouping on {on:,} B, off {off:,} B: {off / on:.1f}x")
    assert off / on >= 10


@pytest.mark.parametrize("microbatches", [1, 4])
def test_bytes_vs_lower_bound_and_hidden_update(benchmark, microbatches):
    trainer, batch = _trainer(microbatches, True)
    trainer.step(batch)  # warm-up
    benchmark.pedantic(trainer.step, (batch,), rounds=3, iterations=1)
    stats = trainer.stats.as_dict()
    kinds = stats["bytes_by_kind"]
    weights = sum(pack.weight_bytes for pack in trainer.plan.packs)
    stash = kinds.get("d2h/act", 0)
    bound = 2 * weights + kinds.get("d2h/wgrad", 0) + 2 * stash
    moved = stats["bytes_h2d"] + stats["bytes_d2h"]
    hidden = 1 - stats["update_exposed_seconds"] / max(stats["update_seconds"], 1e-12)
    benchmark.extra_info.update(moved=moved, lower_bound=bound, ratio=moved / bound, update_hidden_share=hidden)
    print(f"\n{microbatches} microbatch(es), {len(trainer.plan.packs)} packs: moved {moved:,} B, lower bound {bound:,} B, "
          f"ratio {moved / bound:.3f}; optimizer time {stats['update_seconds'] * 1000:.1f} ms, hidden {hidden:.0%}")
