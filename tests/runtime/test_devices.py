"""Devices: HostDevice's memory account and the parsing of ``devices=``."""
from __future__ import annotations

import gc

import pytest
import torch

from harmony_fx.runtime.devices import CudaDevice, DeviceOutOfMemoryError, HostDevice, resolve_devices

MIB = 1 << 20


def test_host_device_counts_what_is_on_it():
    device = HostDevice("host:0", budget=4 * MIB)
    host = torch.randn(512, 512)
    copy = device.to_device(host)
    assert copy is not host and torch.equal(copy, host)
    assert device.live_bytes() == MIB
    with device.compute_scope():
        doubled = copy * 2
    assert device.live_bytes() == 2 * MIB
    back = device.to_host(doubled)
    assert device.live_bytes() == 2 * MIB  # host copies are not on the device
    assert torch.equal(back, host * 2)
    del copy, doubled
    assert device.live_bytes() == 0
    assert device.peak_bytes() == 2 * MIB
    device.reset_peak()
    assert device.peak_bytes() == 0


def test_host_device_refuses_to_go_past_its_budget():
    device = HostDevice("host:3", budget=MIB + MIB // 2)
    kept = device.to_device(torch.randn(512, 512))
    with pytest.raises(DeviceOutOfMemoryError) as info:
        device.to_device(torch.randn(512, 512))
    message = str(info.value)
    assert "host:3" in message
    assert "1.50 MiB" in message  # the budget
    assert "budget" in message
    with pytest.raises(DeviceOutOfMemoryError, match="1.50 MiB"):
        with device.compute_scope():
            kept + 1  # a temporary of a task counts too
    assert isinstance(DeviceOutOfMemoryError("x"), RuntimeError)


def test_refused_allocation_does_not_stay_on_the_device():
    device = HostDevice("host:0", budget=MIB)
    with pytest.raises(DeviceOutOfMemoryError):
        device.to_device(torch.randn(1024, 512))
    gc.collect()
    assert device.live_bytes() == 0


def test_unlimited_host_device():
    device = HostDevice()
    assert device.name == "host:0" and device.budget is None
    big = device.to_device(torch.empty(2048, 512))
    assert device.live_bytes() == 4 * MIB
    del big


def test_untracked_host_device_counts_nothing():
    device = HostDevice("host:0", budget=1, track_memory=False)
    copy = device.to_device(torch.randn(64, 64))
    with device.compute_scope():
        copy = copy * 3
    assert device.live_bytes() == 0


def test_host_device_rng_state_round_trip():
    device = HostDevice()
    state = device.get_rng_state()
    first = torch.rand(4)
    device.set_rng_state(state)
    assert torch.equal(torch.rand(4), first)


@pytest.mark.parametrize("spec", ["host:0", ["host:0"], ("host:0",), "host"])
def test_resolve_host_names(spec):
    (device,) = resolve_devices(spec, 1000)
    assert isinstance(device, HostDevice)
    assert device.name == "host:0" and device.budget == 1000


def test_resolve_several_host_devices():
    devices = resolve_devices(["host:0", "host:1"], None)
    assert [d.name for d in devices] == ["host:0", "host:1"]
    assert all(isinstance(d, HostDevice) for d in devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only")
@pytest.mark.parametrize("spec,expected", [(None, ["host:0"]), (1, ["host:0"]), (2, ["host:0", "host:1"])])
def test_resolve_defaults_without_cuda(spec, expected):
    devices = resolve_devices(spec, None)
    assert [d.name for d in devices] == expected
    assert all(isinstance(d, HostDevice) for d in devices)


@pytest.mark.parametrize("spec", ["gpu:0", ["tpu:0"], "host:x", "cuda:a", ["host:0", "mps:0"], [], 0, -1, 1.5, {}])
def test_unknown_devices_are_refused(spec):
    with pytest.raises(ValueError):
        resolve_devices(spec, None)


def test_unknown_device_name_is_named_in_the_error():
    with pytest.raises(ValueError, match="gpu:0"):
        resolve_devices(["gpu:0"], None)


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_missing_cuda_device_is_refused():
    with pytest.raises(ValueError, match="cuda:7"):
        resolve_devices(["cuda:7"], None)


@pytest.mark.cuda
def test_resolve_defaults_with_cuda():
    devices = resolve_devices(None, None)
    assert [d.name for d in devices] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert all(isinstance(d, CudaDevice) for d in devices)


@pytest.mark.cuda
def test_cuda_device_round_trip():
    device = CudaDevice("cuda:0", budget=64 * MIB)
    host = torch.randn(256, 256)
    copy = device.to_device(host)
    device.streams.synchronize()
    assert copy.device.type == "cuda"
    back = device.to_host(copy)
    device.streams.synchronize()
    assert torch.equal(back, host)
    assert device.live_bytes() >= 256 * 256 * 4
