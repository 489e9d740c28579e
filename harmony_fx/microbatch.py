"""Cutting a batch into microbatches and putting the results back together.

Sizes need not divide evenly: a batch of 10 in 4 microbatches is ``[3, 3, 2, 2]`` (as
``torch.tensor_split``). Each top-level input of ``forward`` is split along its batch dim
(``batch_dims``: one int for all, or ``{argument name: dim or None}``; ``None`` passes the input
whole to every microbatch, e.g. a mask shared by the batch).
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["microbatch_sizes", "argument_dims", "batch_size", "split_call", "merge"]


def microbatch_sizes(batch: int, num: int) -> list[int]:
    if num > batch:
        raise ValueError(f"cannot cut a batch of {batch} into {num} microbatches: use at most {batch} microbatches")
    return [batch // num + (1 if i < batch % num else 0) for i in range(num)]


def argument_dims(model: nn.Module, args: tuple, kwargs: dict, batch_dims: int | dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor replaced by its batch dim (``None``: not split)."""
    if isinstance(batch_dims, int):
        return pytree.tree_map(lambda x: batch_dims if isinstance(x, torch.Tensor) else x, (args, kwargs))
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    unknown = set(batch_dims) - set(bound.arguments)
    if unknown:
        raise ValueError(f"batch_dims names {sorted(unknown)}, which are not arguments of this call; "
                         f"the arguments are {list(bound.arguments)}")
    dims_by_name = {name: _dims_like(value, batch_dims.get(name, 0)) for name, value in bound.arguments.items()}
    positional = tuple(dims_by_name[name] for name in list(bound.arguments)[: len(args)])
    keyword = {name: dims_by_name[name] for name in kwargs}
    return positional, keyword


def _dims_like(value: Any, dim: Any) -> Any:
    """``value`` with each tensor replaced by its dim; ``dim`` is one dim for the whole value, or a
    tuple/list with one entry per element of a tuple/list value (e.g. ``*args``)."""
    if isinstance(dim, (tuple, list)) and isinstance(value, (tuple, list)) and len(dim) == len(value):
        return type(value)(_dims_like(item, item_dim) for item, item_dim in zip(value, dim))
    return pytree.tree_map(lambda x: dim if isinstance(x, torch.Tensor) else x, value)


def batch_size(call: tuple[tuple, dict], dims: tuple[tuple, dict]) -> int:
    sizes = {x.shape[d] for x, d in zip(pytree.tree_leaves(call), pytree.tree_leaves(dims))
             if isinstance(x, torch.Tensor) and isinstance(d, int)}
    if len(sizes) != 1:
        raise ValueError(f"the inputs split into microbatches disagree on the batch size: {sorted(sizes)}; "
                         "set batch_dims to say which dim of each input is the batch")
    return sizes.pop()


def split_call(call: tuple[tuple, dict], dims: tuple[tuple, dict], sizes: Sequence[int]) -> list[tuple[tuple, dict]]:
    """One ``(args, kwargs)`` per microbatch."""
    leaves, spec = pytree.tree_flatten(call)
    dim_leaves = pytree.tree_leaves(dims)
    per_leaf = []
    for leaf, dim in zip(leaves, dim_leaves):
        if isinstance(leaf, torch.Tensor) and isinstance(dim, int):
            per_leaf.append(torch.split(leaf, list(sizes), dim=dim) if len(sizes) > 1 else (leaf,))
            if len(sizes) > 1 and not leaf.requires_grad:
                # own storage, so capture sees a plain input rather than a view into the batch
                per_leaf[-1] = tuple(chunk.clone() for chunk in per_leaf[-1])
        else:
            per_leaf.append((leaf,) * len(sizes))
    return [pytree.tree_unflatten([chunks[mb] for chunks in per_leaf], spec) for mb in range(len(sizes))]


def merge(chunks: Sequence[Any], dim: int | None) -> Any:
    """Inverse of the split for one value: concatenate along ``dim``, or sum when it was shared."""
    if len(chunks) == 1:
        return chunks[0]
    if any(chunk is None for chunk in chunks):
        return None
    return torch.cat(list(chunks), dim=dim) if dim is not None else torch.stack(list(chunks)).sum(0)
