"""``harmony-fx demo``: train a GPT four times larger than a device's memory budget.

It takes the devices at hand (every GPU, else HostDevices: GPU stand-ins in host memory), sets each
device's budget to a quarter of what eager training of the model needs, lets the planner choose
packs and microbatches, and trains with a progress bar (loss, tokens/s, bytes moved), untracked, as
harmony is meant to run (the plan's check keeps the budget). An identical copy trains eagerly
beside it for the first steps: its losses are checked against harmony's, and its step time is the
one harmony's is set beside. The second-to-last step records where its time went (compute,
recompute, copies exposed, the optimizer exposed, the runtime); the last counts every tensor (the
peak against the budget) and writes a Chrome trace and a PNG of memory over that step per device,
measured against predicted. The summary gives the gap to eager and its breakdown, the step time
predicted on this machine's calibration, and the same plan simulated on a GPU preset beside eager.
On HostDevices both run with one intra-op thread (``--threads``): the model's ops are small. Both
run with denormal floats flushed to zero where the CPU can (put back as it was at the end).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time

import torch

from harmony_fx.commands.arguments import count, fraction, positive_int

__all__ = ["add_parser", "run"]

# relative: float rounding over the first steps (AdamW amplifies it over many: --check-steps is for a few)
_LOSS_TOLERANCE = 1e-5


def add_parser(commands) -> None:
    demo = commands.add_parser("demo", help="train a GPT four times larger than a device's memory budget",
                               description=__doc__)
    demo.add_argument("--steps", type=positive_int, default=150)
    demo.add_argument("--devices", type=positive_int, default=None,
                      help="how many devices (default: every GPU, else one HostDevice)")
    demo.add_argument("--parallel", choices=["auto", "dp", "pp"], default="auto")
    demo.add_argument("--budget-fraction", type=fraction, default=0.25,
                      help="each device's budget as a fraction of what eager training needs (default 0.25)")
    demo.add_argument("--layers", type=positive_int, default=8)
    demo.add_argument("--width", type=positive_int, default=64)
    demo.add_argument("--batch", type=positive_int, default=16)
    demo.add_argument("--microbatches", type=positive_int, default=None, help="default: chosen by the planner")
    demo.add_argument("--lr", type=float, default=1e-2)
    demo.add_argument("--check-steps", type=count, default=3,
                      help="steps compared with eager training (a few: over many, AdamW's "
                      "normalised steps grow float rounding past the check's 1e-5)")
    demo.add_argument("--out", default="harmony_demo_out", help="where the trace and the memory plot go")
    demo.add_argument("--quick", action="store_true", help="a smaller model, for CI")
    demo.add_argument("--threads", type=positive_int, default=None,
                      help="intra-op threads, for harmony and eager alike (default: 1 on HostDevices, whose small "
                           "ops gain nothing from OpenMP's synchronisation; torch's default on GPUs)")
    demo.add_argument("--nodes", type=positive_int, default=None,
                      help="train across this many processes on this machine (gloo on 127.0.0.1), as torchrun "
                           "runs one per server; prints the torchrun command")
    demo.add_argument("--fail-once", type=positive_int, default=None, metavar="STEP",
                      help="with --nodes: one process exits before STEP, once; torchrun restarts them all from "
                           "the last checkpoint")


def _device_names(count: int | None) -> list[str] | None:
    if count is None:
        return None  # every GPU, else one HostDevice
    kind = "cuda" if torch.cuda.is_available() else "host"
    return [f"{kind}:{i}" for i in range(count)]


def run(args: argparse.Namespace) -> int:
    if args.nodes:
        return _across(args)
    threads, flushing = torch.get_num_threads(), _flushes_denormals()
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flushing)


def _flushes_denormals() -> bool:
    """Whether the CPU flushes denormal floats to zero now (torch can set it, not read it)."""
    return torch.tensor([1e-40]).mul(1.0).item() == 0.0


@dataclasses.dataclass
class _Run:
    """What the training loop measured, for the summary."""

    loss: float = 0.0
    worst: float = 0.0  # the largest relative difference to eager's loss over the checked steps
    harmony_times: list[float] = dataclasses.field(default_factory=list)  # untracked, unrecorded steps
    eager_times: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (compute, optimizer)
    explained_step: int | None = None  # the step whose time is broken down, and its parts
    explained_seconds: float = 0.0
    parts: dict[str, float] | None = None
    peak: int = 0  # the last step's, every tensor counted


def _train(args: argparse.Namespace) -> int:
    import harmony_fx
    from harmony_fx import calibrate
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.config import format_size
    from harmony_fx.models import GPTConfig, TinyGPT
    from harmony_fx.planner.module import simulate_module

    if args.quick:
        args.layers, args.width, args.batch = 6, 32, 8
    if args.threads is not None or not torch.cuda.is_available():  # HostDevices without a GPU
        torch.set_num_threads(args.threads or 1)
    # As the model trains, some activations get small enough to be denormal floats, which x86 CPUs
    # compute many times slower (harmony's step crept from 60 to 73 ms over the 150 steps here):
    # flushed to zero, for harmony and eager alike, the step time stays what the calibration predicts
    denormals_flushed = torch.set_flush_denormal(True)
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0)
    torch.manual_seed(0)
    model = TinyGPT(config)
    eager_model = copy.deepcopy(model)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), target.reshape(-1))

    def batch(step: int):
        # a copy task: predict the token one position back (learnable, so the loss falls)
        generator = torch.Generator().manual_seed(step)
        idx = torch.randint(0, config.vocab_size, (args.batch, config.block_size), generator=generator)
        return idx, torch.roll(idx, shifts=1, dims=1)

    idx, target = batch(0)
    need = eager_training_bytes(model, (idx,), lambda out: loss_fn(out, target))
    budget = int(need * args.budget_fraction)
    print(f"TinyGPT: {config.n_layer} layers, width {config.n_embd}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters; batch {args.batch}x{config.block_size}; "
          f"{torch.get_num_threads()} intra-op thread(s) for harmony and eager alike"
          + ("; denormals flushed to zero for both" if denormals_flushed else ""))
    print(f"eager training needs {format_size(need)}; each device's budget is {format_size(budget)} "
          f"({args.budget_fraction:.0%})")
    started = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # untracked, as harmony is meant to run: the plan's check keeps the budget, and the last step
    # counts every tensor to confirm the peak
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, ((idx,), target), devices=_device_names(args.devices),
                                 memory_budget=budget, microbatches=args.microbatches, parallel=args.parallel)
    print(f"planned and compiled for {', '.join(d.name for d in trainer.hm.devices)} in "
          f"{time.perf_counter() - started:.1f} s\n")
    print(trainer.explain())
    print()
    tokens = args.batch * config.block_size
    result = _loop(args, trainer, eager_model, loss_fn, batch, tokens)

    os.makedirs(args.out, exist_ok=True)
    trace, plot = os.path.join(args.out, "trace.json"), os.path.join(args.out, "memory.png")
    trainer.save_trace(trace)
    trainer.plot_memory(plot)
    hm = trainer.hm
    step_seconds = _steady(result.harmony_times) or result.explained_seconds
    measured_here = hm.devices[0].torch_device.type != "cuda"
    predicted = _predicted(hm, simulate_module, calibrate)
    if measured_here and step_seconds and calibrate.check_prediction(step_seconds, predicted):
        predicted = _predicted(hm, simulate_module, calibrate)
    trainer.close()

    checked = min(args.check_steps, args.steps)
    print("\nsummary")
    print(f"  final loss {result.loss:.4f} after {args.steps} steps; first {checked} losses "
          f"{'match' if result.worst <= _LOSS_TOLERANCE else 'differ from'} eager's "
          f"(largest relative difference {result.worst:.2e})")
    print(f"  peak {format_size(result.peak)} per device on the last step (every tensor counted; the plan predicted "
          f"{format_size(max(hm.plan.predicted_peak.values()))}) under a budget of {format_size(budget)}; eager "
          f"needs {format_size(need)} ({need / max(result.peak, 1):.1f}x more)")
    _print_times(args, hm, result, tokens, step_seconds, predicted, measured_here)
    print(f"  wrote {trace} (open in chrome://tracing or ui.perfetto.dev) and {plot}")
    if result.peak > budget:
        print(f"FAILED: the counted peak, {format_size(result.peak)}, was over the budget", file=sys.stderr)
        return 1
    if result.worst > _LOSS_TOLERANCE:
        print("FAILED: losses differ from eager", file=sys.stderr)
        return 1
    return 0


def _loop(args: argparse.Namespace, trainer, eager_model, loss_fn, batch, tokens: int) -> _Run:
    """``args.steps`` harmony steps with a progress bar, the eager copy beside the first of them. The
    second-to-last step records its spans (at the untracked speed): where its time went; the last
    counts every tensor too: the peak, the trace and the memory plot."""
    from tqdm import tqdm

    from harmony_fx.config import format_size
    from harmony_fx.runtime.breakdown import step_breakdown

    result = _Run(explained_step=args.steps - 2 if args.steps >= 3 else None)
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=args.lr)
    eager_steps = min(args.steps, max(args.check_steps, _EAGER_STEPS))
    progress = tqdm(range(args.steps), desc="training", unit="step", file=sys.stdout, dynamic_ncols=True)
    try:
        for step in progress:
            if step == result.explained_step:
                trainer.record_timeline(memory=False)
            elif step == args.steps - 1:
                trainer.record_timeline()
            x, y = batch(step)
            started = time.perf_counter()
            loss = trainer.step(((x,), y)).item()
            seconds = time.perf_counter() - started
            stats = trainer.stats
            if step == result.explained_step:
                result.parts = step_breakdown(stats.spans, seconds, stats.update_exposed_seconds)
                result.explained_seconds = seconds
            elif step == args.steps - 1:
                result.peak = max(stats.peak_bytes.values())
            else:
                result.harmony_times.append(seconds)
            result.loss = loss
            progress.set_postfix_str(f"loss {loss:.4f}  {tokens / seconds:,.0f} tok/s  "
                                     f"moved {format_size(stats.bytes_h2d + stats.bytes_d2h)}")
            if step < eager_steps:
                eager_loss, times = _eager_step(eager_model, eager_optimizer, loss_fn, x, y)
                result.eager_times.append(times)
                if step < args.check_steps:
                    result.worst = max(result.worst, abs(loss - eager_loss) / max(abs(eager_loss), 1e-12))
    finally:
        progress.close()
    return result


def _print_times(args: argparse.Namespace, hm, result: _Run, tokens: int, step_seconds: float, predicted: float,
                 measured_here: bool) -> None:
    """The summary's times: harmony's against eager's, where harmony's step went, the prediction on
    this machine, and the same plan simulated on a GPU preset beside eager."""
    from harmony_fx import calibrate
    from harmony_fx.planner.module import eager_seconds, simulate_module
    from harmony_fx.planner.specs import PRESETS

    eager_total = _steady([a + b for a, b in result.eager_times])
    if step_seconds and eager_total:
        print(f"  harmony {tokens / step_seconds:,.0f} tokens/s ({step_seconds * 1e3:.1f} ms a step) vs eager "
              f"{tokens / eager_total:,.0f} tokens/s ({eager_total * 1e3:.1f} ms, without a memory cap) on the same "
              f"machine: {step_seconds / eager_total:.1f}x the time")
    if result.parts is not None:
        eager_compute = _steady([a for a, _ in result.eager_times])
        eager_update = _steady([b for _, b in result.eager_times])
        print(f"  where harmony's step went (measured on step {result.explained_step}, "
              f"{result.explained_seconds * 1e3:.1f} ms; eager's forward and backward take {eager_compute * 1e3:.1f} "
              f"ms, its optimizer {eager_update * 1e3:.1f} ms):")
        sizes = sorted({size for size in hm.mb_sizes if size})
        notes = {
            "compute": f"the packs' forward and backward, on microbatches of {'/'.join(map(str, sizes)) or args.batch}",
            "recompute": "each pack's forward again before its backward (its activations were not kept)",
            "copies exposed": "weights in, stash and gradients out, where no compute hides them",
            "optimizer exposed": "the host's updates the step waited for at its end",
            "runtime": "Python between tasks, and the step's own bookkeeping",
        }
        for name, value in result.parts.items():
            print(f"    {name:<18} {value * 1e3:7.1f} ms  {notes[name]}")
    if predicted and step_seconds:
        where = "this machine's calibration" if measured_here else f"the {calibrate.spec_for(hm.devices[0]).name} preset"
        print(f"  predicted {predicted * 1e3:.1f} ms a step (simulated on {where}); measured "
              f"{step_seconds / predicted:.2f}x of it")
    if measured_here:
        gpu = PRESETS[_GPU_PRESET]
        projected, eager_projected = simulate_module(hm, gpu).seconds, eager_seconds(hm, gpu)
        print(f"  on an {_GPU_PRESET} (simulated, the planner's cost model): this plan {projected * 1e3:.2f} ms a step "
              f"({tokens / projected:,.0f} tokens/s), eager {eager_projected * 1e3:.2f} ms "
              f"({tokens / eager_projected:,.0f} tokens/s)")


# eager trains beside harmony for this many steps (its time is their steady mean), and a plan is
# projected onto this GPU preset
_EAGER_STEPS = 10
_GPU_PRESET = "a100-80gb"


def _eager_step(model, optimizer, loss_fn, x, y) -> tuple[float, tuple[float, float]]:
    """One eager step: its loss, and its (forward and backward, optimizer) seconds."""
    started = time.perf_counter()
    loss = loss_fn(model(x), y)
    loss.backward()
    computed = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), (computed - started, time.perf_counter() - computed)


def _steady(seconds: list[float]) -> float:
    """The mean step time without the first (warm-up) step, when there are others."""
    steady = seconds[1:] or seconds
    return sum(steady) / len(steady) if steady else 0.0


def _predicted(hm, simulate_module, calibrate) -> float:
    """An untracked, unrecorded step of ``hm``, simulated on its device's spec and this host."""
    return simulate_module(hm, calibrate.spec_for(hm.devices[0], hm.budget), calibrate.host_spec()).seconds


def _across(args: argparse.Namespace) -> int:
    """``--nodes N``: torchrun with N processes on this machine, each running ``commands.across``."""
    import shutil
    import subprocess

    out = os.path.join(args.out, "nodes")
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resumed one
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.nodes),
               "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
               "-m", "harmony_fx.commands.across", "--steps", str(min(args.steps, 20)), "--out", out]
    if args.fail_once is not None:
        command += ["--fail-once", str(args.fail_once)]
    print("$ " + " ".join(["torchrun", *command[3:]]), flush=True)
    # gloo restarts need their own rendezvous store per attempt (pytorch/pytorch#135712)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "LOGLEVEL": os.environ.get("LOGLEVEL", "WARNING")}
    return subprocess.call(command, env=env)
