"""estimate_device: one device's programs run on FakeTensors, before anything runs for real.

Its peak is the peak ``DeviceMemoryWitness`` (tests/memory_witness.py) counts when the compiled
programs run on real tensors: on one device, on each device of data-parallel and of a pipeline,
over microbatches of uneven size, with dropout. Each forward task's net bytes are its output's,
counted here from the shapes. The action it names as where the peak is first held is the first
after which the programs, cut there, reach it.
"""
from __future__ import annotations

from typing import Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.compiler.estimate import DeviceEstimate, estimate_device
from harmony_fx.models import MLPChain
from harmony_fx.program.actions import Action
from tests.memory_witness import DeviceMemoryWitness

WIDTH, BATCH = 16, 10
BOUNDARIES = (0, 2, 4)  # MLPChain(depth=6): blocks 0-1 | blocks 2-3 | blocks 4-5 + head
TWO = ["host:0", "host:1"]


def _compiled(model: nn.Module | None = None, **options) -> tuple[harmony_fx.HarmonyModule, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = model or MLPChain(width=WIDTH, depth=6)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    target = torch.randint(0, 4, (BATCH,), generator=generator)
    return harmony_fx.compile(model, (x,), pack_boundaries=BOUNDARIES, **options), x, target


def _estimate(hm: harmony_fx.HarmonyModule, device: int, forward: Sequence[Action] | None = None,
              backward: Sequence[Action] | None = None) -> DeviceEstimate:
    """``estimate_device`` of ``device``'s programs as ``hm`` compiled them (or of ``forward`` and
    ``backward`` in their place)."""
    compiled = hm.compiled
    layout = compiled.layout
    own_forward, own_backward = compiled.device_actions[device]
    microbatches = layout.device_microbatches[device] + tuple(f for f, _ in layout.device_forward_parts(device))
    return estimate_device(own_forward if forward is None else forward, own_backward if backward is None else backward,
                           microbatches, compiled.packs_by_size, compiled.shapes, compiled.candidate.signature,
                           compiled.devices[device].torch_device)


def _witnessed_step(hm: harmony_fx.HarmonyModule, x: torch.Tensor, target: torch.Tensor) -> DeviceMemoryWitness:
    torch.manual_seed(2)
    with DeviceMemoryWitness() as witness:
        F.cross_entropy(hm(x), target).backward()
    return witness


@pytest.mark.parametrize("options", [
    dict(microbatches=1),
    dict(microbatches=3),  # 4, 3, 3 samples
    dict(microbatches=4, devices=TWO, parallel="dp"),
    dict(microbatches=3, devices=TWO, parallel="pp"),
], ids=["one", "uneven", "dp", "pp"])
def test_the_peak_is_what_the_real_run_holds_on_each_device(options):
    hm, x, target = _compiled(**options)
    estimates = [_estimate(hm, device) for device in range(len(hm.devices))]
    witness = _witnessed_step(hm, x, target)
    for device, estimate in zip(hm.devices, estimates):
        assert estimate.peak > 0
        assert estimate.peak == witness.peak_of(device), device.name


def test_a_forward_task_nets_its_output_at_each_microbatch_size():
    """Packs 0 and 1 keep no graph in the forward (they recompute): what their task leaves on the
    device is its output, one ``(samples, WIDTH)`` fp32 activation, whatever it held on the way."""
    hm, _, _ = _compiled(microbatches=3)
    estimate = _estimate(hm, 0)
    samples = [len(piece) for piece in torch.tensor_split(torch.arange(BATCH), 3)]
    assert samples == [4, 3, 3]
    for pack in (0, 1):
        for mb, size in enumerate(samples):
            net, peak = estimate.task_memory[("FWD", pack, mb)]
            assert net == size * WIDTH * 4, (pack, mb)
            assert peak >= net + size * WIDTH * 4  # the Linear's output beside the ReLU's
    assert {kind for kind, _, _ in estimate.task_memory} == {"FWD", "RECOMPUTE", "BWD"}


@pytest.mark.parametrize("options", [dict(microbatches=2), dict(microbatches=2, devices=TWO, parallel="pp")],
                         ids=["one", "pp"])
def test_the_peak_is_first_held_after_the_action_it_names(options):
    hm, _, _ = _compiled(**options)
    for device, (forward, backward) in enumerate(hm.compiled.device_actions):
        estimate = _estimate(hm, device)
        index, action = estimate.peak_at
        actions = forward + backward
        assert actions[index] is action

        def cut(end: int) -> int:  # the peak of the programs' first ``end`` actions
            return _estimate(hm, device, actions[:min(end, len(forward))], actions[len(forward):end]).peak

        assert cut(index + 1) == estimate.peak > cut(index)


def test_with_dropout_the_peak_is_the_real_runs_too():
    """A random pack replays its draws in the recompute: the masks count, on FakeTensors as for real."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(0.5)) for _ in range(5)],
                          nn.Linear(WIDTH, 4))
    hm, x, target = _compiled(model, microbatches=2)
    assert all(pack.random for pack in hm.packs)
    estimate = _estimate(hm, 0)
    assert hm.devices[0].live_bytes() == 0  # the estimate ran on a device of its own
    assert estimate.peak == _witnessed_step(hm, x, target).peak_of(hm.devices[0])


def test_a_capped_run_stops_where_it_passes_the_cap():
    """Under a cap the run stops at the first action that passes it (a search learns that a
    packing does not fit without running the rest); at its peak it runs to the end."""
    hm, _, _ = _compiled(microbatches=2)
    whole = _estimate(hm, 0)
    compiled = hm.compiled
    forward, backward = compiled.device_actions[0]

    def capped(cap: int) -> DeviceEstimate:
        return estimate_device(forward, backward, compiled.layout.device_microbatches[0], compiled.packs_by_size,
                               compiled.shapes, compiled.candidate.signature, compiled.devices[0].torch_device, cap=cap)

    assert capped(whole.peak) == whole and whole.complete
    stopped = capped(whole.peak - 1)
    assert not stopped.complete and stopped.peak == whole.peak and stopped.task_memory == {}
