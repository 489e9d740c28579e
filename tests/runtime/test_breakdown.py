"""``runtime.breakdown``: a recorded step's time shared out among compute, recompute, copies
exposed, the optimizer exposed and the runtime, without counting an instant twice."""
from __future__ import annotations

import pytest
import torch

from harmony_fx.runtime.breakdown import PARTS, step_breakdown


def test_each_instant_goes_to_the_first_part_that_applies() -> None:
    spans = [
        (0, "h2d", "PREFETCH weights[p0]", 0.0, 1.0),    # copy alone: exposed
        (0, "compute", "FWD p0@0", 1.0, 3.0),
        (0, "h2d", "PREFETCH weights[p1]", 2.0, 4.0),    # half under the forward: 1.0 exposed
        (0, "compute", "RECOMPUTE p0@0", 5.0, 6.0),
        (1, "compute", "BWD p1@0", 5.5, 7.0),            # another device's backward: compute wins
        (0, "compute", "FREE act[x@0]", 7.0, 7.5),       # bookkeeping: the runtime's
        (0, "d2h", "OFFLOAD wgrad[p0]", 8.0, 8.5),
    ]
    parts = step_breakdown(spans, step_seconds=10.0, optimizer_exposed=0.75)
    assert list(parts) == list(PARTS)
    assert parts["compute"] == pytest.approx(2.0 + 1.5)
    assert parts["recompute"] == pytest.approx(0.5)
    assert parts["copies exposed"] == pytest.approx(1.0 + 1.0 + 0.5)
    assert parts["optimizer exposed"] == 0.75
    assert parts["runtime"] == pytest.approx(10.0 - 3.5 - 0.5 - 2.5 - 0.75)
    assert sum(parts.values()) == pytest.approx(10.0)


def test_a_real_step_adds_up_to_its_time() -> None:
    import harmony_fx
    from harmony_fx.models import MLPChain

    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    batch = (torch.randn(8, 16), torch.randint(0, 10, (8,)))
    trainer = harmony_fx.Trainer(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                                 batch, pack_boundaries=(0, 2, 4), microbatches=2, track_memory=False)
    try:
        trainer.record_timeline(memory=False)
        trainer.step(batch)
        stats = trainer.stats
        step_seconds = max(end for *_, end in stats.spans) + stats.update_exposed_seconds
        parts = step_breakdown(stats.spans, step_seconds, stats.update_exposed_seconds)
    finally:
        trainer.close()
    assert parts["compute"] > 0 and parts["recompute"] > 0 and parts["copies exposed"] >= 0
    assert sum(parts.values()) == pytest.approx(step_seconds)
    assert "host:0" not in stats.peak_bytes  # spans alone: the memory was not counted, so no peak is reported
