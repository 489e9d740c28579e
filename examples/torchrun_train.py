"""Data-parallel training across processes with ``harmony_fx.Trainer``, started by torchrun.

    torchrun --nproc_per_node=2 examples/torchrun_train.py

Every process builds the same model and trains on its own share of each global batch, under a memory
budget, with one device (``cuda:LOCAL_RANK`` where there are GPUs, else the host). Nothing in the
training loop changes for the processes: ``harmony_fx.Trainer`` finds torchrun's process group, sums
each pack's gradients over the processes as the backward produces them, and each process updates its
shard of the optimizer state (the update is the same everywhere, so the weights stay equal). The
group is gloo: harmony's gradients and updates live on the host. On several servers, run the same
command on each with ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT``.

At the end rank 0 trains the same model on the same global batches in plain PyTorch, in one process,
and prints both final losses.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import harmony_fx

VOCAB, CONTEXT, WIDTH, DEPTH = 64, 8, 128, 4


class NextToken(nn.Module):
    """Predicts a token from the ``CONTEXT`` tokens before it: embeddings, an MLP, the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH // CONTEXT)
        layers = []
        for _ in range(DEPTH):
            layers += [nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(context).flatten(1)))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``, the same on every rank: the next token follows the context's first one."""
    generator = torch.Generator().manual_seed(step)
    context = torch.randint(0, VOCAB, (size, CONTEXT), generator=generator)
    return context, (context[:, 0] + 1) % VOCAB


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = NextToken()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="samples per process in each step")
    parser.add_argument("--memory-budget", default="256KiB", help="device memory each process may use")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors, and the processes share the cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    devices = [f"cuda:{local_rank}"] if torch.cuda.is_available() else ["host:0"]

    def my_share(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        context, target = global_batch(step, world * args.batch)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        return context[mine], target[mine]

    model, optimizer = build()
    trainer = harmony_fx.Trainer(model, nn.functional.cross_entropy, optimizer, my_share(0), max_grad_norm=1.0,
                                 memory_budget=args.memory_budget, devices=devices, microbatches=2)
    if rank == 0:
        print(f"{world} processes, {args.batch} samples each per step; the model cut into {len(trainer.hm.packs)} "
              f"packs under {args.memory_budget} per device", flush=True)
    losses = []
    for step in range(args.steps):
        loss = trainer.step(my_share(step))  # the loss of the whole global batch, on every rank
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)
    trainer.close()
    dist.destroy_process_group()
    if rank != 0:
        return 0

    # the same global batches, one process, plain PyTorch
    model, optimizer = build()
    for step in range(args.steps):
        context, target = global_batch(step, world * args.batch)
        optimizer.zero_grad()
        eager_loss = nn.functional.cross_entropy(model(context), target)
        eager_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    difference = abs(losses[-1] - eager_loss.item()) / abs(eager_loss.item())
    print(f"final loss: harmony across {world} processes {losses[-1]:.6f}, eager in one process "
          f"{eager_loss.item():.6f} (relative difference {difference:.1e})")
    return 0 if difference <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
