"""Forward packs larger than the backward's (``forward_groups``): a group's weights come in together
and its packs run back to back on each microbatch; results, peaks and bytes stay exact."""
from __future__ import annotations

import pytest
import torch

import harmony_fx
from harmony_fx.lowering.tasks import ProgramSignature, forward_groups
from harmony_fx.program.actions import ActionKind as K
from tests.helpers import ZOO, assert_step_equal, train_step


# dropout and BatchNorm see each microbatch alone, so those two run one microbatch to equal eager
@pytest.mark.parametrize("name, microbatches", [("mlp_chain", 2), ("residual_mlp", 2), ("tiny_gpt", 1),
                                                ("small_cnn", 1)])
def test_grouped_forward_matches_eager_and_its_plan(name, microbatches):
    entry = ZOO[name]
    model, inputs, _ = entry.build(0)
    layers = len(harmony_fx.compile(model, inputs, microbatches=1, pack_boundaries=(0,)).compiled.layers)
    boundaries = tuple(range(0, layers, max(layers // 4, 1)))[:4]
    result = train_step(entry, 1.0, microbatches=microbatches, pack_boundaries=boundaries, forward_groups=(0, 2))
    assert_step_equal(result)
    hm = result.hm
    assert hm.stats.peak_bytes[hm.devices[0].name] == hm.plan.predicted_peak[hm.devices[0].name]
    assert dict(hm.stats.bytes_by_kind) == {tuple(k.split("/")): n for k, n in hm.plan.predicted_bytes.items()}
    # the two groups' weights come in together, before the group's first task
    forward = hm.forward_actions
    first_task = next(i for i, a in enumerate(forward) if a.kind == K.FWD)
    prefetched = {a.key.name for a in forward[:first_task] if a.kind == K.PREFETCH and a.key.kind.value == "W"}
    assert prefetched == {"p0", "p1", "p2", "p3"} & {f"p{i}" for i in range(len(boundaries))}
    # and run back to back on each microbatch: p0@0, p1@0, p0@1, p1@1, then the next group
    tasks = [(a.pack, a.mb) for a in forward if a.kind == K.FWD]
    assert tasks[:2 * microbatches] == ([(0, 0), (1, 0), (0, 1), (1, 1)] if microbatches == 2 else [(0, 0), (1, 0)])


def test_groups_must_start_at_zero_and_increase():
    signature = ProgramSignature((), (), frozenset(), frozenset(), (0,), forward_groups=(1, 2))
    with pytest.raises(ValueError, match="lower_program: forward groups"):
        forward_groups(signature, 3, "lower_program")
    with pytest.raises(ValueError, match="give both"):
        harmony_fx.compile(torch.nn.Linear(2, 2), torch.randn(2, 2), forward_groups=(0,))


@pytest.mark.parametrize("name", ["mlp_chain", "residual_mlp", "tiny_gpt"])
def test_pipeline_groups_match_eager_and_continue_the_wrap(name):
    """In a pipeline each group is one forward task of the wrap: groups (p0 p1) (p2 p3) run their
    forward on d0 and d1, and the backward continues the wrap from the last pack's device."""
    entry = ZOO[name]
    model, inputs, _ = entry.build(0)
    layers = len(harmony_fx.compile(model, inputs, microbatches=1, pack_boundaries=(0,)).compiled.layers)
    boundaries = tuple(range(0, layers, max(layers // 4, 1)))[:4]
    result = train_step(entry, 1.0, devices=["host:0", "host:1"], parallel="pp", microbatches=1,
                        pack_boundaries=boundaries, forward_groups=(0, 2))
    assert_step_equal(result)
    hm = result.hm
    for device in hm.devices:
        assert hm.stats.peak_bytes[device.name] == hm.plan.predicted_peak[device.name]
    assert dict(hm.stats.bytes_by_kind) == {tuple(k.split("/")): n for k, n in hm.plan.predicted_bytes.items()}
    ran = {(a.kind, a.pack): device for device, (forward, backward) in enumerate(hm.compiled.device_actions)
           for a in forward + backward if a.kind in (K.FWD, K.BWD)}
    assert [ran[(K.FWD, p)] for p in range(4)] == [0, 0, 1, 1]
    assert [ran[(K.BWD, p)] for p in (3, 2, 1, 0)] == [1, 0, 1, 0]
    # a group's packs hand values to each other on its device: only group edges cross devices
    sent = {a.key.name for forward, _ in hm.compiled.device_actions for a in forward if a.kind == K.SEND}
    assert sent and not sent & set(hm.packs[0].outputs) - set(hm.packs[2].act_inputs) - set(hm.packs[3].act_inputs)
