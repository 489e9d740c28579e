"""What each rank runs (``launch.py``), and the one-process runs they are compared with."""
from __future__ import annotations

import copy
import pathlib

import torch

import harmony_fx
from harmony_fx.models import GPTConfig, TinyGPT

BATCH = 4         # samples per rank
MICROBATCHES = 2  # per rank
STEPS = 5
LR = 1e-3
PACKS = (0, 3, 6, 9)  # four packs, three of them with parameters: collectives per pack


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
    state = trainer.state_dict()["optimizer"]["state"]  # the NVMe tier's state read back too
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


def train(rank: int, world: int, out: pathlib.Path, shard_optimizer: bool = True, steps: int = STEPS,
          max_grad_norm: float | None = None, nvme: bool = False) -> dict:
    model, batches = model_and_batches(world, steps)
    optimizer = optimizer_of(model)
    # made before the Trainer: it must stay bound to the optimizer when the Trainer shards it
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.7 ** step)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS, shard_optimizer=shard_optimizer,
                                 max_grad_norm=max_grad_norm, nvme_path=out / "tier" if nvme else None)
    losses = []
    for batch in batches:
        losses.append(trainer.step(local(batch, rank)).clone())
        schedule.step()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "state": full_state(trainer), "state_bytes": state_bytes(trainer),
            "network_bytes": dict(trainer.stats.network_bytes),
            "numels": [p.numel() for p in model.parameters()],
            "packs": {pack: [p.numel() for p in params] for pack, params in trainer._groups.items()},
            "tier_bytes": trainer.plan.tier_bytes}


def different_start(rank: int, world: int, out: pathlib.Path) -> dict:
    """Each rank's model differs from rank 0's in a parameter (as a head initialised with each
    process's own seed) and a buffer; the Trainer starts every rank from rank 0's."""
    model, batches = model_and_batches(world)
    with torch.no_grad():
        next(model.parameters()).add_(rank)
    model.register_buffer("seen", torch.full((3,), rank))
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS, shard_optimizer=False)
    start = {name: value.detach().clone() for name, value in model.state_dict().items()}
    losses = [trainer.step(local(batch, rank)).clone() for batch in batches[:2]]
    return {"start": start, "losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def closed(rank: int, world: int, out: pathlib.Path) -> dict:
    """Steps and a checkpoint, then ``close``: the two groups the Trainer made are destroyed there,
    their gloo threads joined, and closing again, or after the caller destroyed every group, is
    harmless."""
    import torch.distributed as dist

    import gc

    model, batches = model_and_batches(world, 1)
    copied = copy.deepcopy(model)
    dropped = harmony_fx.Trainer(copied, loss_fn, optimizer_of(copied), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS)
    dropped.step(local(batches[0], rank))
    del dropped, copied
    gc.collect()
    collected_threads = gloo_threads()  # a Trainer collected unclosed ends its groups too
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS)
    trainer.step(local(batches[0], rank))
    trainer.save(out / "checkpoint")  # sharded: its DTensors hold a mesh over the Trainer's group
    groups = trainer.cluster.control_group, trainer.cluster.worker_group
    registered_before = [_registered(group) for group in groups]
    open_threads = gloo_threads()
    trainer.close()
    registered_after = [_registered(group) for group in groups]
    del groups
    closed_threads = gloo_threads()
    trainer.close()
    together = torch.ones(1)
    dist.all_reduce(together)  # the caller's group still works
    # its own threads, counted now that they have long run: each names itself when it first runs, so
    # right after the group's first collective one of its two may not have yet (seen once on a loaded CI)
    callers = gloo_threads()
    dist.destroy_process_group()
    trainer.close()
    # the launcher destroys the group it made once this returns
    dist.init_process_group("gloo", init_method=f"file://{out / 'again'}", rank=rank, world_size=world)
    return {"before": registered_before, "after": registered_after, "world_kept": together.item() == world,
            "threads": (callers, collected_threads, open_threads, closed_threads)}


class _Witness:
    """An object alive until the interpreter exits, whose finalizer counts what is left then."""


_KEPT_TO_THE_EXIT = []


def left_open(rank: int, world: int, out: pathlib.Path) -> dict:
    """A Trainer alive until the interpreter exits, never closed (a script's global), the caller's
    group destroyed as a script ends (the launcher): the Trainer's finalizer joins its groups'
    threads at the exit, before the interpreter finalizes; a finalizer made before the Trainer's runs
    after it and counts the gloo threads left."""
    import weakref

    import torch.distributed as dist

    dist.barrier()  # the caller's group starts its gloo threads at its first collective
    callers = gloo_threads()
    witness = _Witness()  # at the exit, finalizers run newest first: this one after the Trainer's
    weakref.finalize(witness, lambda: torch.save(gloo_threads(), out / f"exit{rank}.pt"))
    model, batches = model_and_batches(world, 2)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS)
    for batch in batches:
        trainer.step(local(batch, rank))
    _KEPT_TO_THE_EXIT.extend([trainer, witness])
    return {"callers": callers, "open": gloo_threads()}


def gloo_threads() -> int:
    """gloo's worker threads alive in this process, counted by the name torch gives them."""
    tasks = pathlib.Path("/proc/self/task")
    return sum((task / "comm").read_text().strip() == "pt_gloo_runloop" for task in tasks.iterdir())


def _registered(group) -> bool:
    import torch.distributed as dist

    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):
        return False
    return True


def one_process(world: int, steps: int = STEPS, max_grad_norm: float | None = None) -> dict:
    """The same global batches in one process, ``world`` HostDevices data-parallel."""
    model, batches = model_and_batches(world, steps)
    optimizer = optimizer_of(model)
    devices = [f"host:{i}" for i in range(world)]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.7 ** step)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, batches[0], devices=devices, parallel="dp",
                                 microbatches=world * MICROBATCHES, pack_boundaries=PACKS, max_grad_norm=max_grad_norm)
    losses = []
    for batch in batches:
        losses.append(trainer.step(batch).clone())
        schedule.step()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "state": full_state(trainer), "state_bytes": state_bytes(trainer)}


# ---------------------------------------------------------------------- checkpoints and faults
GLOBAL_BATCH = 12  # splits evenly over 1, 2 and 3 ranks


def _global_batches(steps: int):
    torch.manual_seed(1)
    return [(torch.randint(0, 64, (GLOBAL_BATCH, 16)), torch.randint(0, 64, (GLOBAL_BATCH, 16)))
            for _ in range(steps)]


def _part(batch, rank: int, world: int):
    share = GLOBAL_BATCH // world
    return tuple(t[rank * share:(rank + 1) * share] for t in batch)


def checkpointed(rank: int, world: int, out: pathlib.Path, folder: str, steps: int = STEPS, resume: bool = False,
                 die_in_step: int | None = None, dying_rank: int = 1) -> dict:
    """Train ``steps`` steps of the global batches, saving after each; ``resume``: from ``folder``'s
    ``latest`` first; ``die_in_step``: ``dying_rank`` exits in the middle of that step's collectives."""
    import os
    import time

    from harmony_fx.distributed import PeerError
    from harmony_fx.distributed.updates import CrossProcessUpdates

    model, _ = model_and_batches(world, steps=0)
    batches = _global_batches(steps)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), _part(batches[0], rank, world),
                                 devices=["host:0"], microbatches=MICROBATCHES, pack_boundaries=PACKS, collective_timeout=20)
    if resume:
        trainer.load(folder)
    if die_in_step is not None and rank == dying_rank:
        reduce = CrossProcessUpdates.reduce

        def dying(self, pack, grads):
            if trainer.step_count == die_in_step and pack != self.order[0]:
                os._exit(3)  # killed after the first pack's collectives of the step
            return reduce(self, pack, grads)

        CrossProcessUpdates.reduce = dying
    losses, error, seconds = {}, None, None
    while trainer.step_count < steps:
        step = trainer.step_count
        started = time.monotonic()
        try:
            losses[step] = trainer.step(_part(batches[step], rank, world)).clone()
        except PeerError as failure:
            error, seconds = str(failure), time.monotonic() - started
            break
        trainer.save(folder)
    return {"losses": losses, "error": error, "seconds": seconds, "step_count": trainer.step_count}


def single_resumed(folder: str, steps: int = STEPS) -> dict:
    """A single process (no torch.distributed) resuming from a folder that ranks wrote."""
    model, _ = model_and_batches(1, steps=0)
    batches = _global_batches(steps)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), batches[0], devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS)
    trainer.load(folder)
    losses = {}
    while trainer.step_count < steps:
        step = trainer.step_count
        losses[step] = trainer.step(batches[step]).clone()
    return {"losses": losses}


def one_rank_fails(rank: int, world: int, out: pathlib.Path, failing_step: int = 2) -> dict:
    """Rank 1's step ``failing_step`` fails in its backward (a task raises); every rank undoes the
    step and trains on, retrying it, to the end."""
    from harmony_fx.distributed import StepFailedElsewhere
    from harmony_fx.runtime.executor import Runtime

    model, batches = model_and_batches(world)
    optimizer = optimizer_of(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.7 ** step)  # as ``train``
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS)
    if rank == 1:
        backward, failed = Runtime.bwd, []

        def failing(self, pack_index, mb):
            if trainer.step_count == failing_step and pack_index == 1 and not failed:
                failed.append(True)
                raise RuntimeError("a task failed on rank 1")
            return backward(self, pack_index, mb)

        Runtime.bwd = failing
    losses, errors, before, after = [], [], None, None
    for batch in batches:
        while True:
            if trainer.step_count == failing_step:
                before = [p.detach().clone() for p in model.parameters()]
            try:
                losses.append(trainer.step(local(batch, rank)).clone())
                schedule.step()
                break
            except (RuntimeError, StepFailedElsewhere) as error:
                errors.append(f"{type(error).__name__}: {error}")
                after = [p.detach().clone() for p in model.parameters()]
    if rank == 1:
        Runtime.bwd = backward
    trainer.close()  # as a script ends: the Trainer's group stops its threads here, not at the exit
    return {"losses": losses, "errors": errors, "undone": all(torch.equal(a, b) for a, b in zip(before, after)),
            "params": [p.detach().clone() for p in model.parameters()]}


def hanging(rank: int, world: int, out: pathlib.Path, hang_in_step: int = 1, timeout: float = 4) -> dict:
    """Rank 1 stops answering in the middle of a step (it sleeps in its second pack's collective);
    rank 0 must give up after the group's timeout, naming it."""
    import time

    from harmony_fx.distributed import PeerError
    from harmony_fx.distributed.updates import CrossProcessUpdates

    model, batches = model_and_batches(world)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS, collective_timeout=timeout)
    if rank == 1:
        reduce = CrossProcessUpdates.reduce

        def hang(self, pack, grads):
            if trainer.step_count == hang_in_step and pack != self.order[0]:
                time.sleep(4 * timeout + 12)  # past rank 0's timeout and its wait for reports
            return reduce(self, pack, grads)

        CrossProcessUpdates.reduce = hang
    error, seconds = None, None
    for batch in batches[:hang_in_step + 1]:
        started = time.monotonic()
        try:
            trainer.step(local(batch, rank))
        except PeerError as failure:
            error, seconds = str(failure), time.monotonic() - started
            break
    return {"error": error, "seconds": seconds}


def uneven(rank: int, world: int, out: pathlib.Path) -> dict:
    """Two steps with every rank's share, then one where rank 1 has half as many samples as rank 0
    (a last, short batch): the loss's mean is over the global batch, weighted by the shares' sizes."""
    model, batches = model_and_batches(world, steps=3)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS)
    losses = [trainer.step(local(batch, rank)).clone() for batch in batches[:2]]
    x, y = batches[2]
    short = (x[:4], y[:4]) if rank == 0 else (x[4:6], y[4:6])
    losses.append(trainer.step(short).clone())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def other_packs(rank: int, world: int, out: pathlib.Path, shard_optimizer: bool = False) -> dict:
    """Two steps under a memory budget, without clipping (each pack updated as its gradients arrive):
    at the second, rank 1 has twice the samples, a batch its plan cuts into other packs than the
    example's (planned afresh on rank 1 alone). Every rank's parameters after each step."""
    model, batches = other_packs_batches()
    trainer = harmony_fx.Trainer(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), batches[0][rank],
                                 devices=["host:0"], memory_budget="300KiB", shard_optimizer=shard_optimizer)
    params, packs = [], []
    for step in batches:
        trainer.step(step[rank])
        params.append([p.detach().clone() for p in model.parameters()])
        packs.append(sorted(trainer._last_hm.update_groups()))
    trainer.close()
    return {"params": params, "packs": packs, "example packs": sorted(trainer._groups)}


def other_packs_batches():
    """The model and, per step, each rank's batch: 4 samples each, then 4 and 8."""
    model, batches = model_and_batches(2, steps=3)
    (x0, y0), (x1, y1), (x2, y2) = batches
    return model, [[(x0[:4], y0[:4]), (x0[4:], y0[4:])], [(x1[:4], y1[:4]), (torch.cat([x1[4:], x2[:4]]),
                                                                             torch.cat([y1[4:], y2[:4]]))]]


def other_packs_eager() -> list:
    """The same steps in one process, eagerly: each step's loss the mean over every rank's samples."""
    model, batches = other_packs_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = []
    for step in batches:
        optimizer.zero_grad()
        loss_fn(model(torch.cat([x for x, _ in step])), torch.cat([y for _, y in step])).backward()
        optimizer.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


def batch_norm(rank: int, world: int, out: pathlib.Path) -> dict:
    """A BatchNorm model, two steps on each rank's own share: the running statistics each rank holds
    after each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    generator = torch.Generator().manual_seed(rank)
    shares = [(torch.randn(4, 16, generator=generator), torch.randint(0, 4, (4,), generator=generator))
              for _ in range(2)]
    trainer = harmony_fx.Trainer(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                                 shares[0], devices=["host:0"], pack_boundaries=(0, 2), shard_optimizer=False)
    buffers = []
    for share in shares:
        trainer.step(share)
        buffers.append([b.clone() for b in model.buffers()])
    trainer.close()
    return {"buffers": buffers}


def uneven_one_process() -> dict:
    model, batches = model_and_batches(2, steps=3)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), batches[0], devices=["host:0", "host:1"],
                                 parallel="dp", microbatches=2 * MICROBATCHES, pack_boundaries=PACKS)
    losses = [trainer.step(batch).clone() for batch in batches[:2]]
    x, y = batches[2]
    losses.append(trainer.step((x[:6], y[:6])).clone())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def overlap(rank: int, world: int, out: pathlib.Path) -> dict:
    """Whether each pack's collectives start while the backward of earlier packs is still to run:
    the backward of an earlier pack holds until the first collective has started (or 20 s pass,
    which only happens if collectives wait for the whole backward)."""
    import threading

    from harmony_fx.distributed.updates import CrossProcessUpdates
    from harmony_fx.runtime.executor import Runtime

    model, batches = model_and_batches(world, steps=1)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS)
    first_pack = trainer._cross.order[0]
    started = threading.Event()
    reduced, waited = [], []
    reduce, backward = CrossProcessUpdates.reduce, Runtime.bwd

    def noted_reduce(self, pack, grads):
        reduced.append(pack)
        started.set()
        return reduce(self, pack, grads)

    def held_backward(self, pack_index, mb):
        if pack_index < first_pack and not waited:
            waited.append(started.wait(timeout=20))
        return backward(self, pack_index, mb)

    CrossProcessUpdates.reduce, Runtime.bwd = noted_reduce, held_backward
    trainer.step(local(batches[0], rank))
    return {"reduces": reduced, "overlapped": waited == [True], "order": list(trainer._cross.order)}


def different_packs(rank: int, world: int, out: pathlib.Path) -> dict:
    """Rank 1 cuts the model into other packs: every rank refuses to train, naming it."""
    model, batches = model_and_batches(world, steps=1)
    try:
        harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                           microbatches=MICROBATCHES, pack_boundaries=PACKS if rank == 0 else (0, 6))
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def tier_write_fails(rank: int, world: int, out: pathlib.Path, failing_file: int, failing_step: int = 2) -> dict:
    """Every rank's optimizer state on its NVMe tier; rank 1's write of its ``failing_file``-th pack
    file (from 1) fails in step ``failing_step``: every rank undoes the step (its tier files too)
    and retries it, to the end."""
    from harmony_fx.distributed import StepFailedElsewhere
    from harmony_fx.runtime import tier

    model, batches = model_and_batches(world)
    optimizer = optimizer_of(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.7 ** step)  # as ``train``
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS, shard_optimizer=False,
                                 nvme_path=out / "tier")
    if rank == 1:
        finish, files = tier._FileWriter.finish, []

        def failing(file):
            if trainer.step_count == failing_step:
                files.append(file.path)
                if len(files) == failing_file:
                    raise OSError(28, "No space left on device (injected)")
            return finish(file)

        tier._FileWriter.finish = failing
    losses, errors = [], []
    for batch in batches:
        while True:
            try:
                losses.append(trainer.step(local(batch, rank)).clone())
                schedule.step()
                break
            except (OSError, StepFailedElsewhere) as error:
                errors.append(f"{type(error).__name__}: {error}")
    trainer.flush()
    return {"losses": losses, "errors": errors, "params": [p.detach().clone() for p in model.parameters()],
            "state": full_state(trainer)}


def tier_refusals(rank: int, world: int, out: pathlib.Path) -> dict:
    """What ``nvme_path=`` across processes refuses, and the messages."""
    model, batches = model_and_batches(world)
    refused = {}
    for name, options in (("sharded", {"shard_optimizer": True}), ("clipping", {"max_grad_norm": 1.0})):
        try:
            harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                               microbatches=MICROBATCHES, pack_boundaries=PACKS, nvme_path=out / name, **options)
        except ValueError as error:
            refused[name] = str(error)
    # without shard_optimizer: the tier takes each rank's whole state
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS, nvme_path=out / "tier")
    refused["sharded by default"] = trainer.cluster.shard_optimizer
    try:
        trainer.step(tuple(t[:2] for t in local(batches[0], rank)))
    except ValueError as error:
        refused["smaller batch"] = str(error)
    return {"refused": refused}


def tier_resumed(rank: int, world: int, out: pathlib.Path) -> dict:
    """Two steps, a checkpoint folder written by every rank (its tier's state read back into it),
    three more steps; then a new trainer on a new tier resumes from the folder and trains the same
    three steps."""
    def trainer_on(tier: str):
        model, _ = model_and_batches(world, steps=0)
        return harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                  microbatches=MICROBATCHES, pack_boundaries=PACKS, nvme_path=out / tier)

    _, batches = model_and_batches(world)
    first = trainer_on("tier-a")
    for batch in batches[:2]:
        first.step(local(batch, rank))
    first.save(out / "checkpoints")
    later = [first.step(local(batch, rank)).clone() for batch in batches[2:]]
    resumed = trainer_on("tier-b")
    resumed.load(out / "checkpoints")
    again = [resumed.step(local(batch, rank)).clone() for batch in batches[2:]]
    return {"later": later, "again": again, "first": full_state(first), "resumed": full_state(resumed),
            "params": [[p.detach().clone() for p in t.model.parameters()] for t in (first, resumed)]}


# ---------------------------------------------------------------------- host gradient memory
class GradientWatch:
    """What a replicated trainer's gradients live in, seen from outside: at each all-reduce, the
    tensor it is handed and the bytes of the distinct storages then alive among this step's landed
    gradients (weakly held, so the watch keeps none alive), every ``.grad`` and that tensor; after
    each step, where each ``.grad`` is."""

    def __init__(self, trainer) -> None:
        import weakref

        cross = trainer._cross
        self.params = list(trainer.model.parameters())
        self.packs = {pack: [self._index(p) for p in params] for pack, params in trainer._groups.items() if params}
        self.handed: list[tuple[int, int]] = []        # (data_ptr, numel) per all-reduce
        self.alive_bytes: list[int] = []               # per all-reduce
        self.landed_in_grad: list[bool] = []           # per landed gradient: the memory of its .grad after the reduce
        self._landed: list = []
        reduce, all_reduce = cross.reduce, cross.cluster.all_reduce

        def watched_reduce(pack, grads):
            self._landed += [weakref.ref(g) for g in grads if g is not None]
            reduce(pack, grads)
            self.landed_in_grad += [g.data_ptr() == p.grad.data_ptr() for p, g in zip(cross.buffers[pack].params, grads)
                                    if g is not None]

        def watched_all_reduce(tensor, what):
            alive = [t for t in (ref() for ref in self._landed) if t is not None]
            alive += [p.grad for p in self.params if p.grad is not None] + [tensor]
            self.alive_bytes.append(sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                         for t in alive}.values()))
            self.handed.append((tensor.data_ptr(), tensor.numel()))
            return all_reduce(tensor, what)

        cross.reduce, cross.cluster.all_reduce = watched_reduce, watched_all_reduce

    def _index(self, param) -> int:
        return next(i for i, p in enumerate(self.params) if p is param)

    def step_ended(self) -> None:
        self._landed.clear()

    def one_set_bytes(self) -> int:
        """One fp32 set of every trainable parameter's gradient, counted here."""
        return sum(4 * p.numel() for p in self.params if p.requires_grad)


def grad_memory(rank: int, world: int, out: pathlib.Path, steps: int = 3, track_memory: bool = True) -> dict:
    """Replicated training, its gradients watched (``GradientWatch``); ``track_memory``: the
    HostDevice copies its gradients to the host, as a GPU does (else it hands them over)."""
    model, batches = model_and_batches(world, steps)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer_of(model), local(batches[0], rank), devices=["host:0"],
                                 microbatches=MICROBATCHES, pack_boundaries=PACKS, shard_optimizer=False,
                                 track_memory=track_memory)
    watch = GradientWatch(trainer)
    grads = []
    for batch in batches:
        trainer.step(local(batch, rank))
        watch.step_ended()
        grads.append([p.grad.data_ptr() for p in watch.params])
    return {"handed": watch.handed, "alive_bytes": watch.alive_bytes, "landed_in_grad": watch.landed_in_grad,
            "one_set_bytes": watch.one_set_bytes(), "grads": grads, "packs": watch.packs,
            "numels": [p.numel() for p in watch.params]}
