"""Checkpoint folders (``torch.distributed.checkpoint``) that resume at any number of processes.

``save(state, step, root)`` writes ``root/step_00000012/`` (one file per rank plus ``.metadata``) and
then, once every rank has written its part, points ``root/latest`` at it (a temporary file renamed
over the old pointer, so a crash leaves the previous one). A folder counts once ``latest`` names it.

Everything is stored in a layout that does not depend on the number of processes: the model's
tensors whole, and each optimizer state tensor as its parameter's flat form (``numel`` elements)
under the parameter's name; a sharded rank writes its chunk of it (a DTensor ``Shard(0)``, the same
chunks as ``shards.chunk_of``). Loading reads what the loading ranks hold, so 2 ranks resume at 3,
and a single process (no ``torch.distributed``) reads a folder that 2 ranks wrote.
"""
from __future__ import annotations

import io
import os
import pathlib
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

from harmony_fx.training.checkpoint import FORMAT, TrainingState, check_same_model, get_rng_states, set_rng_states

__all__ = ["save", "load", "resolve"]

LATEST = "latest"
_HEADER = {"format": FORMAT, "version": 2}


def resolve(path: str | os.PathLike) -> pathlib.Path:
    """The step folder to read: ``path`` itself, or the one its ``latest`` names."""
    path = pathlib.Path(path)
    if (path / ".metadata").exists():
        return path
    pointer = path / LATEST
    if not pointer.exists():
        raise FileNotFoundError(f"{path} holds no checkpoint: no {LATEST} pointer and no .metadata "
                                "(Trainer.save(folder) writes both)")
    return path / pointer.read_text().strip()


def save(training: TrainingState, step_count: int, root: str | os.PathLike) -> pathlib.Path:
    """The state after ``step_count`` steps, in its folder under ``root``; the NVMe tier's last step
    is settled (the Trainer flushes first)."""
    root = pathlib.Path(root)
    cluster = training.cluster
    folder = root / f"step_{step_count:08d}"
    if cluster is None or cluster.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    # plain values as bytes: DCP would otherwise flatten their dicts and lists into keys of their own
    state = {"harmony_fx": _pack(_HEADER), "step_count": step_count, "model": training.model_state(copied=False),
             "optimizer/param_groups": _pack([{k: v for k, v in group.items() if k != "params"}
                                              for group in training.optimizer.param_groups]),
             f"rng/{0 if cluster is None else cluster.rank}": _pack(get_rng_states())}
    for name, key, value in _optimizer_state(training):
        state[f"optimizer/state/{name}/{key}"] = value
    if cluster is None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=folder, no_dist=True)
    else:
        cluster.barrier()  # the folder exists before anyone writes into it
        dcp.save(state, checkpoint_id=folder, process_group=cluster.control_group)
        cluster.barrier()  # every rank's part is written before the pointer moves
    if cluster is None or cluster.rank == 0:
        _point(root, folder.name)
    return folder


def load(training: TrainingState, path: str | os.PathLike) -> int:
    """Restore ``training`` from a step folder (or the one ``path``'s ``latest`` names); returns its
    step count. The NVMe tier's last step is settled first (the Trainer flushes)."""
    folder = resolve(path)
    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    if training.tier is not None:
        training.tier.masters_to_host()  # what the model loads into; store_all moves them back
    with training.own_calls():
        model_state = training.model.state_dict()
    expected = {f"model.{name}" for name in model_state}
    found = {key for key in stored if key.startswith("model.")}
    if expected != found:
        check_same_model(model_state, {key[len("model."):]: _like(stored[key]) for key in found})
    cluster = training.cluster
    rank = 0 if cluster is None else cluster.rank
    saved_ranks = sorted(int(key.split("/")[1]) for key in stored if key.startswith("rng/"))
    rng_key = f"rng/{rank if rank in saved_ranks else saved_ranks[rank % len(saved_ranks)]}"
    holders = _holders(training)
    state: dict = {"harmony_fx": None, "step_count": 0, "model": model_state, "optimizer/param_groups": None,
                   rng_key: None}
    destinations: dict[str, tuple[torch.Tensor, str, torch.Tensor | None]] = {}  # key -> (holder, state key, local)
    for key, meta in stored.items():
        if not key.startswith("optimizer/state/"):
            continue
        name, state_key = key[len("optimizer/state/"):].rsplit("/", 1)
        if name not in holders:
            raise ValueError(f"the checkpoint {folder} has optimizer state for {name}, which the model lacks")
        holder, chunk = holders[name]
        if not hasattr(meta, "size"):  # a plain Python value
            state[key] = None
            destinations[key] = (holder, state_key, None)
            continue
        size, dtype = tuple(meta.size), meta.properties.dtype
        if not size:  # a scalar, such as Adam's step: the same on every rank
            local = state[key] = torch.empty((), dtype=dtype)
        elif chunk is None:  # this process holds the whole parameter: its state whole, in its shape
            local = torch.empty(holder.shape, dtype=dtype)
            state[key] = local.view(-1)
        else:
            local = torch.empty(chunk.length, dtype=dtype)
            state[key] = _sharded(local, cluster, chunk.numel)
        destinations[key] = (holder, state_key, local)
    if cluster is None:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=folder, no_dist=True)
    else:
        dcp.load(state, checkpoint_id=folder, process_group=cluster.control_group)
    if _unpack(state["harmony_fx"]) != _HEADER:
        raise ValueError(f"{folder} is not a {_HEADER['format']} checkpoint of version {_HEADER['version']}")
    optimizer = training.optimizer
    optimizer.state.clear()
    for key, (holder, state_key, local) in destinations.items():
        optimizer.state.setdefault(holder, {})[state_key] = _unpack(state[key]) if local is None else local
    for group, saved in zip(optimizer.param_groups, _unpack(state["optimizer/param_groups"])):
        group.update(saved)
    if training.cross is not None:
        training.cross.refresh_shards()
    set_rng_states(_unpack(state[rng_key]))
    step_count = state["step_count"]
    if training.tier is not None:
        training.tier.store_all(step_count)  # the loaded state leaves host memory for the tier
    return step_count


def _optimizer_state(training: TrainingState):
    """(parameter name, state key, value in the stored layout) for every optimizer state entry."""
    cluster = training.cluster
    for name, (holder, chunk) in _holders(training).items():
        for key, value in training.optimizer_state(holder).items():
            if not isinstance(value, torch.Tensor):
                value = _pack(value)
            elif value.dim() > 0:
                value = value.reshape(-1) if chunk is None else _sharded(value.reshape(-1), cluster, chunk.numel)
            yield name, key, value


def _holders(training: TrainingState) -> dict[str, tuple[torch.Tensor, object]]:
    """Per parameter name: what the optimizer holds for it (the parameter, or this rank's chunk)
    and the chunk (``None``: whole)."""
    cross = training.cross
    holders = {}
    for name, param in training.model.named_parameters():
        if cross is not None and id(param) in cross.shards:
            holders[name] = (cross.shards[id(param)], cross.chunks[id(param)])
        else:
            holders[name] = (param, None)
    return holders


def _sharded(local: torch.Tensor, cluster, numel: int):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, cluster.mesh(), [Shard(0)], shape=torch.Size([numel]), stride=(1,))


def _like(meta) -> torch.Tensor:
    return torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device="meta")


def _point(root: pathlib.Path, name: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{LATEST}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)


def _pack(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)  # tensors and plain values: no code runs
