"""Device and host specifications: the numbers the cost model turns FLOPs and bytes into seconds.

Specs are data, and the planner is handed them: it never measures. ``PRESETS`` holds common GPUs
(vendor peak figures; ``efficiency`` is the fraction of peak FLOP/s a training step's kernels
reach); ``host_nominal()`` is the fixed HostDevice spec ``compile`` plans with, so plans do not
change from run to run with the machine's load; ``host_measured(figures)`` is this machine from
the figures ``harmony_fx.calibrate`` measured (matmul FLOP/s, the share of it a Linear's forward
and backward reach, memcpy bandwidth, the runtime's cost per task, per op and per copy): what
predicted step times and memory timelines of HostDevice runs use.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from harmony_fx.config import cuda_reserve, parse_size

__all__ = ["DeviceSpec", "HostSpec", "ClusterSpec", "PRESETS", "get_spec", "host_nominal", "host_measured"]

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
    op_seconds: float = 0.0           # issuing one ATen op of a task (Python, dispatch, autograd)
    # a copy's fixed cost beyond its bytes (issuing it, its event, its bookkeeping): what a small
    # model's copies take on a HostDevice, whose untracked copies move no bytes
    copy_seconds: float = 0.0
    # what issuing a backward and a recompute (a forward that builds the autograd graph) costs, in
    # its forward's ops (``op_seconds`` each): autograd runs about two nodes per forward op
    backward_ops: float = 2.0
    recompute_ops: float = 1.0

    def usable(self, budget: int | None = None) -> int:
        """What a program may hold of ``budget`` (default: the whole device): a GPU keeps the
        allocator's reserve (``config.cuda_reserve``), as ``CudaDevice.margin`` does."""
        total = budget or self.memory
        return total if self.inline else total - cuda_reserve(total)

    def compute_seconds(self, flops: float, touched_bytes: float, precision: str = "fp32", launch: bool = True) -> float:
        """A roofline: the slower of arithmetic and memory traffic, plus the launch cost (a task's,
        where ``launch``)."""
        peak = self.flops.get(precision, self.flops["fp32"]) * self.efficiency
        return max(flops / peak, touched_bytes / self.memory_bandwidth) + (self.launch_seconds if launch else 0.0)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Servers training together (``Trainer`` across processes, one per server): the network
    between them carries each pack's gradients (and, sharded, its updated weights) per iteration.

    Collectives are gloo's on host tensors: a ring all-reduce sends 2(N-1)/N of the buffer from
    every server, gloo's reduce-scatter as much (it is an all-reduce that keeps one chunk), an
    all-gather (N-1)/N; each takes ``latency`` per ring step."""

    nodes: int = 1
    network_bandwidth: float = 100e9 / 8  # bytes/s each way per server (100 Gbit/s)
    latency: float = 20e-6            # seconds per ring step
    shard_optimizer: bool = True      # optimizer state and fp32 master chunks 1/N per server

    def collective_seconds(self, nbytes: float, collective: str) -> float:
        return self.collective_bytes(nbytes, collective) / self.network_bandwidth + self.latency * self._steps(collective)

    def collective_bytes(self, nbytes: float, collective: str) -> float:
        """What one server sends for a collective over a buffer of ``nbytes``."""
        n = self.nodes
        return (1 if collective == "all_gather" else 2) * nbytes * (n - 1) / n

    def _steps(self, collective: str) -> int:
        return (1 if collective == "all_gather" else 2) * (self.nodes - 1)


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """The host all devices share: pinned memory for stashes and masters, one link, CPU updates."""

    memory: int | None = None         # bytes of host memory (None: not checked)
    link_bandwidth: float | None = None  # all devices' host traffic together, bytes/s per direction
    update_params_per_second: float = 1.0e9  # CPU optimizer throughput (Adam-like, all cores)
    # and its fixed cost per parameter tensor (Python, dispatch): what bounds a small model's update
    update_tensor_seconds: float = 0.0
    # and per call: a Trainer steps the optimizer once per pack, paying its fixed cost each time
    update_call_seconds: float = 0.0
    update_workers: int = 1
    optimizer_state_bytes: int = 8    # per parameter: Adam's two fp32 moments (SGD momentum: 4)
    cluster: ClusterSpec = ClusterSpec()  # the other servers, if any
    # an NVMe tier for what host memory cannot hold (``planner.host_memory``): its size, and its read
    # and write bandwidth (one datacenter PCIe 4 drive, sustained)
    nvme_bytes: int | None = None
    nvme_read: float = 6.0e9
    nvme_write: float = 3.0e9


# Issuing one ATen op of a task from Python on a server core: dispatch, autograd's bookkeeping and
# the kernel launch, about 8 us in eager PyTorch (not measured here: no GPU). A task whose kernels
# are shorter than that is bound by the host, which the simulator shows (``layer_seconds``).
GPU_OP_SECONDS = 8e-6


def _gpu(name, memory_gib, fp32, bf16, membw, pcie, peer) -> DeviceSpec:
    return DeviceSpec(name, memory_gib * 2**30, {"fp32": fp32 * TFLOPS, "bf16": bf16 * TFLOPS}, membw * GB,
                      pcie * GB, peer * GB, op_seconds=GPU_OP_SECONDS)


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
    """A preset by name. ``"host"``, this machine measured, is ``harmony_fx.calibrate.get_spec``'s:
    the planner is handed specs, it does not measure them."""
    if name == "host":
        raise ValueError("device spec 'host' is this machine, measured: ask harmony_fx.calibrate.get_spec('host')")
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device spec {name!r}; choose one of {', '.join(['host', *PRESETS])}") from None


def host_nominal(memory: int | str | None = None) -> DeviceSpec:
    """A HostDevice as ``compile`` plans for it: fixed round figures of a 2-core machine like this
    one (matmul 8e10 FLOP/s, copies 1e10 B/s), so the same model compiles to the same plan on
    every run; ``host_measured`` is for ``harmony-fx plan --device-spec host``."""
    return DeviceSpec("host", parse_size(memory) or 2**40, {"fp32": 8e10, "bf16": 2e10}, 1e10, 1e10, 1e10,
                      efficiency=1.0, launch_seconds=300e-6, inline=True)


def host_measured(figures: Mapping[str, float], memory: int | str | None = None, *, tracked: bool = False,
                  recorded: bool = False) -> DeviceSpec:
    """This machine as a HostDevice, from measured ``figures`` (``harmony_fx.calibrate``'s): FLOP/s
    of ``"fp32"`` and ``"bf16"`` matmuls, and of a Linear's forward and backward (``"linear"``,
    optional: its share of ``"fp32"`` is the spec's ``efficiency``), ``"copy"`` bandwidth in bytes/s
    (memory, host and peer links alike: one memory), and the runtime's own seconds per compute task
    (``"task"``), per op (``"op"``) and per copy (``"copy_action"``, optional) beyond its FLOPs and
    bytes, and what a backward and a recompute cost in their forward's ops (``"backward_ops"``,
    ``"recompute_ops"``, optional); a run that counts every tensor (``tracked``) pays ``"track_op"``
    more per op (a dispatch), one that records its timeline (``recorded``) ``"record_task"`` more per
    task (a span)."""
    task = figures["task"] + (figures["record_task"] if recorded else 0.0)
    op = figures["op"] + (figures["track_op"] if tracked else 0.0)
    efficiency = min(figures.get("linear", figures["fp32"]) / figures["fp32"], 1.0)
    return DeviceSpec("host", parse_size(memory) or 2**40, {"fp32": figures["fp32"], "bf16": figures["bf16"]},
                      figures["copy"], figures["copy"], figures["copy"], efficiency=efficiency,
                      launch_seconds=task, inline=True, op_seconds=op, copy_seconds=figures.get("copy_action", 0.0),
                      backward_ops=figures.get("backward_ops", 2.0), recompute_ops=figures.get("recompute_ops", 1.0))
