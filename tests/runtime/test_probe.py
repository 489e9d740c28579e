"""The planning run: one device's programs alone through the executor's ops, each compute task's
memory profiled, the device's peak noted after every action."""
from __future__ import annotations

import torch

import harmony_fx
from harmony_fx.ir import values as pytrees
from harmony_fx.lowering.tasks import grad_inputs
from harmony_fx.program.actions import Action, ActionKind, Key
from harmony_fx.runtime.devices import HostDevice
from harmony_fx.runtime.host import HostState
from harmony_fx.runtime.probe import Probe
from harmony_fx.testing.models import MLPChain

_COMPUTE = {ActionKind.FWD: "FWD", ActionKind.RECOMPUTE: "RECOMPUTE", ActionKind.BWD: "BWD"}


def _pipeline() -> harmony_fx.HarmonyModule:
    torch.manual_seed(0)
    model, x = MLPChain(width=16, depth=6), torch.randn(8, 16)
    hm = harmony_fx.compile(model, x, devices=["host:0", "host:1"], parallel="pp", microbatches=2,
                            pack_boundaries=(0, 2, 4), memory_budget=10**6, track_memory=True)
    hm(x).sum().backward()  # the measured peaks
    return hm


def _probe(hm: harmony_fx.HarmonyModule, device: HostDevice) -> Probe:
    """A probe of ``hm``'s packs on real tensors: every value it does not hold made as zeros of its shape."""
    compiled = hm.compiled
    shapes = compiled.shapes
    packs = compiled.packs

    def zeros(key: Key) -> object:
        return pytrees.map_tensors(lambda t: torch.zeros(t.shape, dtype=t.dtype), shapes.value_of(key))

    return Probe([compiled.packs_by_size[size] for size in shapes.mb_sizes], device,
                 HostState.of(packs, compiled.masters), [grad_inputs(pack, compiled.signature) for pack in packs],
                 zeros, compute_dtype=shapes.compute_dtype, split_dims=shapes.split_dims,
                 keeps_last_graph=not compiled.signature.forward_only)


def test_one_device_run_alone_reaches_the_peak_the_run_of_every_device_measured():
    """Device 1 of a pipeline receives its inputs from device 0 and sends gradients back: alone,
    what it receives is made and what it sends goes nowhere, and its peak is still the real one."""
    hm = _pipeline()
    for index, name in enumerate(["host:0", "host:1"]):
        device = HostDevice("probe")
        probe = _probe(hm, device)
        programs = hm.device_programs[index]
        probe.run_programs([programs["forward"], programs["backward"]])
        assert probe.peak == hm.stats.peak_bytes[name] == hm.plan.predicted_peak[name] > 0
        assert device.live_bytes() == 0  # everything it made it freed again


def test_every_compute_task_is_profiled_and_the_peak_noted_after_every_action():
    hm = _pipeline()
    probe = _probe(hm, HostDevice("probe"))
    programs = hm.device_programs[1]
    probe.run_programs([programs["forward"], programs["backward"]])
    forward, backward = hm.device_actions[1]
    actions: list[Action] = forward + backward
    compute = {(_COMPUTE[a.kind], a.pack, a.mb) for a in actions if a.kind in _COMPUTE}
    assert set(probe.task_memory) == compute
    assert all(peak >= max(net, 0) for net, peak in probe.task_memory.values())
    assert len(probe.peak_after_action) == len(actions)
    assert probe.peak_after_action == sorted(probe.peak_after_action)  # a running maximum
    assert probe.peak_after_action[-1] == probe.peak
    # the compile's estimate names the same action as the first at the peak
    first = probe.peak_after_action.index(probe.peak)
    assert hm.compiled.candidate.estimates[1].peak_at == (first, actions[first])


def test_the_peak_of_an_early_task_is_kept_across_the_later_tasks_resets():
    """Forward only: the first pack's wide hidden layer is the peak; the later, small tasks each
    reset the device's peak to profile themselves, and the probe's peak still holds the first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16),
                                torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    x = torch.randn(8, 16)
    with torch.no_grad():
        hm = harmony_fx.compile(model, x, devices=["host:0"], microbatches=1, pack_boundaries=(0, 3, 4),
                                memory_budget=10**6, track_memory=True)
        hm(x)
    assert hm.compiled.signature.forward_only
    probe = _probe(hm, HostDevice("probe"))
    probe.run_programs([hm.device_programs[0]["forward"]])
    first_task = probe.task_memory[("FWD", 0, 0)][1]
    assert all(peak < first_task for key, (_, peak) in probe.task_memory.items() if key != ("FWD", 0, 0))
    assert probe.peak == hm.stats.peak_bytes["host:0"] == hm.plan.predicted_peak["host:0"]
    actions = hm.device_actions[0][0]
    at_peak = probe.peak_after_action.index(probe.peak)
    assert str(actions[at_peak]) == "FWD p0@0 -> e3"
    assert probe.peak_after_action[at_peak:] == [probe.peak] * (len(actions) - at_peak)


def test_the_planning_device_copies_as_clone_does_in_a_fraction_of_the_dispatches():
    """A FakeHostDevice's copies (made directly, not through the mode's ``clone``) have clone's
    layout and a storage of their own, counted once, as a HostDevice counts its clones."""
    from torch._subclasses import FakeTensorMode

    from harmony_fx.runtime.probe import FakeHostDevice

    fake, real = FakeHostDevice("fake", None), HostDevice("real", None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        dense = torch.empty(6, 4)
        for source in (dense, dense.t(), dense[:, :3], torch.empty(5, dtype=torch.int64)):
            made, cloned = fake.to_device(source), real.to_device(source)
            assert (made.shape, made.stride(), made.dtype, made.device) == (
                cloned.shape, cloned.stride(), cloned.dtype, cloned.device)
            assert made.untyped_storage().nbytes() == cloned.untyped_storage().nbytes()
            assert made.untyped_storage()._cdata != source.untyped_storage()._cdata
            back = fake.to_host(made)
            assert back.untyped_storage()._cdata != made.untyped_storage()._cdata
            assert (back.shape, back.stride()) == (made.shape, made.stride())
            assert fake.live_bytes() == real.live_bytes()
