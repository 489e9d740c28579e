"""Compile time of ``compile_packs=True`` against ``torch.compile(model)`` for the 12-layer GPT, and
the runtime's own cost per task, each measured once here (no pytest-benchmark rounds: a compile
is measured cold, once, in a fresh inductor cache).

    OMP_NUM_THREADS=1 python -m pytest benchmarks/test_compile_time.py -s
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

import harmony_fx
from harmony_fx.program.actions import Stream
from harmony_fx.runtime.executor import Runtime

from benchmarks.test_step_time import _setup, _step


def _cold_inductor_cache():
    """A fresh inductor cache: both compilers start from nothing."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    torch._dynamo.reset()


def test_compile_time_of_the_12_layer_gpt():
    model, idx, target = _setup(12)
    _cold_inductor_cache()
    started = time.perf_counter()
    _step(torch.compile(model), idx, target, model)
    whole = time.perf_counter() - started

    _cold_inductor_cache()
    started = time.perf_counter()
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], microbatches=1, compile_packs=True,
                            track_memory=False, pack_boundaries=(0, 5, 9, 13, 17))  # 3 packs of 4 blocks
    planned = time.perf_counter() - started
    _step(hm, idx, target, model)
    packs = time.perf_counter() - started
    compiler = hm.session.pack_compiler
    print(f"\ntorch.compile(model): {whole:.1f} s; harmony_fx: {packs:.1f} s ({planned:.1f} s planning, "
          f"{compiler.compile_seconds:.1f} s inductor) = x{packs / whole:.2f}; {len(hm.packs)} packs, "
          f"{compiler.structures} distinct structures, {compiler.graphs} graphs compiled")


def test_runtime_cost_per_task():
    """The loop's own time: the time the programs take to run (``Runtime.run``) less the time inside
    the streams' work (the copies and the packs' compute), over the work items they issued."""
    model, idx, target = _setup(8)
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], microbatches=4, track_memory=False,
                            memory_budget=int(0.25 * 54_094_600))
    streams = hm.devices[0].streams
    submit, run = streams.submit, Runtime.run
    seconds = {"work": 0.0, "programs": 0.0, "items": 0}

    def timed_submit(stream: Stream, work):
        started = time.perf_counter()
        try:
            return submit(stream, work)
        finally:
            seconds["work"] += time.perf_counter() - started
            seconds["items"] += 1

    def timed_run(runtime, program):
        started = time.perf_counter()
        try:
            return run(runtime, program)
        finally:
            seconds["programs"] += time.perf_counter() - started

    for _ in range(3):  # warm up
        _step(hm, idx, target, model)
    streams.submit, Runtime.run = timed_submit, timed_run
    best = float("inf")
    try:
        for _ in range(5):
            seconds.update(work=0.0, programs=0.0, items=0)
            _step(hm, idx, target, model)
            best = min(best, (seconds["programs"] - seconds["work"]) / seconds["items"])
    finally:
        Runtime.run = run
    tasks = sum(action.kind.name in ("FWD", "RECOMPUTE", "BWD") for f, b in hm.device_actions for action in f + b)
    print(f"\nruntime's own cost: {best * 1e6:.1f} us per work item ({seconds['items']} items a step: copies, "
          f"frees, tasks), {best * seconds['items'] / tasks * 1e6:.1f} us per compute task ({tasks}); "
          f"{len(hm.packs)} packs, 4 microbatches")
