"""The NVMe tier measured on this machine. Run: ``python -m pytest benchmarks/test_nvme_tier.py -s``.

1. Bandwidth: a 256 MiB state file written as the tier writes it (``O_DIRECT`` through a
   page-aligned buffer, and buffered with ``fsync`` for comparison) and read back as the tier
   reads it (buffered, after the page cache dropped the file: cold; and right after writing it:
   from the page cache). Medians of five.
2. Overlap: the step of an 8-layer MLP (1024 wide, AdamW: 8 MiB of state per layer, one pack per
   two layers) with every pack's state on the tier against the same step in host memory: the
   exposed I/O time per step is the difference of the medians (a step's last writes go on into
   the next step's forward). Beside it: the reader's and writer's busy time, the time the updates
   waited for state the tier had not read yet (the last step's commit included), the most state in
   host memory at once on the tier's way, and the simulator's prediction of the same programs at
   the bandwidths measured in 1. Twice: the optimizer state alone on the tier; and, in bf16 with
   ``host_memory`` at the least that fits, the fp32 masters there too.
The tier's directory is a temporary directory on the project's disk (``TMPDIR`` moves it).
"""
from __future__ import annotations

import os
import pathlib
import re
import tempfile
import time

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.calibrate import spec_for
from harmony_fx.config import parse_size
from harmony_fx.planner.module import simulate_module
from harmony_fx.planner.specs import HostSpec
from harmony_fx.runtime import tier

SIZE = 256 * 2**20
_measured: dict[str, float] = {}


def _median(values):
    return sorted(values)[len(values) // 2]


@pytest.mark.benchmark(group="nvme tier")
def test_bandwidth(benchmark):
    data = torch.randint(0, 255, (SIZE,), dtype=torch.uint8)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as folder:
        path = pathlib.Path(folder) / "state"
        figures = {}
        for name, direct in (("write O_DIRECT", True), ("write buffered+fsync", False)):
            seconds = []
            for _ in range(5):
                start = time.perf_counter()
                file = tier._FileWriter(path, direct=direct)
                file.add(data)
                file.finish()
                seconds.append(time.perf_counter() - start)
            figures[f"{name} GB/s"] = round(SIZE / _median(seconds) / 1e9, 2)
        buffer = torch.empty(SIZE, dtype=torch.uint8)
        for name, cold in (("read cold", True), ("read from page cache", False)):
            seconds = []
            for _ in range(5):
                if cold:
                    fd = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                start = time.perf_counter()
                with open(path, "rb") as f:
                    f.readinto(buffer.numpy())
                seconds.append(time.perf_counter() - start)
            figures[f"{name} GB/s"] = round(SIZE / _median(seconds) / 1e9, 2)
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    _measured["write"] = figures["write O_DIRECT GB/s"] * 1e9
    _measured["read"] = figures["read cold GB/s"] * 1e9
    benchmark.extra_info.update(figures)
    print("\nnvme tier bandwidth, 256 MiB: " + ", ".join(f"{k} {v}" for k, v in figures.items()))


def _trainer(nvme_path=None, **options) -> harmony_fx.Trainer:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(7)] + [nn.Linear(1024, 16)]
    model = nn.Sequential(*layers)
    batch = (torch.randn(256, 1024), torch.randn(256, 16))
    return harmony_fx.Trainer(model, nn.functional.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-4), batch,
                              microbatches=4, pack_boundaries=(0, 2, 4, 6), devices=["host:0"], track_memory=False,
                              nvme_path=nvme_path, **options), batch


def _least_host_memory(folder, **options) -> int:
    """The smallest ``host_memory`` that fits, as the refusal of a smaller one names it."""
    try:
        _trainer(folder, host_memory=1, **options)
    except ValueError as refused:
        return parse_size(re.search(r"at least ([\d.]+ \w+)", str(refused)).group(1)) + 2**20
    raise AssertionError("one byte of host memory was enough")


@pytest.mark.benchmark(group="nvme tier")
@pytest.mark.parametrize("what", ["state", "masters"], ids=["optimizer state", "state and fp32 masters (bf16)"])
def test_exposed_io(benchmark, what):
    read, write = _measured.get("read", 2e9), _measured.get("write", 2e9)
    # the masters follow the state to the tier under bf16, when host memory holds no more than the least
    options = {"precision": "bf16"} if what == "masters" else {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as folder:
        tiered = {"host_memory": _least_host_memory(folder, **options)} if what == "masters" else {}
        results = {}
        for name, path, extra in (("host memory", None, {}), ("tier", folder, tiered)):
            trainer, batch = _trainer(path, **options, **extra)
            assert bool(trainer.plan.tier_master_packs) == (path is not None and what == "masters")
            try:
                for _ in range(2):
                    trainer.step(batch)
                # back to back, as training runs: a step's last writes overlap the next one's forward
                seconds, steps = [], []
                for _ in range(7):
                    start = time.perf_counter()
                    trainer.step(batch)
                    seconds.append(time.perf_counter() - start)
                    steps.append(trainer.stats)  # its tier figures are filled in once it is committed
                trainer.flush()
                waited = [stats.tier_wait_seconds for stats in steps]
                busy = [stats.tier_seconds for stats in steps]
                predicted = simulate_module(trainer.hm, spec_for(trainer.hm.devices[0]),
                                            HostSpec(nvme_read=read, nvme_write=write)).seconds
                results[name] = (_median(seconds), _median(waited), _median(busy), predicted,
                                 trainer.plan.tier_bytes, trainer.stats.tier_staged_peak)
            finally:
                trainer.close()
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    (base, _, _, base_predicted, *_), (tiered, waited, busy, predicted, state, staged) = results.values()
    figures = {"on the tier MiB": round(state / 2**20, 1), "state in flight at most MiB": round(staged / 2**20, 1), "step ms (host memory)": round(base * 1e3, 1),
               "step ms (tier)": round(tiered * 1e3, 1), "exposed I/O ms": round((tiered - base) * 1e3, 1),
               "I/O worker busy ms": round(busy * 1e3, 1), "updates waited for the tier ms": round(waited * 1e3, 1),
               "simulated step ms (host memory)": round(base_predicted * 1e3, 1),
               "simulated step ms (tier)": round(predicted * 1e3, 1),
               "simulated exposed I/O ms": round((predicted - base_predicted) * 1e3, 1)}
    benchmark.extra_info.update(figures)
    print(f"\nnvme tier overlap ({what}): " + ", ".join(f"{k} {v}" for k, v in figures.items()))
