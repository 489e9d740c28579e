"""What the atomic step's undo copy costs: ``Trainer(atomic=True)`` (the default: parameters and
optimizer state copied before each update, so a failed step is put back) against ``atomic=False``,
on one HostDevice, in one run.

    python -m pytest benchmarks/test_undo_copy.py -s
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.models import MLPChain


def _median_step(atomic: bool) -> tuple[float, int]:
    torch.manual_seed(0)
    model = MLPChain(width=1024, depth=12)  # 12.6M parameters: 50 MB fp32, AdamW's state 100 MB more
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
    trainer = harmony_fx.Trainer(model, F.cross_entropy, torch.optim.AdamW(model.parameters()), (x, y),
                                 memory_budget="40MiB", microbatches=2, atomic=atomic, track_memory=False)
    try:
        trainer.step((x, y))
        trainer.step((x, y))  # the optimizer's state and the undo copies' memory exist from here on
        times = []
        for _ in range(7):
            started = time.perf_counter()
            trainer.step((x, y))
            times.append(time.perf_counter() - started)
    finally:
        trainer.close()
    return statistics.median(times), sum(p.numel() for p in model.parameters())


def test_undo_copy_cost_per_step():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (atomic, params), (plain, _) = _median_step(True), _median_step(False)
    finally:
        torch.set_num_threads(threads)
    print(f"\n{params / 1e6:.1f}M parameters, AdamW: atomic {atomic * 1e3:.1f} ms, atomic=False {plain * 1e3:.1f} ms: "
          f"the undo copy costs {(atomic - plain) * 1e3:.1f} ms a step ({(atomic - plain) / atomic:.0%})")
