"""``calibrate``: this machine measured (FLOP/s, copies, the runtime's cost per task and per op),
kept in a cache file, and handed to the planner as a spec."""
from __future__ import annotations

import json
import types

import pytest
import torch

from harmony_fx import calibrate
from harmony_fx.planner.specs import PRESETS

FIGURES = {"fp32": 2e10, "bf16": 1e10, "copy": 5e9, "task": 1e-4, "op": 2e-6}


def test_measure_local_returns_positive_figures() -> None:
    spec = calibrate.measure_local()
    assert spec.name == "host"
    assert spec.flops["fp32"] > 0 and spec.flops["bf16"] > 0
    assert spec.memory_bandwidth > 0 and spec.host_bandwidth > 0 and spec.peer_bandwidth > 0
    assert spec.memory == 2**40  # default: not limited
    assert spec.efficiency == 1.0
    assert spec.inline  # a HostDevice runs each op as it is issued
    assert spec.compute_seconds(1e6, 1e6) > spec.launch_seconds


def test_measure_local_is_measured_once_and_takes_a_memory_size() -> None:
    assert calibrate.get_spec("host") is calibrate.measure_local()
    assert calibrate.measure_local("1GiB").memory == 2**30


def test_get_spec_names_a_preset_or_the_host() -> None:
    assert calibrate.get_spec("A100-80GB") is PRESETS["a100-80gb"]
    with pytest.raises(ValueError) as error:
        calibrate.get_spec("tpu-v9")
    assert all(name in str(error.value) for name in ["'tpu-v9'", "host", *PRESETS])


def test_a_host_device_is_predicted_with_this_machine_measured() -> None:
    host = types.SimpleNamespace(torch_device=torch.device("cpu"))
    assert calibrate.spec_for(host, budget=2**20) is calibrate.measure_local()


def test_figures_are_measured_once_then_read_from_the_cache_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HARMONY_FX_CACHE", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(calibrate, "measure_host", lambda: measured.append(1) or dict(FIGURES))
    assert calibrate.host_figures() == FIGURES and len(measured) == 1
    stored = json.loads((tmp_path / "cache" / "host_spec.json").read_text())
    (key,) = stored
    assert key.startswith(f"{calibrate.CACHE_VERSION}-torch{torch.__version__}-") and stored[key] == FIGURES
    assert calibrate.host_figures() == FIGURES and len(measured) == 1  # read, not measured again


def test_an_unreadable_cache_is_measured_again_and_a_read_only_one_is_left_alone(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(calibrate, "measure_host", lambda: dict(FIGURES))
    monkeypatch.setenv("HARMONY_FX_CACHE", str(tmp_path))
    (tmp_path / "host_spec.json").write_text("{not json")
    assert calibrate.host_figures() == FIGURES
    assert json.loads((tmp_path / "host_spec.json").read_text()) != {}
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setenv("HARMONY_FX_CACHE", str(blocked))
    assert calibrate.host_figures() == FIGURES  # nothing stored: measured again next time


def test_timing_the_runtime_leaves_the_callers_random_numbers_and_grad_mode_alone() -> None:
    state = torch.get_rng_state()
    with torch.no_grad():  # the runtime is timed forward and backward whatever the caller's mode
        per_task, per_op = calibrate._runtime_overheads(1e10, 1e10)  # seeds its own models, inside fork_rng
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), state)
    assert per_task >= 0 and per_op >= 0
