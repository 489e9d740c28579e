"""One process of ``harmony-fx demo --nodes N``: what each server runs under ``torchrun``.

A GPT trained data-parallel across the processes, each with its own share of every global batch
and one device, the optimizer state sharded over the processes; a checkpoint folder after every
step, and a restart (``torchrun --max-restarts``) resumes from its ``latest``; rank 0 appends each
step's loss to ``OUT/losses.txt``. At the end, rank 0 trains the same global batches in one process
with N HostDevices and says how far apart the losses are.

Run it as ``torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT
-m harmony_fx.commands.across --out DIR`` on N servers, or through the demo on one machine.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys

import torch
import torch.distributed as dist

import harmony_fx
from harmony_fx.models import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=6, n_head=4, n_embd=64, dropout=0.0)


def _batch(step: int, size: int):
    """Global batch ``step``: a copy task (predict the token one position back), the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.block_size), generator=generator)
    return idx, torch.roll(idx, shifts=1, dims=1)


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), target.reshape(-1))


def _trainer(devices: list[str], batch, args, microbatches: int, **options):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return harmony_fx.Trainer(model, _loss, optimizer, batch, devices=devices, microbatches=microbatches,
                              pack_boundaries=(0, 3, 6, 9), **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harmony_fx.commands.across", description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="samples per process in each step")
    parser.add_argument("--microbatches", type=int, default=2, help="per process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", default="harmony_demo_out/nodes")
    parser.add_argument("--fail-once", type=int, default=None, metavar="STEP",
                        help="rank 1 exits before STEP, once: watch the others fail fast and torchrun restart "
                             "every rank from the last checkpoint")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = pathlib.Path(args.out)
    folder = out / "checkpoints"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)

    def local(step: int):
        x, y = _batch(step, world * args.batch)
        return ((x[rank * args.batch:(rank + 1) * args.batch],), y[rank * args.batch:(rank + 1) * args.batch])

    trainer = _trainer(["host:0"], local(0), args, args.microbatches, collective_timeout=60)
    if (folder / "latest").exists():
        trainer.load(folder)
        if rank == 0:
            print(f"resumed from {(folder / 'latest').read_text().strip()} (restart "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)
    marker = out / "failed_once"
    losses = {}
    while trainer.step_count < args.steps:
        step = trainer.step_count
        if args.fail_once == step and rank == 1 and not marker.exists():
            marker.touch()
            print(f"rank 1: exiting before step {step} (--fail-once)", flush=True)
            os._exit(1)
        losses[step] = trainer.step(local(step))
        trainer.save(folder)
        if rank == 0:
            (out / "losses.txt").open("a").write(f"{step} {losses[step].item()!r}\n")  # every attempt's steps
            sent = sum(trainer.stats.network_bytes.values())
            print(f"step {step:3d}  loss {losses[step].item():.4f}  sent {sent / 2**10:.0f} KiB per rank", flush=True)
    state = sum(v.numel() * v.element_size() for s in trainer.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    dist.destroy_process_group()
    if rank != 0:
        return 0
    print(f"\noptimizer state held by rank 0: {state / 2**10:.0f} KiB (1/{world} of the whole)")
    # the same global batches in one process with `world` HostDevices, data-parallel
    torch.set_num_threads(1)
    x, y = _batch(0, world * args.batch)
    one = _trainer([f"host:{i}" for i in range(world)], ((x,), y), args, world * args.microbatches, parallel="dp")
    worst = 0.0
    for step in range(args.steps):
        x, y = _batch(step, world * args.batch)
        loss = one.step(((x,), y))
        if step in losses:
            worst = max(worst, abs(loss.item() - losses[step].item()))
    print(f"one process with {world} HostDevices on the same global batches: largest loss difference {worst:.1e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
