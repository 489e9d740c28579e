"""This machine measured for the cost model: the figures ``planner.specs.host_measured`` turns into
a HostDevice spec.

The planner is handed numbers; it never runs the compiler. Measuring them does: besides matmul
FLOP/s (fp32, bf16) and memcpy bandwidth, the runtime's own cost per compute task and per op
(Python, autograd, the copies' and waits' bookkeeping) is timed on two compiled MLPs, so this
module sits above the compiler and the runtime and below the front door (``api``, whose
``plot_memory`` predicts with it).

Two functions do the work, so either can change alone: ``measure_host()`` measures (about 2 s);
``host_figures()`` loads the figures from the cache file, and on a miss measures and stores them
(``~/.cache/harmony_fx/host_spec.json``, or under ``HARMONY_FX_CACHE``; one entry per torch
version, core count and thread count; a read-only home measures again next time).
``measure_local()`` is the spec, ``get_spec(name)`` a preset or ``"host"``, ``spec_for(device)``
the spec a compiled module's device is predicted with.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import time

import torch

from harmony_fx.compiler.driver import compile_program
from harmony_fx.compiler.stages import StageLog
from harmony_fx.config import CompileOptions
from harmony_fx.frontend.calls import Calls
from harmony_fx.models import MLPChain
from harmony_fx.planner.choose import device_spec
from harmony_fx.planner.specs import DeviceSpec, get_spec as preset, host_measured
from harmony_fx.runtime.autograd import HarmonyFunction
from harmony_fx.runtime.session import Session

__all__ = ["measure_host", "host_figures", "measure_local", "get_spec", "spec_for", "cache_path"]

# v2: the runtime without per-tensor tracking (its default since compiled packs)
CACHE_VERSION = "v2"


def cache_path() -> pathlib.Path:
    """The cache file: ``host_spec.json`` under ``HARMONY_FX_CACHE`` (default ``~/.cache/harmony_fx``)."""
    folder = pathlib.Path(os.environ.get("HARMONY_FX_CACHE", pathlib.Path.home() / ".cache" / "harmony_fx"))
    return folder / "host_spec.json"


def host_figures() -> dict[str, float]:
    """This machine's figures (``measure_host``'s keys), from the cache file; measured and stored
    there when it has none for this torch version, core count and thread count."""
    key = f"{CACHE_VERSION}-torch{torch.__version__}-cpus{os.cpu_count()}-threads{torch.get_num_threads()}"
    path = cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = measure_host()
        with contextlib.suppress(OSError):  # a read-only home: measured again next time
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cached, indent=2))
    return cached[key]


def measure_host() -> dict[str, float]:
    """``{"fp32", "bf16"}``: matmul FLOP/s; ``"copy"``: memcpy bytes/s; ``"task"`` and ``"op"``:
    the runtime's seconds per compute task and per op beyond its FLOPs and bytes."""
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


@functools.lru_cache(maxsize=None)
def measure_local(memory: int | str | None = None) -> DeviceSpec:
    """This machine as a HostDevice (``planner.specs.host_measured`` of ``host_figures()``), with
    ``memory`` bytes (default: unbounded); one spec per size for the process."""
    return host_measured(host_figures(), memory)


def get_spec(name: str) -> DeviceSpec:
    """A GPU preset by name (``planner.specs.PRESETS``), or ``"host"``: this machine, measured."""
    return measure_local() if name == "host" else preset(name)


def spec_for(device, budget: int | None = None) -> DeviceSpec:
    """The spec a compiled module's ``device`` (a ``runtime.devices.Device``) is predicted with:
    its GPU's preset (``planner.choose.device_spec``), or this machine measured for a HostDevice."""
    return device_spec(device, budget) if device.torch_device.type == "cuda" else measure_local()


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
    # seeded, without moving the caller's random numbers; compiled and run with grad on, whatever
    # the caller's mode (as a HarmonyModule captures)
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(0)
        return _time_two_mlps(flops, copy_bandwidth)


def _time_two_mlps(flops: float, copy_bandwidth: float) -> tuple[float, float]:
    x = torch.randn(8, 32)
    rows, times = [], []
    for boundaries in ((0, 1, 2, 3, 4, 5, 6, 7), (0, 4)):
        model = MLPChain(width=32, depth=8)
        options = CompileOptions(devices=["host:0"], memory_budget=None, microbatches=2, pack_boundaries=boundaries,
                                 track_memory=False)
        compiled = compile_program(model, (x,), {}, options)
        session, calls = Session(compiled, StageLog()), Calls(compiled, model)
        tasks = [a for f, b in compiled.device_actions for a in f + b if a.kind.name in ("FWD", "RECOMPUTE", "BWD")]
        ops_of = {pack.index: sum(n.op == "call_function" for n in pack.gm.graph.nodes) for pack in compiled.packs}
        # a backward runs about twice its forward's ops
        ops = sum(ops_of[a.pack] * (2 if a.kind.name == "BWD" else 1) for a in tasks)
        best = float("inf")
        try:
            for _ in range(5):
                start = time.perf_counter()
                _call(session, calls, x).sum().backward()
                best = min(best, time.perf_counter() - start)
        finally:
            session.close()
        moved = session.stats.bytes_h2d + session.stats.bytes_d2h
        work = 6 * sum(p.numel() for p in model.parameters()) * x.shape[0] / flops + moved / copy_bandwidth
        rows.append((len(tasks), ops))
        times.append(max(best - work, 0.0))
    (t1, o1), (t2, o2) = rows
    determinant = t1 * o2 - t2 * o1
    per_task = (times[0] * o2 - times[1] * o1) / determinant
    per_op = (t1 * times[1] - t2 * times[0]) / determinant
    if per_task < 0 or per_op < 0:  # noise: put it all on the tasks
        return times[0] / t1, 0.0
    return per_task, per_op


def _call(session: Session, calls: Calls, x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` as a ``HarmonyModule`` runs it (its forward programs, and the backward programs
    when autograd's backward reaches it), without the front door's call guards."""
    compiled = session.compiled
    outputs = HarmonyFunction.apply(session, calls, calls.split((x,), {}), *compiled.captured.flatten_inputs((x,), {}),
                                    *compiled.trainable_params())
    return calls.structure(list(outputs))
