"""Forward microbatches larger than the backward's (``microbatches={"forward": Mf, "backward": Mb}``):
training equals eager and the same model with one microbatch size, on one device, data-parallel
and in a pipeline; measured peaks and bytes equal the plan's; the program cuts the forward's stash on
the host (``SPLIT``) and runs the fused last pack in the backward; what cannot work is refused."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.models import GPTConfig, MLPChain, TinyGPT
from harmony_fx.program.actions import ActionKind
from harmony_fx.testing.models import ResidualMLP, _cross_entropy

RTOL, ATOL = 1e-5, 1e-6
SIZES = {"forward": 2, "backward": 8}  # forward microbatches 4x the backward's
BOUNDARIES = (0, 2, 4, 6)
DEVICES = {"one": {}, "dp": {"devices": ["host:0", "host:1"], "parallel": "dp"},
           "pp": {"devices": ["host:0", "host:1"], "parallel": "pp"}}


def _batch(name: str):
    g = torch.Generator().manual_seed(1)
    if name == "tiny_gpt":
        return (torch.randint(0, 96, (16, 16), generator=g),), torch.randint(0, 96, (16, 16), generator=g)
    return (torch.randn(32, 64, generator=g),), torch.randint(0, 10, (32,), generator=g)


MODELS = {
    "mlp_chain": (MLPChain, F.cross_entropy),
    "residual_mlp": (ResidualMLP, F.cross_entropy),  # skip values cross packs through the host
    "tiny_gpt": (lambda: TinyGPT(GPTConfig(dropout=0.0)), _cross_entropy),
}


def _model(name: str):
    torch.manual_seed(0)
    return MODELS[name][0]()


@functools.lru_cache(maxsize=None)
def _run(name: str, microbatches, devices: str, optimizer: str, steps: int):
    model = _model(name)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1), "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2)}[optimizer]
    batch = _batch(name)
    trainer = harmony_fx.Trainer(model, MODELS[name][1], make(model.parameters()), batch,
                                 microbatches=dict(microbatches) if isinstance(microbatches, tuple) else microbatches,
                                 pack_boundaries=BOUNDARIES, **DEVICES[devices])
    try:
        losses = [trainer.step(batch) for _ in range(steps)]
    finally:
        trainer.close()
    return trainer, losses, [p.detach().clone() for p in model.parameters()]


def _apart(name: str, devices: str, optimizer: str = "sgd", steps: int = 1):
    return _run(name, tuple(SIZES.items()), devices, optimizer, steps)


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_one_step_equals_eager(name, devices):
    trainer, (loss,), params = _apart(name, devices)
    model, (inputs, target) = _model(name), _batch(name)
    reference = MODELS[name][1](model(*inputs), target)
    reference.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # SGD: the new weights carry every gradient
    torch.testing.assert_close(loss, reference.detach(), rtol=RTOL, atol=ATOL)
    for param, expected in zip(params, model.parameters()):
        torch.testing.assert_close(param, expected.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name == "tiny_gpt" else [])
                                  for name in MODELS])  # tiny_gpt: 10 s each, slow (the suite under 8 minutes)
def test_adamw_steps_equal_one_microbatch_size(name, devices):
    """The backward's microbatches compute what they compute with one size: equal to the last bits a
    CPU's matrix kernels leave to the number of rows (bitwise on some CPUs; on others a GEMM over 8
    rows blocks its sums otherwise than one over 4). AdamW's normalised step turns such a rounding
    difference of a gradient near zero into a visible one (up to its lr, 1e-2): the parameters are
    compared at 1% of that lr, the losses at fp32 rounding."""
    _, losses, params = _apart(name, devices, "adamw", 3)
    _, same_losses, same_params = _run(name, SIZES["backward"], devices, "adamw", 3)
    torch.testing.assert_close(torch.stack(losses), torch.stack(same_losses), rtol=1e-6, atol=0)
    for param, expected in zip(params, same_params):
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-4)


# one device in the default suite; data-parallel and pipeline (9-20 s each): tests/tiers.py
@pytest.mark.parametrize("devices", [d if d == "one" else pytest.param(d, marks=pytest.mark.slow) for d in DEVICES])
def test_measured_peaks_and_bytes_equal_the_plan(devices, memory_witness):
    model, batch = _model("tiny_gpt"), _batch("tiny_gpt")
    trainer = harmony_fx.Trainer(model, _cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                                 microbatches=SIZES, pack_boundaries=BOUNDARIES, **DEVICES[devices])
    try:
        trainer.step(batch)
        for device in trainer.hm.devices:
            assert memory_witness.peak_of(device) == trainer.stats.peak_bytes[device.name] \
                == trainer.plan.predicted_peak[device.name]
        assert dict(trainer.stats.as_dict()["bytes_by_kind"]) == trainer.plan.predicted_bytes
    finally:
        trainer.close()


def test_stash_bytes_are_those_of_one_size_but_the_last_pack_inputs():
    """The stash leaves once, at the forward's size, and comes back cut into the backward's: the
    same bytes as with one size, except the last pack's inputs made by the pack before it, which
    one size keeps on the device from its forward and larger forward microbatches fetch back."""
    apart, _, _ = _apart("residual_mlp", "one")
    same, _, _ = _run("residual_mlp", SIZES["backward"], "one", "sgd", 1)
    moved, same_moved = apart.plan.predicted_bytes, same.plan.predicted_bytes
    assert moved["d2h/act"] == same_moved["d2h/act"]
    before, last = apart.hm.packs[-2:]
    kept = [v for v in last.act_inputs if v in before.outputs]
    width = 64 * 4  # ResidualMLP's activations: [batch, 64] floats
    assert kept and moved["h2d/act"] - same_moved["h2d/act"] == len(kept) * 32 * width
    assert {k: v for k, v in moved.items() if "act" not in k} == {k: v for k, v in same_moved.items() if "act" not in k}


def test_program_cuts_the_stash_on_the_host_and_runs_the_last_pack_in_the_backward():
    trainer, _, _ = _apart("residual_mlp", "one")
    hm, last = trainer.hm, len(trainer.hm.packs) - 1
    forward, backward = hm.forward_actions, hm.backward_actions
    computed = lambda actions: {(a.kind, a.pack, a.mb) for a in actions  # noqa: E731
                                if a.kind in (ActionKind.FWD, ActionKind.BWD, ActionKind.RECOMPUTE)}
    # the forward runs the larger microbatches (8 and 9) and never the last pack
    assert computed(forward) == {(ActionKind.FWD, p, mb) for p in range(last) for mb in (8, 9)}
    assert {(ActionKind.FWD, last, mb) for mb in range(8)} <= computed(backward)
    assert not [a for a in backward if a.kind == ActionKind.FWD and a.pack != last]
    splits = [a for a in forward if a.kind == ActionKind.SPLIT]
    assert splits and forward[-len(splits):] == splits  # after the host waited for every copy
    assert {tuple(k.mb for k in a.writes) for a in splits} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert "rt.split('act[" in hm.code  # in the generated program


def test_dropout_is_refused_with_what_to_do():
    model, batch = TinyGPT(GPTConfig()), _batch("tiny_gpt")
    with pytest.raises(ValueError, match=r"draw random numbers \(dropout\).*microbatches=N"):
        harmony_fx.Trainer(model, _cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                           microbatches=SIZES, pack_boundaries=BOUNDARIES)


def test_compile_without_a_loss_in_the_graph_is_refused():
    model, (inputs, _) = _model("mlp_chain"), _batch("mlp_chain")
    with pytest.raises(ValueError, match="harmony_fx.Trainer"):
        harmony_fx.compile(model, inputs, microbatches=SIZES)


@pytest.mark.parametrize("given, message", [
    ({"forward": 3, "backward": 8}, "multiple of the forward's"),
    ({"forward": 2}, "two positive ints"),
    ({"forward": 2, "backward": 8, "extra": 1}, "two positive ints"),
    ({"forward": 0, "backward": 8}, "two positive ints"),
])
def test_malformed_sizes_are_refused(given, message):
    with pytest.raises(ValueError, match=message):
        harmony_fx.CompileOptions(microbatches=given)


def test_equal_counts_mean_one_size():
    options = harmony_fx.CompileOptions(microbatches={"forward": 4, "backward": 4})
    assert options.microbatches == 4 and options.forward_microbatches is None


def test_the_plan_states_the_four_choices():
    trainer, _, _ = _apart("residual_mlp", "one")
    plan = trainer.plan
    # the forward runs packs 0-2 (the last runs in the backward) on 2 microbatches
    assert (plan.forward_microbatches, plan.forward_packs, plan.microbatches, len(plan.packs)) == (2, 3, 8, 4)
    assert "Ufwd = 16, Pfwd = 3, Ubwd = 4, Pbwd = 4" in trainer.hm.explain()  # 32 samples
    same, _, _ = _run("residual_mlp", 8, "one", "sgd", 1)
    assert (same.plan.forward_microbatches, same.plan.forward_packs) == (8, 4)
