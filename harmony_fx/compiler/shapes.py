"""What every key of a program holds, from shapes alone.

The FakeTensor value of an activation on a microbatch (its variant's ``meta["val"]``), the value of
its gradient (the same structure, ``None`` at the leaves without one), and the bytes a copy of any
key moves, in the dtype the graph has for it (weight gradients in the masters' dtype). The planning run, the
plan's byte counts and the simulator all read keys through this one table.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from harmony_fx.analysis.requires_grad import requires_grad_of
from harmony_fx.compiler.variants import Variant
from harmony_fx.ir import meta
from harmony_fx.ir import values as pytrees
from harmony_fx.ir.pack import Pack
from harmony_fx.program.actions import Key, KeyKind
from harmony_fx.ir.values import differentiable
from harmony_fx.runtime.probe import empty_fake

__all__ = ["Shapes", "fake_like"]


def _dense(value: object) -> object:
    """A gradient's layout: a value whose elements share memory (an ``expand``, stride 0; frames
    ``unfold`` cuts with a hop shorter than the frame) has a gradient with an entry of its own for
    each element, laid out dense (the caller's gradient copied into the value's layout would keep
    one write of the elements they share)."""
    if isinstance(value, torch.Tensor) and _overlapping(value.shape, value.stride()):
        return value.new_empty(value.shape)
    return value


def _overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two indices of a tensor of this shape and strides reach the same element: each dim,
    by increasing stride, must step past all that the smaller-strided dims span."""
    span = 0
    for step, size in sorted((step, size) for size, step in zip(shape, stride) if size > 1):
        if step <= span:
            return True
        span += (size - 1) * step
    return False


class Shapes:
    def __init__(self, variants: Mapping[int | None, Variant], mb_sizes: Sequence[int | None],
                 masters: Mapping[str, torch.Tensor], compute_dtype: torch.dtype | None) -> None:
        self.variants = variants
        self.mb_sizes = tuple(mb_sizes)
        self.masters = masters
        self.compute_dtype = compute_dtype
        self._split_cache: dict = {}

    def value_of(self, key: Key) -> object:
        """The FakeTensor value of an activation on microbatch ``key.mb``, or of its gradient."""
        node = self.variants[self.mb_sizes[key.mb]].nodes[key.name]
        value = node.meta[meta.VAL]
        if key.kind == KeyKind.GRAD:
            flags = requires_grad_of(node)
            value = pytrees.with_leaves(value, [_dense(leaf) if flag else None
                                                for leaf, flag in zip(pytrees.leaves(value), flags, strict=True)])
        return value

    def split_dims(self, key: Key, parts: Sequence[int]) -> tuple[tuple[int, tuple[int, ...]] | None, ...]:
        """How the activation ``key`` of a larger forward microbatch cuts into the microbatches
        ``parts``: per leaf of its value, ``(dim, size of each part along it)``, or ``None`` where
        every part holds the same leaf (not batched). The batch dim is the one dim whose size
        differs between the forward's shape and the parts' (the batch analysis keeps the batch the
        outer factor of a flattened dim, so ``[B*S, H]`` cuts at multiples of ``S``). Asked for by
        every ``SPLIT`` of every iteration: worked out once."""
        cached = (key, tuple(parts))
        if cached not in self._split_cache:
            self._split_cache[cached] = self._split_dims(key, parts)
        return self._split_cache[cached]

    def _split_dims(self, key: Key, parts: Sequence[int]) -> tuple[tuple[int, tuple[int, ...]] | None, ...]:
        whole = pytrees.leaves(self.value_of(key))
        pieces = [pytrees.leaves(self.value_of(key._replace(mb=mb))) for mb in parts]
        dims: list[tuple[int, tuple[int, ...]] | None] = []
        for i, leaf in enumerate(whole):
            if not isinstance(leaf, torch.Tensor):
                dims.append(None)
                continue
            shapes = [piece[i].shape for piece in pieces]
            differ = [d for d in range(leaf.dim()) if any(shape[d] != leaf.shape[d] for shape in shapes)]
            if not differ:
                dims.append(None)
            elif len(differ) == 1 and sum(shape[differ[0]] for shape in shapes) == leaf.shape[differ[0]]:
                dims.append((differ[0], tuple(shape[differ[0]] for shape in shapes)))
            else:
                raise ValueError(f"{key} has shape {tuple(leaf.shape)} on the forward's microbatch but "
                                 f"{[tuple(shape) for shape in shapes]} on the backward's: it cannot be cut along one "
                                 "batch dim; use one microbatch size for forward and backward (microbatches=N)")
        return tuple(dims)

    def fake_value(self, key: Key, device: torch.device) -> object:
        """``value_of(key)`` as fresh FakeTensors on ``device`` (inside a ``FakeTensorMode``)."""
        return pytrees.map_tensors(lambda t: fake_like(t, device), self.value_of(key))

    def key_bytes(self, key: Key, packs: Sequence[Pack]) -> int:
        """Bytes a copy of ``key`` moves (``packs``: the packing whose weights ``W[p]`` names)."""
        if key.kind in (KeyKind.ACT, KeyKind.GRAD):  # in the dtype the graph has for it
            return pytrees.value_bytes(self.value_of(key))
        pack = packs[int(key.name[1:])]
        if key.kind == KeyKind.WEIGHTS:
            names = pack.params + pack.buffers
        elif key.kind == KeyKind.BUFFERS:
            names = pack.mutated_buffers
        elif key.kind == KeyKind.WGRAD:
            # summed over microbatches, and copied, in the masters' dtype (see Runtime._backward)
            names = tuple(name for name in pack.params if self.masters[name].requires_grad)
            return sum(pytrees.value_bytes(self.masters[name]) for name in names)
        else:
            raise AssertionError(f"{key} is never copied")
        return sum(self.staged_bytes(name) for name in names)

    def staged_bytes(self, name: str) -> int:
        """Bytes of the master of the placeholder ``name`` as the devices hold it: in the dtype the
        graph has for it (a bf16 copy of an fp32 weight; a constant the model makes keeps its own)."""
        master = self.masters[name]
        if self.compute_dtype is None:
            return pytrees.value_bytes(master)
        return master.numel() * self.variants[self.mb_sizes[0]].nodes[name].meta[meta.VAL].dtype.itemsize


def fake_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A FakeTensor (inside a FakeTensorMode) shaped like ``tensor``, on the device packs run on, so
    factory ops retargeted to that device meet tensors of the same device."""
    fake = empty_fake(tensor.shape, tensor.stride(), tensor.dtype, device)
    return fake.requires_grad_(tensor.requires_grad) if differentiable(tensor) else fake
