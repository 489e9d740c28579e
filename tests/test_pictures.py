"""``pictures``: the memory-over-time PNG and its refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx import api
from harmony_fx.models import MLPChain


def _module(**options):
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=3)
    x, target = torch.randn(8, 16), torch.randint(0, 10, (8,))
    return harmony_fx.compile(model, example_inputs=(x,), **options), x, target


def test_the_memory_plot_is_a_png_of_the_last_iteration(tmp_path):
    hm, x, target = _module()
    hm.record_timeline()
    F.cross_entropy(hm(x), target).backward()
    hm.plot_memory(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unrecorded_timeline_is_refused_before_anything_is_simulated(tmp_path, monkeypatch):
    def simulated(*args, **kwargs):
        raise AssertionError("simulated before the refusal")

    monkeypatch.setattr(api, "simulate_module", simulated)
    hm, x, target = _module()
    F.cross_entropy(hm(x), target).backward()
    with pytest.raises(ValueError, match="record_timeline"):
        hm.plot_memory(tmp_path / "memory.png")
    assert not (tmp_path / "memory.png").exists()


def test_recording_counts_an_untracked_host_devices_memory_for_the_recorded_calls_only():
    """A HostDevice knows its memory only while it counts every tensor: ``record_timeline()``
    counts them for the recorded calls (the memory the plot draws), ``memory=False`` records the
    spans alone, and stopping the recording stops the counting."""
    hm, x, target = _module(track_memory=False)

    def step():
        F.cross_entropy(hm(x), target).backward()
        return hm.stats

    hm.record_timeline()
    stats = step()
    assert stats.peak_bytes["host:0"] > 0 and 0 < max(live for _, live in stats.memory[0]) <= stats.peak_bytes["host:0"]
    hm.record_timeline(memory=False)
    stats = step()
    assert stats.spans and "host:0" not in stats.peak_bytes and not stats.memory
    hm.record_timeline(False)
    assert "host:0" not in step().peak_bytes and not hm.devices[0].track_memory


@pytest.mark.parametrize("memory", [True, False])
def test_the_plot_predicts_the_run_in_the_mode_it_ran(tmp_path, monkeypatch, memory):
    """Counted and recorded, or recorded alone: the simulation is handed this machine's spec for
    that mode, and the run's time is checked against it (``calibrate.check_prediction``)."""
    from harmony_fx import calibrate

    specs, checked = [], []
    real = api.simulate_module
    monkeypatch.setattr(api, "simulate_module", lambda hm, spec, host: specs.append((spec, host)) or real(hm, spec, host))
    monkeypatch.setattr(calibrate, "check_prediction", lambda measured, predicted: checked.append(measured) and False)
    hm, x, target = _module(track_memory=False)
    hm.record_timeline(memory=memory)
    F.cross_entropy(hm(x), target).backward()
    if not memory:
        with pytest.raises(ValueError, match=r"without the device's memory \(record_timeline\(memory=False\)\)"):
            hm.plot_memory(tmp_path / "memory.png")
        return
    hm.plot_memory(tmp_path / "memory.png")
    ((spec, host),) = specs
    assert spec == calibrate.spec_for(hm.devices[0], tracked=True, recorded=True) and host == calibrate.host_spec()
    assert checked == [max(end for *_, end in hm.stats.spans)]
