"""``planner.specs``: device presets, the roofline, and this machine measured as a device."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from harmony_fx.planner.specs import PRESETS, DeviceSpec, HostSpec, get_spec, measure_local

# A device whose arithmetic is easy to follow: 100 FLOP/s peak at 50% efficiency, 10 B/s memory.
TOY = DeviceSpec("toy", 1000, {"fp32": 100.0, "bf16": 400.0}, memory_bandwidth=10.0, host_bandwidth=5.0,
                 peer_bandwidth=5.0, efficiency=0.5, launch_seconds=0.25)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_returned_by_name(name: str) -> None:
    spec = get_spec(name)
    assert spec is PRESETS[name]
    assert not spec.inline  # GPUs overlap copies with compute
    assert spec.name == name
    assert spec.memory > 2**30
    assert spec.flops["fp32"] > 0 and spec.flops["bf16"] >= spec.flops["fp32"]
    assert min(spec.memory_bandwidth, spec.host_bandwidth, spec.peer_bandwidth) > 0
    assert 0 < spec.efficiency <= 1


def test_get_spec_is_case_insensitive() -> None:
    assert get_spec("V100-32GB") is PRESETS["v100-32gb"]


def test_preset_memory_is_the_marketed_size_in_gib() -> None:
    assert get_spec("v100-32gb").memory == 32 * 2**30
    assert get_spec("a100-80gb").memory == 80 * 2**30


def test_unknown_spec_raises_value_error_listing_the_names() -> None:
    with pytest.raises(ValueError) as error:
        get_spec("tpu-v9")
    message = str(error.value)
    assert "'tpu-v9'" in message
    for name in ["host", *PRESETS]:
        assert name in message


def test_compute_seconds_flop_bound() -> None:
    # 100 FLOPs at 100 * 0.5 FLOP/s = 2 s; 10 bytes at 10 B/s = 1 s: arithmetic wins
    assert TOY.compute_seconds(100, 10) == pytest.approx(2.0 + 0.25)


def test_compute_seconds_memory_bound() -> None:
    # 10 FLOPs = 0.2 s; 50 bytes = 5 s: memory traffic wins
    assert TOY.compute_seconds(10, 50) == pytest.approx(5.0 + 0.25)


def test_compute_seconds_adds_the_launch_cost_to_empty_work() -> None:
    assert TOY.compute_seconds(0, 0) == pytest.approx(0.25)
    no_launch = dataclasses.replace(TOY, launch_seconds=0.0)
    assert no_launch.compute_seconds(0, 0) == 0.0


def test_compute_seconds_uses_the_precision_peak_and_falls_back_to_fp32() -> None:
    assert TOY.compute_seconds(400, 0, "bf16") == pytest.approx(400 / 200 + 0.25)
    assert TOY.compute_seconds(400, 0, "fp8") == pytest.approx(400 / 50 + 0.25)  # no fp8 figure: fp32's


def test_compute_seconds_of_a_real_preset() -> None:
    v100 = get_spec("v100-32gb")
    flops, touched = 1e12, 1e9
    expected = max(flops / (15.7e12 * v100.efficiency), touched / 900e9) + v100.launch_seconds
    assert v100.compute_seconds(flops, touched) == pytest.approx(expected)


def test_host_spec_defaults() -> None:
    host = HostSpec()
    assert host.memory is None and host.link_bandwidth is None
    assert host.optimizer_state_bytes == 8  # Adam: two fp32 moments
    assert host.update_params_per_second > 0 and host.update_workers >= 1


def test_measure_local_returns_positive_figures() -> None:
    spec = measure_local()
    assert spec.name == "host"
    assert spec.flops["fp32"] > 0 and spec.flops["bf16"] > 0
    assert spec.memory_bandwidth > 0 and spec.host_bandwidth > 0 and spec.peer_bandwidth > 0
    assert spec.memory == 2**40  # default: not limited
    assert spec.efficiency == 1.0
    assert spec.inline  # a HostDevice runs each op as it is issued
    assert spec.compute_seconds(1e6, 1e6) > spec.launch_seconds


def test_measure_local_is_measured_once_and_takes_a_memory_size() -> None:
    assert get_spec("host") is measure_local()
    assert measure_local("1GiB").memory == 2**30


def test_compile_plans_host_devices_with_fixed_figures():
    """The same model compiles to the same plan on every run, whatever the machine's load."""
    from harmony_fx.planner.specs import host_nominal

    assert host_nominal("1MiB") == host_nominal("1MiB") and host_nominal("1MiB").memory == 2**20
    assert host_nominal().inline


def test_timing_the_runtime_leaves_the_callers_random_numbers_alone():
    from harmony_fx.planner.specs import _runtime_overheads

    state = torch.get_rng_state()
    _runtime_overheads(1e10, 1e10)  # seeds its own models, inside fork_rng
    assert torch.equal(torch.get_rng_state(), state)
