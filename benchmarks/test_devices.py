"""Bytes moved per device and step time on 1, 2 and 3 HostDevices, dp and pp (small GPT, 25%).

    OMP_NUM_THREADS=1 python -m pytest benchmarks/test_devices.py -s --benchmark-json=.benchmarks/devices.json

HostDevices share the machine's cores, so the step time shows the runtime's overhead and overlap,
not a speed-up a server with one GPU per device would see.
"""
from __future__ import annotations

import pytest
import torch

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.models import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, n_embd=64, dropout=0.0)
BATCH = 24
BOUNDARIES = (0, 7, 9, 11)  # 4 packs: embeddings, h.0, h.1 | h.2, h.3 | h.4, h.5 | h.6, h.7, head, loss


def _loss(output, target):
    return torch.nn.functional.cross_entropy(output.reshape(-1, CONFIG.vocab_size), target.reshape(-1))


@pytest.mark.benchmark(group="tiny_gpt step on several devices")
@pytest.mark.parametrize("parallel", ["dp", "pp", "pp-host"])
@pytest.mark.parametrize("num_devices", [1, 2, 3])
def test_step(benchmark, num_devices, parallel):
    """``pp-host``: the pipeline handing on through the host (``handoff="host"``)."""
    if num_devices == 1 and parallel != "dp":
        pytest.skip("one device has no pipeline")
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
    target = torch.roll(idx, 1, dims=1)
    budget = int(0.25 * eager_training_bytes(model, (idx,), lambda out: _loss(out, target)))
    trainer = harmony_fx.Trainer(model, _loss, torch.optim.AdamW(model.parameters(), lr=1e-3), ((idx,), target),
                                 devices=[f"host:{i}" for i in range(num_devices)], memory_budget=budget,
                                 microbatches=6, parallel=parallel.split("-")[0], pack_boundaries=BOUNDARIES,
                                 handoff="host" if parallel == "pp-host" else None, track_memory=True)
    trainer.step(((idx,), target))  # warm-up
    benchmark.pedantic(trainer.step, (((idx,), target),), rounds=5, iterations=1)
    per_device = trainer.stats.as_dict()["bytes_by_device"]
    for device in trainer.hm.devices:
        moved = sum(n for key, n in per_device.items() if key.startswith(device.name + " "))
        print(f"\n{parallel} on {num_devices} device(s): {device.name} moved {moved:,} B, peak {trainer.stats.peak_bytes[device.name]:,} B "
              f"(plan {trainer.plan.predicted_peak[device.name]:,} B, budget {budget:,} B), mean step "
              f"{benchmark.stats.stats.mean * 1e3:.0f} ms")
        benchmark.extra_info[f"{device.name} bytes"] = moved
        benchmark.extra_info[f"{device.name} peak"] = trainer.stats.peak_bytes[device.name]
    trainer.close()
