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


# the tighter budgets out of the default suite (the small GPT's take 10-12 s each; tests/tiers.py): the default suite under 8 minutes
_CASES = [pytest.param(name, mode, fraction, id=f"{name}-{mode}-{fraction}",
                       marks=[pytest.mark.slow] if fraction == 0.25 or (name == "tiny_gpt" and fraction < 1) else [])
          for name in sorted(ZOO) for mode in sorted(SETTINGS) for fraction in (1.0, 0.5, 0.25)]


@pytest.mark.parametrize("name, mode, fraction", _CASES)
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
    predicted = simulate_module(hm, spec_for(hm.devices[0], hm.budget))
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
        predicted = simulate_module(trainer.hm, spec_for(trainer.hm.devices[0]))
        trainer.step(batch)
        assert predicted.bytes_moved == dict(trainer.hm.stats.bytes_by_kind)
        assert predicted.seconds > 0
    finally:
        trainer.close()


def test_each_packs_update_pays_the_optimizers_fixed_cost_per_call() -> None:
    """``HostSpec.update_call_seconds``: a Trainer steps the optimizer once per pack, so on a
    HostDevice (everything in turn) the step is that cost longer per UPDATE its programs hold."""
    import dataclasses

    import torch
    import torch.nn.functional as F
    from harmony_fx.planner.specs import HostSpec, host_measured
    from harmony_fx.program.actions import ActionKind
    from harmony_fx.testing.models import ResidualMLP
    from tests.helpers import QUIET

    torch.manual_seed(0)
    model = ResidualMLP()
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    trainer = harmony_fx.Trainer(model, F.cross_entropy, torch.optim.AdamW(model.parameters()), batch,
                                 pack_boundaries=(0, 2, 4, 6), microbatches=2)
    try:
        updates = sum(a.kind == ActionKind.UPDATE for f, b in trainer.hm.device_actions for a in f + b)
        spec, host = host_measured(QUIET), HostSpec(update_params_per_second=1e9, update_tensor_seconds=1e-5)
        before = simulate_module(trainer.hm, spec, host).seconds
        after = simulate_module(trainer.hm, spec, dataclasses.replace(host, update_call_seconds=0.01)).seconds
    finally:
        trainer.close()
    assert updates == 4
    assert after - before == pytest.approx(updates * 0.01)


def test_a_task_pays_the_specs_fixed_cost_once_and_its_ops_by_kind() -> None:
    """On a HostDevice whose arithmetic and copies cost nothing, a task takes the spec's fixed cost
    once (however many layers its pack holds) plus its forward's ops at ``op_seconds`` each, times
    ``recompute_ops`` for a recompute and ``backward_ops`` for a backward."""
    import dataclasses

    import torch
    from harmony_fx.planner.specs import HostSpec, host_measured
    from harmony_fx.testing.models import ResidualMLP
    from tests.helpers import QUIET

    torch.manual_seed(0)
    model = ResidualMLP()
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    hm = harmony_fx.compile(model, (batch[0],), pack_boundaries=(0, 2, 4, 6), microbatches=2)
    free = {**QUIET, "fp32": 1e30, "bf16": 1e30, "linear": 1e30, "copy": 1e30, "copy_action": 0.0}
    spec = dataclasses.replace(host_measured(free), launch_seconds=0.5, op_seconds=0.01, backward_ops=1.5,
                               recompute_ops=1.25)
    spans = {label: end - start for _, stream, label, start, end in simulate_module(hm, spec, HostSpec()).spans
             if stream == "compute"}
    ops = {pack.index: sum(n.op == "call_function" for n in pack.gm.graph.nodes) for pack in hm.packs}
    assert max(len(pack.layers) for pack in hm.packs) > 1  # a fixed cost per layer would show
    kinds = set()
    for label, seconds in spans.items():
        kind, pack = label.split()[0], int(label.split()[1][1:].split("@")[0])
        factor = {"FWD": 1.0, "RECOMPUTE": 1.25, "BWD": 1.5}[kind]
        assert seconds == pytest.approx(0.5 + factor * ops[pack] * 0.01), label
        kinds.add(kind)
    assert kinds == {"FWD", "RECOMPUTE", "BWD"}
