"""``harmony-fx``: the command line.

``harmony-fx plan MODEL``: plan a model on hardware that need not be at hand (see
``commands/plan.py``).

``harmony-fx demo``: train a small GPT with ``harmony_fx.Trainer`` on one HostDevice whose memory
budget is a quarter of what eager training needs; print loss, bytes moved and peak vs budget each
step; check the first losses against eager training of an identical copy.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from harmony_fx.commands import plan

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harmony-fx", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small GPT under a quarter of the memory eager needs")
    demo.add_argument("--steps", type=int, default=150)
    demo.add_argument("--budget-fraction", type=float, default=0.25,
                      help="memory budget as a fraction of what eager training needs (default 0.25)")
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--width", type=int, default=64)
    demo.add_argument("--batch", type=int, default=16)
    demo.add_argument("--microbatches", type=int, default=1)
    demo.add_argument("--lr", type=float, default=1e-2)
    demo.add_argument("--check-steps", type=int, default=3, help="steps compared with eager training")
    demo.add_argument("--quick", action="store_true", help="a smaller model, for CI")
    plan.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "plan":
        return plan.run(args)
    raise AssertionError(args.command)


def _demo(args: argparse.Namespace) -> int:
    import harmony_fx
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.config import format_size
    from harmony_fx.testing.models import GPTConfig, TinyGPT

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
    print(f"eager training needs {format_size(need)}; HostDevice budget {format_size(budget)} "
          f"({args.budget_fraction:.0%})")
    started = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, ((idx,), target),
                                 devices=["host:0"], memory_budget=budget, microbatches=args.microbatches)
    print(f"compiled in {time.perf_counter() - started:.1f} s\n")
    print(trainer.explain())
    print()
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=args.lr)
    worst = 0.0
    for step in range(args.steps):
        x, y = batch(step)
        started = time.perf_counter()
        loss = trainer.step(((x,), y))
        seconds = time.perf_counter() - started
        stats = trainer.stats
        peak = stats.peak_bytes["host:0"]
        line = (f"step {step:3d}  loss {loss.item():.4f}  h2d {format_size(stats.bytes_h2d):>11}  "
                f"d2h {format_size(stats.bytes_d2h):>11}  peak {format_size(peak):>11} / {format_size(budget)}  "
                f"{seconds * 1000:.0f} ms")
        if step < args.check_steps:
            eager_loss = loss_fn(eager_model(x), y)
            eager_loss.backward()
            eager_optimizer.step()
            eager_optimizer.zero_grad(set_to_none=True)
            error = abs(loss.item() - eager_loss.item()) / max(abs(eager_loss.item()), 1e-12)
            worst = max(worst, error)
            line += f"  eager {eager_loss.item():.4f}"
        print(line)
        if peak > budget:
            print(f"FAILED: the measured peak {peak} is over the budget {budget}", file=sys.stderr)
            return 1
    trainer.close()
    print(f"\nsummary: peak within budget every step; first {min(args.check_steps, args.steps)} losses match eager "
          f"(largest relative difference {worst:.2e})")
    if worst > 1e-5:
        print("FAILED: losses differ from eager", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
