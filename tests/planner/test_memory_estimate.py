"""The planner's memory model against counts made apart from it.

* a layer's saved bytes against autograd's own saved tensors, counted here with
  ``saved_tensors_hooks`` on the eager module;
* the planner's simulated peak of the schedule a compile runs (a Trainer's, and a compiled module's
  called by the user) against the compiler's exact count (its FakeTensor run): at least it (too
  low, the compiler falls back to a slow search) and within 25% (too high wastes the budget; the
  demo's GPT was 2.06x before the layers were measured);
* a task's fixed cost charged once per task, against the closed form.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.frontend.capture import capture
from harmony_fx.planner.chain import Schedule, chain_schedule
from harmony_fx.planner.choose import device_spec
from harmony_fx.planner.costs import PackCosts
from harmony_fx.planner.profile import LayerProfile, ModelProfile, profile_graph
from harmony_fx.planner.simulate import simulate
from harmony_fx.planner.specs import DeviceSpec, HostSpec
from harmony_fx.program.actions import Action, ActionKind, Stream

WIDTH, BATCH = 16, 8


class _Blocks(nn.Module):
    """One block (a layer of its own: ``blocks.0``) that saves tensors of several kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                                                   nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x).sum()


def test_a_layers_saved_bytes_are_what_autograd_saves_of_what_it_made_and_its_output() -> None:
    model, x = _Blocks(), torch.randn(BATCH, WIDTH)
    profile = profile_graph("blocks", capture(model, (x,)).gm, BATCH)
    block = next(layer for layer in profile.layers if layer.name.startswith("blocks.0"))

    # autograd's saved tensors on the eager module, each storage once, less the block's input and
    # weights (made before it), and its output
    made_before = {t.untyped_storage()._cdata for t in [x, *model.parameters()]}
    saved: dict[int, int] = {}
    inputs_saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        (inputs_saved if storage._cdata in made_before else saved)[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model.blocks[0](x)
    saved[out.untyped_storage()._cdata] = out.untyped_storage().nbytes()
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    # the first Linear's output (the GELU's input), the GELU's (the second Linear's input), the
    # Tanh's (the block's output too)
    assert len(saved) == 3
    assert block.saved_bytes * BATCH == sum(saved.values())
    assert block.saved_input_bytes * BATCH == sum(n for key, n in inputs_saved.items() if key not in weights)
    assert block.saved_bytes < block.made_bytes  # the second Linear's output is not kept


def _gpt(layers: int, width: int, batch: int):
    from harmony_fx.models import GPTConfig, TinyGPT

    config = GPTConfig(vocab_size=64, block_size=32, n_layer=layers, n_head=4, n_embd=width, dropout=0.0)
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (batch, 32), generator=torch.Generator().manual_seed(0))
    return TinyGPT(config), (idx,), torch.roll(idx, 1, 1)


def _mlp():
    from harmony_fx.models import MLPChain

    torch.manual_seed(0)
    return MLPChain(), (torch.randn(32, 64),), torch.randint(0, 10, (32,))


def _loss(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


@pytest.mark.parametrize("build, fraction", [(lambda: _gpt(6, 32, 8), 0.25), (_mlp, 0.25)], ids=["gpt", "mlp_chain"])
def test_the_planners_peak_is_at_least_the_exact_one_and_within_25_percent(build, fraction: float) -> None:
    model, inputs, target = build()
    budget = int(eager_training_bytes(model, inputs, lambda out: _loss(out, target)) * fraction)
    trainer = harmony_fx.Trainer(model, _loss, torch.optim.SGD(model.parameters(), lr=0.1), (inputs, target),
                                 devices=["host:0"], memory_budget=budget)
    try:
        hm = trainer.hm
        schedule = hm.compiled.schedule
        assert schedule is not None and not any(stage.name == "fall back" for stage in hm.passes)
        size = hm.mb_sizes[0] or len(target)
        profile = profile_graph("model", hm.captured.gm, size)
        spec = device_spec(hm.devices[0], hm.budget)
        programs, costs = chain_schedule(profile, schedule, len(target), spec, HostSpec())
        estimate = max(simulate(programs, costs, spec, HostSpec(), 1).peak_bytes)
        exact = max(hm.plan.predicted_peak.values())
        assert exact <= estimate <= 1.25 * exact, (estimate, exact)
    finally:
        trainer.close()


@pytest.mark.parametrize("batch, fraction", [(8, 0.3), (16, 0.25)])
def test_the_planners_peak_of_a_compiled_module_is_at_least_the_exact_one_and_within_25_percent(
        batch: int, fraction: float) -> None:
    """``compile`` without a Trainer: the loss is the caller's, so the last pack runs every
    microbatch's forward and keeps their graphs for ``backward()``. Simulated as a Trainer's fused
    last pack (one microbatch's graph at a time), the planner chose one pack of 8 microbatches here,
    estimated below the exact count (0.58x-0.73x), and the compiler refused it for its own packing."""
    model, inputs, _ = _gpt(6, 32, batch)
    budget = int(eager_training_bytes(model, inputs, lambda out: out.float().mean()) * fraction)
    hm = harmony_fx.compile(model, inputs, memory_budget=budget, devices=["host:0"])
    schedule = hm.compiled.schedule
    # the planner's packs, as it chose them (the exact count did not refuse them)
    assert [stage.name for stage in hm.passes].count("plan packs") == 1
    assert schedule is not None and tuple(pack.layers[0] for pack in hm.packs) == schedule.boundaries
    assert not schedule.fuse_last
    profile = profile_graph("model", hm.captured.gm, hm.mb_sizes[0] or batch)
    spec = device_spec(hm.devices[0], hm.budget)
    programs, costs = chain_schedule(profile, schedule, batch, spec, HostSpec())
    estimate = max(simulate(programs, costs, spec, HostSpec(), 1).peak_bytes)
    exact = max(hm.plan.predicted_peak.values())
    assert exact <= estimate <= 1.25 * exact, (estimate, exact)


def test_a_one_layer_packs_recompute_and_backward_peaks_are_the_exact_ones() -> None:
    """small_cnn (conv, BatchNorm, ReLU blocks) at 25%: the compiler packs one block a pack. Each
    task's peak above what was resident at its start, as the planner counts it, against the
    compiler's FakeTensor run of the same task. Before, the recompute counted the saved input
    twice (in its graph key and in the input key it reads) and the backward its incoming and
    outgoing gradients twice (keys, and in the layer's measured working set): 1.33x and 2.0x."""
    from harmony_fx.testing.models import zoo

    entry = zoo()["small_cnn"]
    model, inputs, target = entry.build(0)
    budget = int(eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target)) * 0.25)
    trainer = harmony_fx.Trainer(model, entry.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), (inputs, target),
                                 devices=["host:0"], memory_budget=budget)
    try:
        hm = trainer.hm
        profile = profile_graph("model", hm.captured.gm, hm.mb_sizes[0] or len(target))
        boundaries = tuple(pack.layers[0] for pack in hm.packs)
        single = [pack.index for pack in hm.packs[:-1] if len(pack.layers) == 1]
        assert len(single) >= 4  # what this test is about: packs of one conv block
        schedule = Schedule(boundaries, hm.plan.microbatches, "single", 1)
        programs, costs = chain_schedule(profile, schedule, len(target), device_spec(hm.devices[0], hm.budget),
                                         HostSpec())
        exact = hm.compiled.candidate.estimates[0].task_memory
        compared = 0
        for action in programs[0]:
            if action.kind in (ActionKind.RECOMPUTE, ActionKind.BWD) and action.pack in single:
                estimate = costs.task_peak(action, sum(costs.key_bytes(key) for key in action.writes))
                _, peak = exact[(action.kind.name, action.pack, action.mb)]
                assert peak <= estimate <= 1.01 * peak, (action, estimate, peak)
                compared += 1
        assert compared == 2 * len(single) * hm.plan.microbatches
    finally:
        trainer.close()


def test_a_tasks_fixed_cost_is_charged_once_per_task_not_per_layer() -> None:
    layers = tuple(LayerProfile(f"l{i}", 0, 1000 * i, 1e6 * (i + 1), 8.0, 8.0, num_ops=3, made_bytes=64.0)
                   for i in range(4))
    profile = ModelProfile("chain", layers, 1, 8.0)
    for inline in (True, False):
        spec = DeviceSpec("toy", 10**9, {"fp32": 1e9}, 1e9, 1e9, 1e9, efficiency=1.0, launch_seconds=0.5,
                          inline=inline, op_seconds=1e-4, backward_ops=2.0)
        costs = PackCosts(profile, [[0, 1, 2, 3]], [2], spec, HostSpec(), lambda key: 0)
        for kind, flops, traffic, ops in ((ActionKind.FWD, 1, 1, 1.0), (ActionKind.BWD, 2, 2, 2.0)):
            kernels = [max(flops * layer.fwd_flops * 2 / 1e9, (traffic * 64.0 * 2 + layer.param_bytes) / 1e9)
                       for layer in layers]
            issue = 3 * 1e-4 * ops
            each = [k + issue if inline else max(k, issue) for k in kernels]
            action = Action(kind, Stream.COMPUTE, pack=0, mb=0)
            assert costs.compute_seconds(action) == pytest.approx(sum(each) + 0.5), (inline, kind)
    # measured seconds hold the runtime's cost already: nothing added
    measured = dataclasses.replace(profile, layers=tuple(dataclasses.replace(layer, seconds=((2, 1.0, 2.0),))
                                                         for layer in layers))
    costs = PackCosts(measured, [[0, 1, 2, 3]], [2], spec, HostSpec(), lambda key: 0)
    assert costs.compute_seconds(Action(ActionKind.FWD, Stream.COMPUTE, pack=0, mb=0)) == pytest.approx(4.0)
