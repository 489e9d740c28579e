"""Devices: HostDevice's memory account and the parsing of ``devices=``."""
from __future__ import annotations

import gc

import pytest
import torch

from harmony_fx.config import cuda_reserve
from harmony_fx.runtime.devices import (
    CudaDevice, DeviceOutOfMemoryError, HostDevice, StagingBuffers, pinned_source, resolve_devices,
)

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


@pytest.mark.parametrize("spec,expected", [(None, ["host:0"]), (1, ["host:0"]), (2, ["host:0", "host:1"])])
def test_resolve_defaults_without_cuda(spec, expected):
    # unmarked tests see no GPU even on a GPU machine (tests/conftest.py)
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


# ---------------------------------------------------------------------- copies and their host side


def test_a_tensor_already_on_a_device_is_copied_as_it_is(monkeypatch):
    """A GPU input or a peer's value reaching ``to_device``: never pinned (CUDA refuses to pin a
    device tensor); a pinned host tensor is not pinned again; a pageable one is, once."""
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self)
    on_device = torch.empty(4, 4, device="meta")
    assert pinned_source(on_device) is on_device and not pinned
    pageable = torch.randn(4)
    assert pinned_source(pageable) is pageable and pinned == [pageable]
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    assert pinned_source(pageable) is pageable and len(pinned) == 1


def test_staging_buffers_are_allocated_once_and_refreshed():
    staging = StagingBuffers(pin=False)
    master = torch.randn(8, 8)
    first = staging.stage(("p0", 0), master, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and torch.equal(first, master.to(torch.bfloat16))
    master.add_(1.0)  # the optimizer stepped
    again = staging.stage(("p0", 0), master, torch.bfloat16)
    assert again is first and torch.equal(again, master.to(torch.bfloat16))
    staging.stage(("p0", 1), torch.randn(3), torch.bfloat16)
    assert staging.allocations == 2 and staging.nbytes == (64 + 3) * 2


def test_bf16_weight_copies_reuse_one_buffer_per_weight_across_iterations():
    """Each weight is cast into its own reused buffer: the host allocates (on a GPU: pins) once per
    weight, not once per copy (twice per pack per iteration) as ``master.to(bf16)`` did."""
    import harmony_fx
    from harmony_fx.models import MLPChain

    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    hm = harmony_fx.compile(model, torch.randn(8, 16), microbatches=2, precision="bf16", pack_boundaries=(0, 2, 4))
    for _ in range(3):
        hm(torch.randn(8, 16)).float().sum().backward()
    weights = [p for p in model.parameters()]
    staging = hm.devices[0].staging
    assert staging.allocations == len(weights)  # three iterations, two copies of each pack but the last
    assert staging.nbytes == sum(p.numel() * 2 for p in weights)
    prefetches = sum(1 for a in hm.forward_actions + hm.backward_actions if a.kind.name == "PREFETCH"
                     and a.key.kind.name == "WEIGHTS")
    assert prefetches > len(hm.packs)  # the same weights are copied more than once per iteration


def test_bf16_weight_gradients_are_summed_and_copied_in_fp32():
    """Summed over microbatches in the masters' dtype: what leaves the device is 4 bytes a
    parameter, as the plan counts, and equals the fp32 sum of each microbatch's bf16 gradient."""
    import harmony_fx
    from harmony_fx.models import MLPChain

    torch.manual_seed(0)
    model = MLPChain(width=16, depth=2)
    x = torch.randn(8, 16)
    hm = harmony_fx.compile(model, x, microbatches=4, precision="bf16", pack_boundaries=(0, 1, 2))
    hm(x).float().sum().backward()
    params = sum(p.numel() for p in model.parameters())
    assert hm.stats.as_dict()["bytes_by_kind"]["d2h/wgrad"] == 4 * params == hm.plan.predicted_bytes["d2h/wgrad"]
    # the reference: each microbatch's bf16 gradient, summed in fp32
    reference = MLPChain(width=16, depth=2)
    reference.load_state_dict(model.state_dict())
    reference = reference.to(torch.bfloat16)
    total = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in reference.named_parameters()}
    for chunk in x.split(2):
        reference.zero_grad()
        reference(chunk.to(torch.bfloat16)).float().sum().backward()
        for name, p in reference.named_parameters():
            total[name] += p.grad.float()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, total[name], rtol=1e-2, atol=1e-2, msg=name)
        assert p.grad.dtype == torch.float32


def test_a_gpu_plan_keeps_the_allocators_reserve():
    gib = 1 << 30
    assert cuda_reserve(8 * gib) == 256 * MIB + int(0.05 * 8 * gib)
    assert cuda_reserve(100_000) == 10_000  # a small budget keeps a tenth
    from harmony_fx.planner.specs import get_spec

    spec = get_spec("h100-80gb")
    assert spec.usable() == spec.memory - cuda_reserve(spec.memory)
    assert spec.usable(8 * gib) == 8 * gib - cuda_reserve(8 * gib)


@pytest.mark.cuda
def test_cuda_device_copies_gpu_tensors_without_pinning_them():
    device = CudaDevice("cuda:0", budget=64 * MIB)
    on_gpu = torch.randn(64, 64, device="cuda:0")
    copy = device.to_device(on_gpu)
    device.streams.synchronize()
    assert copy is not on_gpu and torch.equal(copy, on_gpu)


@pytest.mark.cuda
def test_cuda_device_refuses_to_pass_its_budget():
    device = CudaDevice("cuda:0", budget=MIB)
    kept = [device.to_device(torch.randn(512, 512))]  # 1 MiB: at the budget
    device.streams.synchronize()
    device.check_budget()
    with device.compute_scope():
        kept.append(kept[0] * 2)
    with pytest.raises(DeviceOutOfMemoryError, match="budget"):
        device.check_budget()
    peaks = device.memory_peaks()
    assert set(peaks) == {"allocated", "requested", "reserved"} and peaks["allocated"] >= 2 * MIB


class _FakeAllocator:
    """What ``torch.cuda`` reports of one GPU's caching allocator, counted here by hand."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch) -> None:
        from harmony_fx.runtime import devices

        cuda = devices.torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: 1)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(devices.torch._C, "_cuda_memoryStats",
                            lambda index: {"allocated_bytes": {"all": {"current": self.allocated}}}, raising=False)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "memory_stats", lambda device=None: {
            "allocated_bytes.all.peak": self.peak, "requested_bytes.all.current": self.allocated,
            "requested_bytes.all.peak": self.peak, "reserved_bytes.all.peak": self.peak})
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(devices.GpuAccount, "warm_up", lambda account, stream: None)  # no kernels here
        monkeypatch.setattr(devices, "CudaStreams", lambda device: None)
        monkeypatch.setattr(devices, "StagingBuffers", lambda pin: None)


def test_two_devices_on_one_gpu_share_one_account(monkeypatch):
    """The allocator counts per GPU: two devices on it are one account, whose budget is theirs
    together (each charged the other's tensors, and each resetting the other's peak, before)."""
    from harmony_fx.runtime.devices import CudaDevice, DeviceOutOfMemoryError

    gpu = _FakeAllocator()
    gpu.install(monkeypatch)
    gpu.allocate(1000)  # the context, another library's tensors: the baseline
    first, second = resolve_devices(["cuda:0", "cuda:0"], 4096, track_memory=False)
    assert isinstance(first, CudaDevice) and first.account is second.account and first.account.budget == 8192
    first.reset_peak()
    second.reset_peak()  # at the start of an iteration every device resets: the same baseline, once
    gpu.allocate(3000)  # the first device's tensors
    gpu.allocate(3000)  # the second's: over either budget, within both together
    first.check_budget()
    second.check_budget()
    assert first.live_bytes() == second.live_bytes() == 6000 and first.peak_bytes() == 6000
    gpu.allocate(3000)
    with pytest.raises(DeviceOutOfMemoryError):
        second.check_budget()
    other = resolve_devices(["cuda:0"], 4096, track_memory=False)[0]
    assert other.account is not first.account  # another compile: an account of its own


def test_the_default_cuda_budget_stays_under_the_memory_fraction(monkeypatch):
    from harmony_fx.runtime import devices

    cuda = devices.torch.cuda
    gib = 1 << 30
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (100 * gib, 140 * gib))
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device: 0.25, raising=False)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device: 2 * gib)
    assert devices.default_cuda_budget(torch.device("cuda:0")) == 35 * gib - 2 * gib
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    assert devices.default_cuda_budget(torch.device("cuda:0")) == 100 * gib  # what is free binds


# ---------------------------------------------------------------------- where weight gradients land


def test_weight_gradients_land_in_the_buffers_given_where_they_fit():
    """A tracked HostDevice copies each gradient into its buffer when shape and dtype match, into a
    new tensor otherwise; an untracked one hands the gradients over (no copy at all)."""
    grads = [torch.randn(4, 4), torch.randn(3), torch.randn(2)]
    fits, wrong_shape = torch.zeros(4, 4), torch.zeros(4)
    into = [fits, wrong_shape, None]
    copies = HostDevice(track_memory=True).grads_to_host(grads, into)
    assert copies[0] is fits and torch.equal(fits, grads[0])
    assert copies[1] is not wrong_shape and copies[2] is not grads[2]
    assert all(torch.equal(c, g) for c, g in zip(copies, grads))
    wrong_dtype = torch.zeros(4, 4, dtype=torch.float64)
    assert HostDevice(track_memory=True).to_host(grads[0], into=wrong_dtype).dtype == torch.float32
    handed = HostDevice(track_memory=False).grads_to_host(grads, [torch.zeros(4, 4), None, None])
    assert all(h is g for h, g in zip(handed, grads))


@pytest.mark.cuda
def test_cuda_weight_gradients_land_in_a_pinned_buffer_given_and_never_in_pageable_memory():
    device = CudaDevice("cuda:0", budget=64 * MIB)
    grads = [torch.randn(64, 64, device="cuda:0"), torch.randn(64, device="cuda:0")]
    pinned, pageable = torch.empty(64, 64, pin_memory=True), torch.empty(64)
    copies = device.grads_to_host(grads, [pinned, pageable])
    device.streams.synchronize()
    assert copies[0] is pinned and copies[1] is not pageable and copies[1].is_pinned()
    assert all(torch.equal(c, g.cpu()) for c, g in zip(copies, grads))
