"""The simulator on compiled modules against what one real step measures: a consistency check.

Every zoo model, one device, data-parallel and pipeline over two HostDevices, budgets 100/50/25%
of eager training: predicted bytes moved equal measured exactly (per direction and kind), and
the predicted peak of every device is within 10% of the measured one. The simulator's task
memory comes from the planning run, so the peaks check its bookkeeping, not a second prediction.
"""
from __future__ import annotations

import pytest

import harmony_fx
from harmony_fx.calibrate import spec_for
from harmony_fx.planner.module import simulate_module
from tests.helpers import ZOO, eager_bytes

SETTINGS = {"single": (["host:0"], "auto", None), "dp": (["host:0", "host:1"], "dp", 2),
            "pp": (["host:0", "host:1"], "pp", 2)}


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("mode", sorted(SETTINGS))
@pytest.mark.parametrize("name", sorted(ZOO))
def test_simulation_is_consistent_with_the_planning_run(name: str, mode: str, fraction: float) -> None:
    """A consistency check, not an independent prediction: ``simulate_module`` takes each task's
    memory from the planning FakeTensor run, so agreeing with the measured peak (within 10%: it
    treats a task's peak as one spike on what was resident) checks the simulator's bookkeeping of
    issue order and lifetimes. The memory figures are checked independently in test_memory_cap.py;
    the bytes moved here are counted from shapes, against the runtime's counters."""
    entry = ZOO[name]
    devices, parallel, microbatches = SETTINGS[mode]
    model, inputs, target = entry.build(0)
    hm = harmony_fx.compile(model, inputs, memory_budget=int(eager_bytes(name) * fraction), devices=devices,
                            parallel=parallel, microbatches=microbatches)
    predicted = simulate_module(hm, spec_for(hm.device, hm.budget))
    entry.loss_fn(hm(*inputs), target).backward()

    assert predicted.bytes_moved == dict(hm.stats.bytes_by_kind)
    for device, simulated in zip(hm.devices, predicted.peak_bytes):
        measured = hm.stats.peak_bytes.get(device.name, 0)
        assert abs(simulated - measured) <= 0.10 * max(measured, 1), (device.name, simulated, measured)
        assert simulated <= hm.budget
    assert predicted.seconds > 0


@pytest.mark.parametrize("mode", sorted(SETTINGS))
def test_simulation_of_larger_forward_microbatches(mode: str) -> None:
    """The forward's microbatches are keys of their own (numbered after the backward's): the
    simulator sizes their tasks and copies as the runtime counts them."""
    import torch
    import torch.nn.functional as F
    from harmony_fx.testing.models import ResidualMLP

    devices, parallel, _ = SETTINGS[mode]
    torch.manual_seed(0)
    model = ResidualMLP()
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    trainer = harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                                 microbatches={"forward": 2, "backward": 8}, pack_boundaries=(0, 2, 4, 6),
                                 devices=devices, parallel=parallel)
    try:
        predicted = simulate_module(trainer.hm, spec_for(trainer.hm.device))
        trainer.step(batch)
        assert predicted.bytes_moved == dict(trainer.hm.stats.bytes_by_kind)
        assert predicted.seconds > 0
    finally:
        trainer.close()
