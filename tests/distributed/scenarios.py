"""What each rank runs (``launch.py``), and the one-process runs they are compared with."""
from __future__ import annotations

import pathlib

import torch

import harmony_fx
from harmony_fx.testing.models import GPTConfig, TinyGPT

BATCH = 4         # samples per rank
MICROBATCHES = 2  # per rank
STEPS = 5
LR = 1e-3


def model_and_batches(world: int, steps: int = STEPS):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.0))
    batches = [(torch.randint(0, 64, (world * BATCH, 16)), torch.randint(0, 64, (world * BATCH, 16)))
               for _ in range(steps)]
    return model, batches


def loss_fn(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def optimizer_of(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def local(batch, rank: int):
    x, y = batch
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]


def full_state(trainer) -> dict[int, dict[str, torch.Tensor]]:
    """The optimizer's state per parameter index, whole: a sharded rank gathers every rank's chunks."""
    import torch.distributed as dist

    params = list(trainer.model.parameters())
    state = trainer.optimizer.state_dict()["state"]
    cross = trainer._cross
    if cross is None or not cross.shards:
        return {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()}
    whole = {}
    world = dist.get_world_size()
    for i, param in enumerate(params):
        chunk = cross.chunks[id(param)]
        whole[i] = {}
        for key, value in state[i].items():
            if value.dim() == 0:
                whole[i][key] = value.clone()
                continue
            padded = torch.cat([value, value.new_zeros(chunk.size - value.numel())])
            gathered = padded.new_empty(world * chunk.size)
            dist.all_gather_into_tensor(gathered, padded)
            whole[i][key] = gathered[:chunk.numel].view_as(param).clone()
    return whole


def state_bytes(trainer) -> int:
    return sum(v.numel() * v.element_size() for s in trainer.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def train(rank: int, world: int, out: pathlib.Path, shard_optimizer: bool = True, steps: int = STEPS) -> dict:
    model, batches = model_and_batches(world, steps)
    optimizer = optimizer_of(model)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, shard_optimizer=shard_optimizer)
    losses = [trainer.step(local(batch, rank)).clone() for batch in batches]
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "state": full_state(trainer), "state_bytes": state_bytes(trainer),
            "network_bytes": dict(trainer.stats.network_bytes),
            "numels": [p.numel() for p in model.parameters()],
            "packs": {pack: [p.numel() for p in params] for pack, params in trainer._groups.items()}}


def one_process(world: int, steps: int = STEPS) -> dict:
    """The same global batches in one process, ``world`` HostDevices data-parallel."""
    model, batches = model_and_batches(world, steps)
    optimizer = optimizer_of(model)
    devices = [f"host:{i}" for i in range(world)]
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, batches[0], devices=devices, parallel="dp",
                                 microbatches=world * MICROBATCHES)
    losses = [trainer.step(batch).clone() for batch in batches]
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "state": full_state(trainer), "state_bytes": state_bytes(trainer)}
