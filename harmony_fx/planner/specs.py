"""Device and host specifications: the numbers the cost model turns FLOPs and bytes into seconds.

Specs are data. ``PRESETS`` holds common GPUs (vendor peak figures; ``efficiency`` is the fraction
of peak FLOP/s a training step's kernels reach); ``measure_local()`` is this machine, calibrated
once and cached (matmul FLOP/s, memcpy bandwidth, the runtime's cost per task): what predicted
step times and memory timelines of HostDevice runs use; ``host_nominal()`` is the fixed HostDevice
spec ``compile`` plans with, so plans do not change from run to run with the machine's load.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
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
    op_seconds: float = 0.0           # issuing one ATen op of a task (Python, dispatch, autograd)

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
    """This machine as a HostDevice, calibrated: FLOP/s of fp32 and bf16 matmuls at the sizes small
    models use, memcpy bandwidth, and what the runtime costs per compute task beyond its FLOPs and
    bytes (Python, autograd, the copies' and waits' own overhead), timed on a calibration model.
    Measured once per machine (about 2 s) and kept in ``~/.cache/harmony_fx`` (``HARMONY_FX_CACHE``)."""
    figures = _calibration()
    return DeviceSpec("host", parse_size(memory) or 2**40, {"fp32": figures["fp32"], "bf16": figures["bf16"]},
                      figures["copy"], figures["copy"], figures["copy"], efficiency=1.0,
                      launch_seconds=figures["task"], inline=True, op_seconds=figures["op"])


def _calibration() -> dict[str, float]:
    # v2: the runtime without per-tensor tracking (its default since compiled packs)
    key = f"v2-torch{torch.__version__}-cpus{os.cpu_count()}-threads{torch.get_num_threads()}"
    path = pathlib.Path(os.environ.get("HARMONY_FX_CACHE", pathlib.Path.home() / ".cache" / "harmony_fx"))
    path = path / "host_spec.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = _measure_host()
        with contextlib.suppress(OSError):  # a read-only home: measured again next time
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cached, indent=2))
    return cached[key]


def _measure_host() -> dict[str, float]:
    figures = {dtype: _matmul_flops(getattr(torch, name)) for dtype, name in (("fp32", "float32"), ("bf16", "bfloat16"))}
    src = torch.empty(16 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    figures["copy"] = 4 * src.numel() / (time.perf_counter() - start)
    figures["task"], figures["op"] = _runtime_overheads(figures["fp32"], figures["copy"])
    return figures


def _matmul_flops(dtype: torch.dtype, size: int = 256, reps: int = 4, trials: int = 5) -> float:
    """The best of a few trials: the machine's speed, not its load at one instant."""
    a = torch.randn(size, size).to(dtype)
    torch.mm(a, a)
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, a)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * reps / best


def _runtime_overheads(flops: float, copy_bandwidth: float) -> tuple[float, float]:
    """(seconds per compute task, seconds per op): the runtime's own cost on this machine, from two
    compiled MLPs whose arithmetic is negligible, one task per layer and four layers per task: what
    is left of their step times once FLOPs and bytes are paid, split between tasks and ops."""
    with torch.random.fork_rng(devices=[]):  # seeded, without moving the caller's random numbers
        torch.manual_seed(0)
        return _time_two_mlps(flops, copy_bandwidth)


def _time_two_mlps(flops: float, copy_bandwidth: float) -> tuple[float, float]:
    from harmony_fx.api import compile  # the runtime itself, timed
    from harmony_fx.testing.models import MLPChain

    x = torch.randn(8, 32)
    rows, times = [], []
    for boundaries in ((0, 1, 2, 3, 4, 5, 6, 7), (0, 4)):
        hm = compile(MLPChain(width=32, depth=8), x, microbatches=2, pack_boundaries=boundaries,
                     devices=["host:0"], memory_budget=None, track_memory=False)
        tasks = [a for f, b in hm.device_actions for a in f + b if a.kind.name in ("FWD", "RECOMPUTE", "BWD")]
        ops_of = {pack.index: sum(n.op == "call_function" for n in pack.gm.graph.nodes) for pack in hm.packs}
        # a backward runs about twice its forward's ops
        ops = sum(ops_of[a.pack] * (2 if a.kind.name == "BWD" else 1) for a in tasks)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            hm(x).sum().backward()
            best = min(best, time.perf_counter() - start)
        moved = hm.stats.bytes_h2d + hm.stats.bytes_d2h
        work = 6 * sum(p.numel() for p in hm.model.parameters()) * x.shape[0] / flops + moved / copy_bandwidth
        rows.append((len(tasks), ops))
        times.append(max(best - work, 0.0))
    (t1, o1), (t2, o2) = rows
    determinant = t1 * o2 - t2 * o1
    per_task = (times[0] * o2 - times[1] * o1) / determinant
    per_op = (t1 * times[1] - t2 * times[0]) / determinant
    if per_task < 0 or per_op < 0:  # noise: put it all on the tasks
        return times[0] / t1, 0.0
    return per_task, per_op
