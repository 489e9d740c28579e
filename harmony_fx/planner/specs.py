"""Device and host specifications: the numbers the cost model turns FLOPs and bytes into seconds.

Specs are data. ``PRESETS`` holds common GPUs (vendor peak figures; ``efficiency`` is the fraction
of peak FLOP/s a training step's kernels reach); ``measure_local()`` measures this machine (a
matmul for FLOP/s, a large copy for bandwidth); ``host_nominal()`` is the fixed HostDevice spec
``compile`` plans with, so plans do not change from run to run with the machine's load.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import torch

from harmony_fx.config import cuda_reserve, parse_size

__all__ = ["DeviceSpec", "HostSpec", "PRESETS", "get_spec", "host_nominal", "measure_local"]

GB = 10**9
TFLOPS = 10**12


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory: int                       # bytes a program may use
    flops: dict[str, float]           # peak FLOP/s per compute dtype ("fp32", "bf16")
    memory_bandwidth: float           # device memory, bytes/s (bounds elementwise ops)
    host_bandwidth: float             # one device's host link (PCIe), bytes/s per direction
    peer_bandwidth: float             # device to device, bytes/s
    efficiency: float = 0.5           # achieved / peak FLOP/s for a training step
    launch_seconds: float = 20e-6     # fixed cost of one task (kernel launches, bookkeeping)
    # the streams run each op inline as it is issued (a HostDevice): nothing overlaps
    inline: bool = False

    def usable(self, budget: int | None = None) -> int:
        """What a program may hold of ``budget`` (default: the whole device): a GPU keeps the
        allocator's reserve (``config.cuda_reserve``), as ``CudaDevice.margin`` does."""
        total = budget or self.memory
        return total if self.inline else total - cuda_reserve(total)

    def compute_seconds(self, flops: float, touched_bytes: float, precision: str = "fp32") -> float:
        """A roofline: the slower of arithmetic and memory traffic, plus the launch cost."""
        peak = self.flops.get(precision, self.flops["fp32"]) * self.efficiency
        return max(flops / peak, touched_bytes / self.memory_bandwidth) + self.launch_seconds


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """The host all devices share: pinned memory for stashes and masters, one link, CPU updates."""

    memory: int | None = None         # bytes of host memory (None: not checked)
    link_bandwidth: float | None = None  # all devices' host traffic together, bytes/s per direction
    update_params_per_second: float = 1.0e9  # CPU optimizer throughput (Adam-like, all cores)
    update_workers: int = 1
    optimizer_state_bytes: int = 8    # per parameter: Adam's two fp32 moments (SGD momentum: 4)


def _gpu(name, memory_gib, fp32, bf16, membw, pcie, peer) -> DeviceSpec:
    return DeviceSpec(name, memory_gib * 2**30, {"fp32": fp32 * TFLOPS, "bf16": bf16 * TFLOPS}, membw * GB,
                      pcie * GB, peer * GB)


# fp32 uses TF32 tensor cores where the GPU has them (PyTorch's default for matmuls on Ampere+ is
# fp32, so we take the plain-fp32 figure to stay conservative). PCIe figures are achieved rates.
PRESETS: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    _gpu("1080ti-11gb", 11, 11.3, 11.3, 484, 12, 10),
    _gpu("v100-32gb", 32, 15.7, 125, 900, 12, 150),
    _gpu("a100-40gb", 40, 19.5, 312, 1555, 25, 300),
    _gpu("a100-80gb", 80, 19.5, 312, 2039, 25, 300),
    _gpu("h100-80gb", 80, 67, 989, 3350, 50, 450),
    _gpu("h200", 141, 67, 989, 4800, 50, 450),
)}


def get_spec(name: str) -> DeviceSpec:
    """A preset by name, or ``"host"`` for this machine (measured once)."""
    if name == "host":
        return measure_local()
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device spec {name!r}; choose one of {', '.join(['host', *PRESETS])}") from None


def host_nominal(memory: int | str | None = None) -> DeviceSpec:
    """A HostDevice as ``compile`` plans for it: fixed round figures of a 2-core machine like this
    one (matmul 8e10 FLOP/s, copies 1e10 B/s), so the same model compiles to the same plan on
    every run; ``measure_local`` is for ``harmony-fx plan --device-spec host``."""
    return DeviceSpec("host", parse_size(memory) or 2**40, {"fp32": 8e10, "bf16": 2e10}, 1e10, 1e10, 1e10,
                      efficiency=1.0, launch_seconds=300e-6, inline=True)


@functools.lru_cache(maxsize=None)
def measure_local(memory: int | str | None = None) -> DeviceSpec:
    """This machine as a device: matmul FLOP/s and copy bandwidth, measured (about 0.3 s)."""
    a = torch.randn(512, 512)
    torch.mm(a, a)
    start, reps = time.perf_counter(), 8
    for _ in range(reps):
        torch.mm(a, a)
    flops = 2 * 512**3 * reps / (time.perf_counter() - start)
    src = torch.empty(16 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    copy_bandwidth = 4 * src.numel() / (time.perf_counter() - start)
    # A HostDevice's "transfers" are memcpys within host memory: every link runs at copy speed; its
    # streams run inline, and each op costs about 0.3 ms of Python (runtime and autograd) besides.
    return DeviceSpec("host", parse_size(memory) or 2**40, {"fp32": flops, "bf16": flops / 4}, copy_bandwidth,
                      copy_bandwidth, copy_bandwidth, efficiency=1.0, launch_seconds=300e-6, inline=True)
