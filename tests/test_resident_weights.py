"""Resident weights (``resident_weights=True``): a model that fits stays on the device that computes.

On a HostDevice the model, on the CPU, stands for one moved to that GPU: no weight is copied in,
no weight gradient out; the gradients stay beside the parameters in ``param.grad`` for the caller's
optimizer. Checked against eager (loss, every gradient, every buffer, and the weights after two
optimizer steps), against the non-resident run of the same packs (the same activation traffic, no
weight traffic), and against a witness of the device's memory.
"""
from __future__ import annotations

import copy

import pytest
import torch

import harmony_fx
from harmony_fx.calibrate import spec_for
from harmony_fx.models import MLPChain
from harmony_fx.planner.module import simulate_module
from tests.helpers import ATOL, RTOL, ZOO, assert_step_equal, train_step

PACKS = dict(microbatches=2, pack_boundaries=(0, 3, 6), devices=["host:0"], track_memory=True)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_each_zoo_model_steps_as_eager_within_its_budget(name):
    """BatchNorm statistics (small_cnn) updated once, dropout (tiny_gpt) drawn as eager draws it."""
    result = train_step(ZOO[name], 0.8, ["host:0"], resident_weights=True, track_memory=True)
    assert result.hm.compiled.resident_weights
    assert_step_equal(result)
    assert result.witnessed_peak <= result.budget
    moved = result.hm.stats.moved[0]
    assert not {kind for _, kind in moved} & {"weights", "wgrad"}, moved


def test_the_callers_optimizer_steps_the_resident_weights_as_eager_does():
    torch.manual_seed(0)
    model = MLPChain(width=64, depth=8)
    reference = copy.deepcopy(model)
    x = torch.randn(16, 64)
    hm = harmony_fx.compile(model, x, resident_weights=True, **PACKS)
    optimizer, ref_optimizer = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(reference.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        hm(x).square().mean().backward()
        reference(x).square().mean().backward()
        optimizer.step()
        ref_optimizer.step()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_no_weight_crosses_and_the_activations_move_as_without_residency():
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    runs = {}
    for resident in (False, True):
        model = MLPChain(width=64, depth=8)
        torch.manual_seed(0)
        hm = harmony_fx.compile(model, x, resident_weights=resident, **PACKS)
        hm(x).sum().backward()
        runs[resident] = (hm, model)
    (host_hm, host_model), (resident_hm, _) = runs[False], runs[True]
    host_moved, resident_moved = host_hm.stats.moved[0], resident_hm.stats.moved[0]
    weight_bytes = sum(p.numel() * p.element_size() for p in host_model.parameters())
    assert host_moved[("h2d", "weights")] >= weight_bytes  # the host run copies every weight in, at least once
    assert host_moved[("d2h", "wgrad")] == weight_bytes    # and every gradient out, once
    assert resident_moved == {k: n for k, n in host_moved.items() if k[1] not in ("weights", "wgrad")}
    # the plan says the same of itself
    assert resident_hm.plan.bytes_h2d == sum(n for (d, _), n in resident_moved.items() if d == "h2d")
    assert resident_hm.plan.bytes_d2h == sum(n for (d, _), n in resident_moved.items() if d == "d2h")
    assert "weights resident on host:0" in str(resident_hm.plan)
    # and the simulation of its step, which the GPU check sets beside the measured one
    simulated = simulate_module(resident_hm, spec_for(resident_hm.devices[0], resident_hm.budget))
    assert {k: n for k, n in simulated.bytes_moved.items() if n} == resident_moved


def test_the_plan_keeps_room_for_the_gradients_below_the_budget():
    torch.manual_seed(0)
    model = MLPChain(width=64, depth=8)
    model.blocks[0].requires_grad_(False)  # frozen: no gradient to keep room for
    x = torch.randn(16, 64)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    hm = harmony_fx.compile(model, x, resident_weights=True, **PACKS)
    assert hm.plan.margin == trainable
    assert "for the resident weights' gradients" in hm.plan.margin_note
    unpacked = {k: v for k, v in PACKS.items() if k != "pack_boundaries"}
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:  # room for the gradients alone
        harmony_fx.compile(model, x, resident_weights=True, memory_budget=trainable, **unpacked)
    smallest = refused.value.smallest_budget
    assert smallest > trainable
    hm = harmony_fx.compile(model, x, resident_weights=True, memory_budget=smallest, **unpacked)
    hm(x).sum().backward()
    assert hm.stats.peak_bytes["host:0"] <= smallest


@pytest.mark.parametrize("options, match", [
    (dict(devices=["host:0", "host:1"]), r"one device that computes, but devices= names 2"),
    (dict(devices=["host:0"], precision="bf16"), r"torch\.autocast"),
])
def test_what_resident_weights_cannot_do_is_refused_saying_what_to_do(options, match):
    model = MLPChain(width=16, depth=2)
    with pytest.raises(ValueError, match=match):
        harmony_fx.compile(model, torch.randn(4, 16), resident_weights=True, **options)


def test_the_trainer_refuses_resident_weights_naming_compile():
    model = MLPChain(width=16, depth=2)
    with pytest.raises(ValueError, match=r"Trainer steps the optimizer on the host.*harmony_fx\.compile"):
        harmony_fx.Trainer(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                           (torch.randn(4, 16), torch.randint(0, 10, (4,))), devices=["host:0"],
                           resident_weights=True)


def test_a_model_on_the_cpu_stays_in_host_memory_unless_asked():
    model = MLPChain(width=16, depth=2)
    hm = harmony_fx.compile(model, torch.randn(4, 16), devices=["host:0"])
    assert not hm.compiled.resident_weights
    assert hm.plan.bytes_h2d > 0 and "resident" not in str(hm.plan)
