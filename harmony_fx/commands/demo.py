"""``harmony-fx demo``: train a GPT four times larger than a device's memory budget.

It takes the devices at hand (every GPU, else HostDevices: GPU stand-ins in host memory), sets each
device's budget to a quarter of what eager training of the model needs, lets the planner choose
packs and microbatches, and trains with a progress bar (loss, tokens/s, bytes moved, peak vs
budget). It checks the first losses against eager training of an identical copy, then writes a
Chrome trace of the last step and a PNG of memory over that step per device.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

__all__ = ["add_parser", "run"]


def add_parser(commands) -> None:
    demo = commands.add_parser("demo", help="train a GPT four times larger than a device's memory budget",
                               description=__doc__)
    demo.add_argument("--steps", type=int, default=150)
    demo.add_argument("--devices", type=int, default=None,
                      help="how many devices (default: every GPU, else one HostDevice)")
    demo.add_argument("--parallel", choices=["auto", "dp", "pp"], default="auto")
    demo.add_argument("--budget-fraction", type=float, default=0.25,
                      help="each device's budget as a fraction of what eager training needs (default 0.25)")
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--width", type=int, default=64)
    demo.add_argument("--batch", type=int, default=16)
    demo.add_argument("--microbatches", type=int, default=None, help="default: chosen by the planner")
    demo.add_argument("--lr", type=float, default=1e-2)
    demo.add_argument("--check-steps", type=int, default=3, help="steps compared with eager training")
    demo.add_argument("--out", default="harmony_demo_out", help="where the trace and the memory plot go")
    demo.add_argument("--quick", action="store_true", help="a smaller model, for CI")
    demo.add_argument("--nodes", type=int, default=None,
                      help="train across this many processes on this machine (gloo on 127.0.0.1), as torchrun "
                           "runs one per server; prints the torchrun command")
    demo.add_argument("--fail-once", type=int, default=None, metavar="STEP",
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
    from tqdm import tqdm

    import harmony_fx
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.config import format_size
    from harmony_fx.models import GPTConfig, TinyGPT

    if args.quick:
        args.layers, args.width, args.batch = 6, 32, 8
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
          f"{sum(p.numel() for p in model.parameters()):,} parameters; batch {args.batch}x{config.block_size}")
    print(f"eager training needs {format_size(need)}; each device's budget is {format_size(budget)} "
          f"({args.budget_fraction:.0%})")
    started = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, ((idx,), target), devices=_device_names(args.devices),
                                 memory_budget=budget, microbatches=args.microbatches, parallel=args.parallel,
                                 track_memory=True)  # the measured peak, shown against the budget
    devices = [device.name for device in trainer.hm.devices]
    print(f"planned and compiled for {', '.join(devices)} in {time.perf_counter() - started:.1f} s\n")
    print(trainer.explain())
    print()

    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=args.lr)
    worst, eager_seconds, harmony_seconds, tokens = 0.0, 0.0, 0.0, args.batch * config.block_size
    over_budget = []
    progress = tqdm(range(args.steps), desc="training", unit="step", file=sys.stdout, dynamic_ncols=True)
    try:
        for step in progress:
            if step == args.steps - 1:
                trainer.record_timeline()  # the last step's, for the trace and the memory plot
            x, y = batch(step)
            started = time.perf_counter()
            loss = trainer.step(((x,), y))
            seconds = time.perf_counter() - started
            harmony_seconds += seconds
            stats = trainer.stats
            peak = max(stats.peak_bytes.values())
            progress.set_postfix_str(
                f"loss {loss.item():.4f}  {tokens / seconds:,.0f} tok/s  "
                f"moved {format_size(stats.bytes_h2d + stats.bytes_d2h)}  peak {format_size(peak)}/{format_size(budget)}")
            if peak > budget:
                over_budget.append(step)
            if step < args.check_steps:
                started = time.perf_counter()
                eager_loss = loss_fn(eager_model(x), y)
                eager_loss.backward()
                eager_optimizer.step()
                eager_optimizer.zero_grad(set_to_none=True)
                eager_seconds += time.perf_counter() - started
                worst = max(worst, abs(loss.item() - eager_loss.item()) / max(abs(eager_loss.item()), 1e-12))
    finally:
        progress.close()

    os.makedirs(args.out, exist_ok=True)
    trace, plot = os.path.join(args.out, "trace.json"), os.path.join(args.out, "memory.png")
    trainer.save_trace(trace)
    trainer.plot_memory(plot)
    trainer.close()
    checked = min(args.check_steps, args.steps)
    print("\nsummary")
    print(f"  final loss {loss.item():.4f} after {args.steps} steps; first {checked} losses match eager "
          f"(largest relative difference {worst:.2e})")
    print(f"  peak {format_size(peak)} per device under a budget of {format_size(budget)}; "
          f"eager needs {format_size(need)} ({need / max(peak, 1):.1f}x more)")
    if checked:
        print(f"  {tokens * args.steps / harmony_seconds:,.0f} tokens/s vs eager {tokens * checked / eager_seconds:,.0f} "
              f"tokens/s (eager without a memory cap, on the same machine)")
    print(f"  wrote {trace} (open in chrome://tracing or ui.perfetto.dev) and {plot}")
    if over_budget:
        print(f"FAILED: the measured peak was over the budget at steps {over_budget}", file=sys.stderr)
        return 1
    if worst > 1e-5:
        print("FAILED: losses differ from eager", file=sys.stderr)
        return 1
    return 0


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
