"""Parameters cut into one flat chunk per process, as FSDP2 cuts them along dim 0.

A parameter of ``n`` elements is flattened; process ``r`` of ``N`` holds elements
``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / N)`` (the last chunks may be short or empty), which is
``torch.chunk``'s layout and so DTensor's ``Shard(0)`` of the flat parameter: a checkpoint of shards
reads back at any other number of processes. Collectives move padded chunks of exactly ``c``.

One pack's gradients travel as one flat buffer, rank-major (``reduce_scatter``'s input: rank ``r``'s
chunk of every parameter, then rank ``r+1``'s), and its updated shards come back the same way.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
from torch import nn

__all__ = ["Chunk", "chunk_of", "PackBuffers"]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """This process's part of one flat parameter."""

    numel: int    # the parameter's elements
    size: int     # every process's padded chunk: ceil(numel / N)
    start: int    # this process's first element
    stop: int     # one past its last (start == stop: an empty chunk)

    @property
    def length(self) -> int:
        return self.stop - self.start


def chunk_of(numel: int, rank: int, world: int) -> Chunk:
    size = math.ceil(numel / world)
    start = min(rank * size, numel)
    return Chunk(numel, size, start, min(start + size, numel))


def _padded(flat: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``flat``, zero-padded to ``size``."""
    part = flat[rank * size:(rank + 1) * size]
    return part if part.numel() == size else torch.cat([part, part.new_zeros(size - part.numel())])


class PackBuffers:
    """One pack's flat buffers for its collectives (the parameters in a fixed order)."""

    def __init__(self, params: Sequence[nn.Parameter], rank: int, world: int) -> None:
        self.params = list(params)
        self.rank, self.world = rank, world
        self.chunks = [chunk_of(p.numel(), rank, world) for p in self.params]
        self.shard_numel = sum(chunk.size for chunk in self.chunks)  # this rank's padded share

    def rank_major(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """``reduce_scatter``'s input: every rank's padded chunk of every tensor, rank after rank
        (a missing gradient is zeros)."""
        flats = [torch.zeros(p.numel(), dtype=torch.float32) if t is None else t.detach().reshape(-1).float()
                 for p, t in zip(self.params, tensors)]
        return torch.cat([_padded(flat, chunk.size, r) for r in range(self.world)
                          for flat, chunk in zip(flats, self.chunks)])

    def split_shard(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's flat buffer (padded chunks) as one unpadded chunk per parameter."""
        parts, offset = [], 0
        for chunk in self.chunks:
            parts.append(shard[offset:offset + chunk.length])
            offset += chunk.size
        return parts

    def join_shards(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """``all_gather``'s input: this rank's chunks, padded, one after the other."""
        return torch.cat([_padded(s.detach().reshape(-1), chunk.size, 0) for s, chunk in zip(shards, self.chunks)])

    @torch.no_grad()
    def write_gathered(self, gathered: torch.Tensor) -> None:
        """Every rank's chunks (``all_gather``'s output) into the full parameters, in place."""
        per_rank = gathered.view(self.world, self.shard_numel)
        offset = 0
        for param, chunk in zip(self.params, self.chunks):
            flat = per_rank[:, offset:offset + chunk.size].reshape(-1)[:chunk.numel]
            param.copy_(flat.view_as(param))
            offset += chunk.size
