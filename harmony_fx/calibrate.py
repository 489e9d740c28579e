"""This machine measured for the cost model: the figures ``planner.specs.host_measured`` turns into
a HostDevice spec.

The planner is handed numbers; it never runs the compiler. Measuring them does: besides matmul
FLOP/s (fp32, bf16, and what a Linear's forward and backward reach of it), memcpy bandwidth and the
host optimizer's cost per parameter, per tensor and per call (a Trainer steps it once per pack),
the runtime's own cost per compute task and per op (Python, autograd, small kernels, the waits'
bookkeeping) is timed on three packings of a small GPT, in each mode a run can be in: untracked
(the default), with every tensor counted (``track_memory``, and a recorded timeline's memory on a
HostDevice) and with the timeline recorded; a copy's fixed cost is read from that timeline. So
this module sits above the compiler and the runtime and below the front door (``api``, whose
``plot_memory`` predicts with it).

A calibration taken while the machine is busy is wrong for every later prediction (a 40x slower
machine model was once cached this way), so it is measured, kept and checked with that in mind:

* ``measure_host()`` (a few seconds) takes each figure from the fastest of several short trials
  (the machine's speed, not its load at one instant): the median of their fastest third, so that
  one lucky trial (a turbo burst, a copy that stayed in cache) cannot set it; and keeps, with each, its spread (the median
  trial over the best: 1.0 when nothing disturbed them) and the load average per core it saw.
* ``host_calibration()`` reads the cache file (``~/.cache/harmony_fx/host_spec.json``, or under
  ``HARMONY_FX_CACHE``; one entry per torch version, CPU, core count and thread count) and uses an
  entry only if it is plausible (``Calibration.problems``: sane values, a small spread, a quiet
  machine, newer than the torch build) and agrees within 2x with a quick re-measure of matmul and
  copy speed (some 50 ms). Otherwise it measures again and, figure by figure, takes the new
  measurement unless it is doubtful or more than 2x slower than the stored one (a busy moment
  makes a figure slower, never faster); a figure still implausible then is used with a warning,
  never silently. Keeping the fastest ever seen instead would only ratchet: every outlier would
  stay, and predictions would drift low.
* ``check_prediction(measured, predicted)``: a run more than 1.25x off its prediction (what the
  predictions aim at) measures again, once per process (``plot_memory`` and ``harmony-fx demo`` call
  it): the runtime's cost per task and per op, which no quick probe re-checks, can be taken in a
  busy moment that the spread and load did not show (1.5x high, once here).

``harmony-fx calibrate`` shows the entry and its checks; ``--refresh`` measures it afresh.
``measure_local()`` is the spec, ``get_spec(name)`` a preset or ``"host"``, ``spec_for(device)``
the spec a compiled module's device is predicted with.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import platform
import re
import statistics
import time
import warnings

import torch

from harmony_fx.compiler.driver import compile_program
from harmony_fx.compiler.stages import StageLog
from harmony_fx.config import CompileOptions
from harmony_fx.frontend.calls import Calls
from harmony_fx.models import GPTConfig, TinyGPT
from harmony_fx.planner.choose import device_spec
from harmony_fx.planner.profile import profile_graph
from harmony_fx.planner.specs import DeviceSpec, HostSpec, get_spec as preset, host_measured
from harmony_fx.runtime.autograd import HarmonyFunction
from harmony_fx.runtime.session import Session
from harmony_fx.user_frames import user_stacklevel

__all__ = ["Calibration", "measure_host", "checked", "host_calibration", "host_figures", "check_prediction",
           "recalibrate",
           "measure_local", "host_spec", "get_spec", "spec_for", "cache_path", "cache_key"]

# v3: each figure with its spread and load; the runtime's cost in each mode (tracked, recorded).
# v4: a Linear's FLOP/s, the fixed cost of a copy and of an optimizer step call (the runtime's cost
# per task no longer includes the copies': a v3 entry's would count them twice)
# v5: a figure is the median of its fastest trials, a copy is timed past the caches (a v4 entry's
# copy figure was often the cache's speed)
CACHE_VERSION = "v5"

# higher is faster; "linear": a Linear layer's forward and backward, the FLOP/s training reaches
RATES = ("fp32", "bf16", "copy", "linear")
# the runtime's seconds per compute task and per op, untracked, then the extra of counting every
# tensor (per op: a dispatch) and of recording the timeline (per task: a span); and its fixed
# seconds per copy (a PREFETCH or OFFLOAD: detaching or cloning, its event, its bookkeeping), read
# from a recorded timeline's copy spans; and what a backward's and a recompute's ops cost in forward
# ops (from its compute spans); from one timing
RUNTIME = ("task", "op", "track_op", "record_task", "copy_action", "backward_ops", "recompute_ops")
# the host optimizer (AdamW, with the copies an all-or-nothing Trainer step keeps to undo it): seconds
# per parameter, per parameter tensor and per call (a Trainer steps the optimizer once per pack)
UPDATE = ("update", "update_tensor", "update_call")
FIGURES = RATES + RUNTIME + UPDATE

SPREAD_LIMIT = 2.0   # a figure whose median trial took more than this times its best was disturbed
LOAD_LIMIT = 1.5     # runnable tasks per core while measuring, above which the machine was busy
DISAGREEMENT = 2.0   # a stored figure this many times off a quick re-measure is measured again
RECHECK = 1.25       # a run's time this many times off its prediction has the figures measured again
# what a HostDevice's figures can be at all: FLOP/s and bytes/s, seconds per task and per op
_BOUNDS = {"fp32": (1e7, 1e15), "bf16": (1e7, 1e16), "copy": (1e7, 1e13), "linear": (1e7, 1e15), "task": (0.0, 0.1),
           "op": (0.0, 0.01), "track_op": (0.0, 0.01), "record_task": (0.0, 0.1), "copy_action": (0.0, 0.01),
           "backward_ops": (0.1, 10.0), "recompute_ops": (0.1, 10.0),
           "update": (0.0, 1e-6), "update_tensor": (0.0, 0.01), "update_call": (0.0, 0.1)}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """This machine's figures (``FIGURES``), each with its ``spread`` (median trial over best) and
    the ``load`` average per core while it was measured; ``measured_at``: seconds since the epoch."""

    figures: dict[str, float]
    spread: dict[str, float]
    load: dict[str, float]
    measured_at: float

    def problems(self, built_at: float | None = None) -> list[str]:
        """Why these figures should not be used as they are (empty: plausible). ``built_at``: when
        torch was installed (``torch_built_at()``); figures older than it are stale."""
        found = []
        for name in FIGURES:
            value = self.figures.get(name)
            low, high = _BOUNDS[name]
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
                found.append(f"{name} = {value!r} is not a figure this machine can have ({low:g} to {high:g})")
            elif self.spread.get(name, math.inf) > SPREAD_LIMIT:
                spread = self.spread.get(name, math.inf)
                found.append(f"{name}'s trials were {spread:.1f}x apart (the machine was busy)")
            elif self.load.get(name, math.inf) > LOAD_LIMIT:
                found.append(f"{name} was measured under a load of {self.load.get(name, math.inf):.1f} per core")
        if built_at is not None and self.measured_at < built_at:
            found.append("measured before this torch build was installed")
        return found

    def merged(self, other: "Calibration") -> "Calibration":
        """Figure by figure, ``other`` (the newer measurement) with its spread and load, except where
        ``self``'s is plausible and ``other``'s doubtful or invalid, or ``other``'s is more than
        ``DISAGREEMENT`` times slower (a busy moment that the spread and load did not show: it slows
        a measurement down, it never speeds one up). The runtime's figures are taken together (they
        are solved together), by their cost per task."""
        figures, spread, load = dict(self.figures), dict(self.spread), dict(self.load)
        groups = [((name,), lambda c, name=name: 1.0 / c.figures[name]) for name in RATES]
        groups.append((RUNTIME, lambda c: c.figures["task"]))
        groups.append((UPDATE, lambda c: c.figures["update_tensor"]))
        for names, cost in groups:
            mine, theirs = _rank(self, names), _rank(other, names)
            slower = theirs == mine == 0 and cost(other) > DISAGREEMENT * cost(self)
            if theirs <= mine and not slower:
                for name in names:
                    figures[name], spread[name], load[name] = other.figures[name], other.spread[name], other.load[name]
        return Calibration(figures, spread, load, max(self.measured_at, other.measured_at))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, entry: object) -> "Calibration | None":
        """An entry of the cache file, or ``None`` when it is not one (another version's, edited)."""
        try:
            return cls({k: float(v) for k, v in entry["figures"].items()},
                       {k: float(v) for k, v in entry["spread"].items()},
                       {k: float(v) for k, v in entry["load"].items()}, float(entry["measured_at"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def describe(self) -> str:
        """One line per figure: its value, spread and load, for ``harmony-fx calibrate``."""
        units = {"fp32": ("GFLOP/s", 1e-9), "bf16": ("GFLOP/s", 1e-9), "linear": ("GFLOP/s", 1e-9),
                 "copy": ("GB/s", 1e-9)}
        lines = []
        for name in FIGURES:
            unit, scale = units.get(name, ("x", 1.0) if name.endswith("_ops") else ("us", 1e6))
            value = self.figures.get(name, math.nan) * scale
            lines.append(f"  {name:<13} {value:>10.3f} {unit:<8} spread {self.spread.get(name, math.nan):.2f}x, "
                         f"load {self.load.get(name, math.nan):.2f} per core")
        return "\n".join(lines)


def _rank(calibration: Calibration, names: tuple[str, ...]) -> int:
    """Lower is better: 0 plausible, 1 doubtful (a large spread, a busy machine), 2 invalid."""
    if not all(_valid(calibration, name) for name in names):
        return 2
    return int(any(calibration.spread.get(name, math.inf) > SPREAD_LIMIT
                   or calibration.load.get(name, math.inf) > LOAD_LIMIT for name in names))


def _valid(calibration: Calibration, name: str) -> bool:
    value = calibration.figures.get(name)
    low, high = _BOUNDS[name]
    return isinstance(value, float) and math.isfinite(value) and low <= value <= high


def cache_path() -> pathlib.Path:
    """The cache file: ``host_spec.json`` under ``HARMONY_FX_CACHE`` (default ``~/.cache/harmony_fx``)."""
    folder = pathlib.Path(os.environ.get("HARMONY_FX_CACHE", pathlib.Path.home() / ".cache" / "harmony_fx"))
    return folder / "host_spec.json"


def cache_key() -> str:
    """This machine's entry in the cache file: the version of the figures, torch's, the CPU's model,
    its core count and torch's thread count (another of any is measured anew)."""
    return (f"{CACHE_VERSION}-torch{torch.__version__}-{_cpu_name()}-cpus{os.cpu_count()}"
            f"-threads{torch.get_num_threads()}")


@functools.lru_cache(maxsize=None)
def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return re.sub(r"[^A-Za-z0-9]+", "_", line.split(":", 1)[1]).strip("_")
    return re.sub(r"[^A-Za-z0-9]+", "_", platform.processor() or platform.machine()).strip("_")


def torch_built_at() -> float:
    """When this torch was installed (its library file's modification time): figures measured
    before it timed another build."""
    return os.path.getmtime(torch._C.__file__)


def stored() -> Calibration | None:
    """This machine's entry of the cache file, unchecked (``None``: there is none)."""
    return Calibration.from_json(_read_cache().get(cache_key()))


def _read_cache() -> dict:
    try:
        cached = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _store(calibration: Calibration) -> None:
    cached = _read_cache()
    cached[cache_key()] = calibration.to_json()
    path = cache_path()
    with contextlib.suppress(OSError):  # a read-only home: measured again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=2))


def review(calibration: Calibration | None) -> list[str]:
    """Why ``calibration`` (the stored entry) should be measured again: its own problems, and any
    figure a quick re-measure finds more than ``DISAGREEMENT`` times faster (it was taken while the
    machine was busy). Empty: use it."""
    if calibration is None:
        return ["nothing stored for this machine"]
    found = calibration.problems(torch_built_at())
    probe = quick_probe()
    for name, now in probe.items():
        then = calibration.figures.get(name, 0.0)
        if _valid(calibration, name) and now > DISAGREEMENT * then:
            found.append(f"{name} measures {now / then:.0f}x faster now than stored ({now:.3g} vs {then:.3g})")
    return found


def checked() -> tuple[Calibration, tuple[str, ...]]:
    """This machine's calibration, checked (``review``) once per process and measured again where
    it fails, and why it was (empty: the stored one is used). A figure still implausible after
    measuring is used with a warning."""
    if "checked" not in _process:
        _process["checked"] = _check()
    return _process["checked"]


# this process's calibration once checked (``checked``), or measured again (``recalibrate``)
_process: dict[str, tuple[Calibration, tuple[str, ...]]] = {}


def _check() -> tuple[Calibration, tuple[str, ...]]:
    calibration = stored()
    if calibration is not None and calibration.measured_at < torch_built_at():
        calibration = None  # another torch build's figures: not merged with this one's
    reasons = review(calibration)
    if reasons:
        measured = measure_host()
        calibration = measured if calibration is None else calibration.merged(measured)
        _store(calibration)
        left = calibration.problems()
        if left:
            shown = "; ".join(left[:2]) + (f"; and {len(left) - 2} more" if len(left) > 2 else "")
            warnings.warn(f"harmony_fx: this machine's calibration is doubtful ({shown}); predicted times may be "
                          "off. `harmony-fx calibrate` shows it; `--refresh` on a quiet machine measures it again.",
                          stacklevel=user_stacklevel())
    return calibration, tuple(reasons)


def host_calibration() -> Calibration:
    """This machine's calibration, checked (``checked``)."""
    return checked()[0]


def host_figures() -> dict[str, float]:
    """This machine's figures (``FIGURES``), from ``host_calibration()``."""
    return dict(host_calibration().figures)


def recalibrate(merge: bool = True) -> Calibration:
    """Measure now and store: merged with the stored entry, figure by figure (``merge``), or in its
    place; this process's specs are made again from it."""
    measured = measure_host()
    previous = stored()
    calibration = previous.merged(measured) if merge and previous is not None else measured
    _store(calibration)
    _forget()
    _process["checked"] = (calibration, ("measured again on request",))
    return calibration


def check_prediction(measured_seconds: float, predicted_seconds: float) -> bool:
    """Called with a run's time and its prediction on this machine's figures: more than ``RECHECK``
    times apart, the figures are measured again (once per process; merged, so a busy moment now
    cannot make them worse). True when they changed: predict again."""
    ratio = max(measured_seconds, predicted_seconds) / max(min(measured_seconds, predicted_seconds), 1e-12)
    if ratio <= RECHECK or _rechecked:
        return False
    _rechecked.append(ratio)
    before = host_calibration().figures
    return recalibrate().figures != before


_rechecked: list[float] = []  # the disagreements that measured again in this process (at most one)


def _forget() -> None:
    """This process's figures and specs are made again from the cache file on next use."""
    _process.clear()
    _local_spec.cache_clear()


def measure_local(memory: int | str | None = None, *, tracked: bool = False, recorded: bool = False) -> DeviceSpec:
    """This machine as a HostDevice (``planner.specs.host_measured`` of ``host_figures()``), with
    ``memory`` bytes (default: unbounded), for a run that counts every tensor (``tracked``) and
    records its timeline (``recorded``) or not; one spec per combination for the process."""
    return _local_spec(memory, tracked, recorded)


@functools.lru_cache(maxsize=None)
def _local_spec(memory: int | str | None, tracked: bool, recorded: bool) -> DeviceSpec:
    return host_measured(host_figures(), memory, tracked=tracked, recorded=recorded)


def host_spec() -> HostSpec:
    """The host as measured: its optimizer's cost per parameter, per tensor and per call (``UPDATE``),
    what a Trainer's per-pack updates take on this machine (the predictions of ``plot_memory``)."""
    figures = host_figures()
    return HostSpec(update_params_per_second=1.0 / max(figures["update"], 1e-12),
                    update_tensor_seconds=figures["update_tensor"], update_call_seconds=figures["update_call"])


def get_spec(name: str) -> DeviceSpec:
    """A GPU preset by name (``planner.specs.PRESETS``), or ``"host"``: this machine, measured."""
    return measure_local() if name == "host" else preset(name)


def spec_for(device, budget: int | None = None, *, tracked: bool = False, recorded: bool = False) -> DeviceSpec:
    """The spec a compiled module's ``device`` (a ``runtime.devices.Device``) is predicted with:
    its GPU's preset (``planner.choose.device_spec``), or this machine measured for a HostDevice,
    in the mode the run was in (``tracked``: every tensor counted; ``recorded``: the timeline)."""
    if device.torch_device.type == "cuda":
        return device_spec(device, budget)
    return measure_local(tracked=tracked, recorded=recorded)


# ---------------------------------------------------------------------------------------- measuring
def measure_host() -> Calibration:
    """Every figure of ``FIGURES`` measured now (a few seconds), each from its fastest trials (``_rate``)."""
    trials = {name: _matmul_trials(dtype) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    trials["copy"] = _copy_trials()
    trials["linear"] = _linear_trials()
    figures = {name: _rate(times) for name, times in trials.items()}
    spread = {name: _spread(times) for name, times in trials.items()}
    load = {name: _load() for name in trials}
    runtime, runtime_spread = _runtime_overheads(figures["linear"], figures["copy"])
    figures.update(runtime)
    spread.update({name: runtime_spread for name in RUNTIME})
    load.update({name: _load() for name in RUNTIME})
    update, update_spread = _update_costs()
    figures.update(update)
    spread.update({name: update_spread for name in UPDATE})
    load.update({name: _load() for name in UPDATE})
    return Calibration(figures, spread, load, time.time())


def quick_probe() -> dict[str, float]:
    """Matmul FLOP/s (fp32) and copy bytes/s in some 50 ms, each from its fastest trials: enough to
    tell a stored figure taken while the machine was busy (it is many times slower)."""
    return {"fp32": _rate(_matmul_trials(torch.float32, trials=8)), "copy": _rate(_copy_trials(trials=4))}


def _matmul_trials(dtype: torch.dtype, size: int = 256, reps: int = 4, trials: int = 20) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of each trial: several short ones, so that one of them finds the machine quiet."""
    with torch.random.fork_rng(devices=[]):  # the caller's random numbers stay where they were
        a = torch.randn(size, size).to(dtype)
    torch.mm(a, a)
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, a)
        times.append((2 * size**3 * reps, time.perf_counter() - start))
    return times


def _copy_trials(megabytes: int = 128, trials: int = 6) -> list[tuple[float, float]]:
    """(bytes, seconds) of each trial, copying more than any CPU's caches hold: a pack's weights
    and stash are megabytes to gigabytes, and a 16 MiB copy here ran at 44 GB/s from the cache
    against 15 GB/s from memory, and swung between the two."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        dst.copy_(src)
        times.append((src.numel(), time.perf_counter() - start))
    return times


def _linear_trials(rows: int = 128, width: int = 512, reps: int = 2, trials: int = 12) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of a Linear layer's forward and backward (its input's gradient and its
    weight's: three matmuls, the bias and the gradients' accumulation with them), the FLOP/s a
    training step's matmuls reach: the backward's transposed operands run slower than the square
    ``torch.mm`` of ``_matmul_trials`` (some 0.6x of it here at this size)."""
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(0)
        layer = torch.nn.Linear(width, width)
        x = torch.randn(rows, width, requires_grad=True)
        grad = torch.ones(rows, width)
        layer(x).backward(grad)
        times = []
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(reps):
                layer(x).backward(grad)
            times.append((6 * rows * width * width * reps, time.perf_counter() - start))
    return times


def _rate(trials: list[tuple[float, float]]) -> float:
    """Work per second of the fastest trials: the median of the fastest third (its best trial
    alone would be an outlier as often as the machine's speed)."""
    rates = sorted((work / max(seconds, 1e-9) for work, seconds in trials), reverse=True)
    return statistics.median(rates[:max(1, len(rates) // 3)])


def _spread(trials: list[tuple[float, float]]) -> float:
    seconds = [s for _, s in trials]
    return statistics.median(seconds) / max(min(seconds), 1e-9)


def _load() -> float:
    """The 1-minute load average per core (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def _runtime_overheads(flops: float, copy_bandwidth: float) -> tuple[dict[str, float], float]:
    """The runtime's own cost on this machine (``RUNTIME``'s figures) and the spread of its trials,
    from three packings of a small GPT (the demo's width and sequence, two blocks) whose arithmetic
    is small: one task per layer, two packs, and one (few tasks of many ops: without it, tasks and
    ops of the first two are nearly proportional and the split between them is noise). A copy's
    fixed cost (``copy_action``) is the median of the recorded timeline's copy spans (their bytes
    take microseconds at most here); the recorded compute spans weigh a backward's and a
    recompute's ops against a forward's (``backward_ops``, ``recompute_ops``: some 1.5 and 1.2 here,
    where the simulator once took 2 and 1); what is left of the iteration times once FLOPs, bytes
    and copies are paid is split between tasks and ops so weighed (least squares); counting every
    tensor costs a dispatch per op (``track_op``), recording the timeline a span per task
    (``record_task``). Tasks are counted as the simulator charges them: once each, whatever the
    number of layers in the pack."""
    # seeded, without moving the caller's random numbers; compiled and run with grad on, whatever
    # the caller's mode (as a HarmonyModule captures)
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(0)
        return _time_packings(flops, copy_bandwidth)


_MODES = {"": (False, False), "track_": (True, False), "record_": (False, True)}  # prefix: (tracked, recorded)


def _time_packings(flops: float, copy_bandwidth: float) -> tuple[dict[str, float], float]:
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    x = torch.randint(0, config.vocab_size, (8, config.block_size))
    times, spreads, copy_spans = {prefix: [] for prefix in _MODES}, [], []
    runs = []  # per packing: its compute tasks as (kind, forward ops, FLOP seconds), and its copies
    points = []  # per recorded compute span: (kind, forward ops, seconds less its FLOPs)
    for boundaries in (None, (0, 5), (0,)):  # every layer a pack; the embeddings and first block, the rest; one
        model = TinyGPT(config)
        options = CompileOptions(devices=["host:0"], memory_budget=None, microbatches=2, track_memory=False,
                                 pack_boundaries=boundaries)
        if boundaries is None:
            layers = len(compile_program(model, (x,), {}, options).layers)
            options = dataclasses.replace(options, pack_boundaries=tuple(range(layers)))
        compiled = compile_program(model, (x,), {}, options)
        session, calls = Session(compiled, StageLog()), Calls(compiled, model)
        (device,) = compiled.devices
        size = compiled.layout.mb_sizes[0]
        layer_flops = [layer.fwd_flops * size for layer in profile_graph("model", compiled.captured.gm, size).layers]
        ops_of = {pack.index: sum(n.op == "call_function" for n in pack.gm.graph.nodes) for pack in compiled.packs}
        # as the simulator counts them: a backward does twice its forward's FLOPs
        seconds_of = {(kind, pack.index): sum(layer_flops[i] for i in pack.layers) * (2 if kind == "BWD" else 1) / flops
                      for pack in compiled.packs for kind in _COMPUTE_KINDS}
        tasks = [(a.kind.name, ops_of[a.pack], seconds_of[(a.kind.name, a.pack)])
                 for f, b in compiled.device_actions for a in f + b if a.kind.name in _COMPUTE_KINDS]
        runs.append((tasks, sum(a.kind.name in ("PREFETCH", "OFFLOAD") for f, b in compiled.device_actions
                                for a in f + b)))
        try:
            for prefix, (tracked, recorded) in _MODES.items():
                device.track_memory, session.recording = tracked, recorded
                seconds, fastest = [], {}
                for _ in range(7):
                    start = time.perf_counter()
                    _call(session, calls, x).float().mean().backward()
                    seconds.append(time.perf_counter() - start)
                    for _, stream, label, begun, ended in session.stats.spans if recorded else ():
                        fastest[(stream, label)] = min(fastest.get((stream, label), math.inf), ended - begun)
                moved = session.stats.bytes_h2d + session.stats.bytes_d2h
                work = sum(task[2] for task in tasks) + moved / copy_bandwidth
                times[prefix].append(max(min(seconds) - work, 0.0))
                spreads.append(statistics.median(seconds) / max(min(seconds), 1e-9))
                for (stream, label), span in fastest.items():
                    if stream in ("h2d", "d2h", "peer"):
                        copy_spans.append(span)
                    elif match := re.match(r"(FWD|RECOMPUTE|BWD) p(\d+)@", label):
                        kind, pack = match.group(1), int(match.group(2))
                        points.append((kind, ops_of[pack], span - seconds_of[(kind, pack)]))
        finally:
            session.close()
    copy_action = statistics.median(copy_spans) if copy_spans else 0.0
    factors = _op_factors(points)
    rows = [(len(tasks), sum(ops * factors[kind] for kind, ops, _ in tasks)) for tasks, _ in runs]
    task, op = _solve(rows, [max(t - n * copy_action, 0.0) for t, (_, n) in zip(times[""], runs)])
    extra = {prefix: max(sum(times[prefix]) - sum(times[""]), 0.0) for prefix in ("track_", "record_")}
    return {"task": task, "op": op, "track_op": extra["track_"] / sum(o for _, o in rows),
            "record_task": extra["record_"] / sum(t for t, _ in rows), "copy_action": copy_action,
            "backward_ops": factors["BWD"], "recompute_ops": factors["RECOMPUTE"]}, max(spreads)


_COMPUTE_KINDS = ("FWD", "RECOMPUTE", "BWD")


def _op_factors(points: list[tuple[str, int, float]]) -> dict[str, float]:
    """What a recompute's and a backward's ops cost, each in forward ops, from the recorded compute
    spans (kind, forward ops, seconds less FLOPs): one fixed cost per span and one cost per op of
    each kind, by least squares (a forward that keeps no graph and one that keeps it are both
    ``FWD``: the recompute always builds it). Without spans of a kind, the simulator's defaults."""
    columns = {kind: index + 1 for index, kind in enumerate(_COMPUTE_KINDS)}
    rows = [tuple(1 if c == 0 else ops if c == columns[kind] else 0 for c in range(4)) for kind, ops, _ in points]
    defaults = {"FWD": 1.0, "RECOMPUTE": DeviceSpec.recompute_ops, "BWD": DeviceSpec.backward_ops}
    if not rows or not all(any(row[columns[kind]] for row in rows) for kind in _COMPUTE_KINDS):
        return defaults
    _, forward, recompute, backward = _solve(rows, [seconds for *_, seconds in points])
    if forward <= 0:
        return defaults
    return {"FWD": 1.0, "RECOMPUTE": recompute / forward, "BWD": backward / forward}


def _update_costs() -> tuple[dict[str, float], float]:
    """The host optimizer's seconds per parameter, per tensor and per call (``UPDATE``) and the
    spread of its trials: AdamW steps over many small tensors in one call and in sixteen (a Trainer
    steps the optimizer once per pack, each step's fixed cost paid again), and over a few large
    ones, each after the copies of the tensors and their state a Trainer keeps to undo the step.
    A step's parameters and state are out of the caches when their update runs (the backward's data
    took them), so each call is timed after ``_CACHE_BYTES`` are written, and the large tensors are
    too large for the caches anyway (64 MiB with their state and copies): a parameter costs some
    twice as much as in cache, a small tensor some 1.3 times."""
    rows, times, spreads = [], [], []
    evict = torch.empty(_CACHE_BYTES, dtype=torch.uint8)
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False):
        for calls, count, numel in ((1, 64, 64), (16, 64, 64), (1, 4, 2**19)):
            params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
            for param in params:
                param.grad = torch.randn(numel)
            share = count // calls
            optimizers = [torch.optim.AdamW(params[i:i + share], lr=1e-3) for i in range(0, count, share)]
            for optimizer in optimizers:
                optimizer.step()  # its state, made on the first step
            steps = [(optimizer, [t for p in optimizer.param_groups[0]["params"]
                                  for t in (p.data, *optimizer.state[p].values())]) for optimizer in optimizers]
            undo = [[torch.empty_like(t) for t in tensors] for _, tensors in steps]
            seconds = []
            for _ in range(7):
                took = 0.0
                for (optimizer, tensors), kept in zip(steps, undo):
                    evict.fill_(1)  # a pack's update follows backward work that took the caches
                    start = time.perf_counter()
                    for copy, tensor in zip(kept, tensors):
                        copy.copy_(tensor)
                    optimizer.step()
                    took += time.perf_counter() - start
                seconds.append(took)
            rows.append((calls, count, count * numel))
            times.append(min(seconds))
            spreads.append(statistics.median(seconds) / max(min(seconds), 1e-9))
    per_call, per_tensor, per_param = _solve(rows, times)
    return {"update": per_param, "update_tensor": per_tensor, "update_call": per_call}, max(spreads)


_CACHE_BYTES = 32 * 2**20  # written before each timed optimizer call: more than a server core's share of cache


def _solve(rows: list[tuple[int, ...]], times: list[float]) -> tuple[float, ...]:
    """Seconds per unit of each count that add up to the rows' times (least squares: as many rows
    as counts or more); a negative share (noise) is left out and the others solved again without it."""
    kept = list(range(len(rows[0])))
    while kept:
        matrix = torch.tensor([[row[i] for i in kept] for row in rows], dtype=torch.float64)
        solved = torch.linalg.lstsq(matrix, torch.tensor(times, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
        if min(solved.tolist()) >= 0:
            shares = dict(zip(kept, solved.tolist()))
            return tuple(shares.get(i, 0.0) for i in range(len(rows[0])))
        kept.remove(kept[int(torch.argmin(solved))])
    return tuple(0.0 for _ in rows[0])


def _call(session: Session, calls: Calls, x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` as a ``HarmonyModule`` runs it (its forward programs, and the backward programs
    when autograd's backward reaches it), without the front door's call guards."""
    compiled = session.compiled
    outputs = HarmonyFunction.apply(session, calls, calls.split((x,), {}), *compiled.captured.flatten_inputs((x,), {}),
                                    *compiled.trainable_params())
    return calls.structure(list(outputs), (x,), {})
