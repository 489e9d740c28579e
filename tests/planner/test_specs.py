"""``planner.specs``: device presets, the roofline, and this machine as a device from measured figures."""
from __future__ import annotations

import dataclasses

import pytest

from harmony_fx.planner.specs import PRESETS, DeviceSpec, HostSpec, get_spec, host_measured

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


def test_host_measured_is_a_host_device_of_the_figures_it_is_handed() -> None:
    figures = {"fp32": 2e10, "bf16": 1e10, "copy": 5e9, "task": 1e-4, "op": 2e-6}
    spec = host_measured(figures)
    assert spec.name == "host" and spec.inline and spec.efficiency == 1.0
    assert spec.flops == {"fp32": 2e10, "bf16": 1e10}
    assert spec.memory_bandwidth == spec.host_bandwidth == spec.peer_bandwidth == 5e9
    assert (spec.launch_seconds, spec.op_seconds) == (1e-4, 2e-6)
    assert spec.memory == 2**40  # default: not limited
    assert host_measured(figures, "1GiB").memory == 2**30
    assert spec.copy_seconds == 0.0  # figures without a copy's fixed cost or a Linear's FLOP/s
    measured = host_measured({**figures, "linear": 1.5e10, "copy_action": 3e-5})
    assert measured.efficiency == 0.75 and measured.copy_seconds == 3e-5
    assert measured.compute_seconds(3e10, 0.0) == pytest.approx(2.0 + 1e-4)  # at 0.75 of 2e10 FLOP/s, one task


def test_the_planner_does_not_measure_the_host() -> None:
    with pytest.raises(ValueError, match=r"harmony_fx\.calibrate\.get_spec\('host'\)"):
        get_spec("host")


def test_compile_plans_host_devices_with_fixed_figures():
    """The same model compiles to the same plan on every run, whatever the machine's load."""
    from harmony_fx.planner.specs import host_nominal

    assert host_nominal("1MiB") == host_nominal("1MiB") and host_nominal("1MiB").memory == 2**20
    assert host_nominal().inline
