"""Cutting a batch into microbatches and putting the results back together.

Sizes need not divide evenly: a batch of 10 in 4 microbatches is ``[3, 3, 2, 2]`` (as
``torch.tensor_split``). Each top-level input of ``forward`` is split along its batch dim
(``batch_dims``: one int for all, or ``{argument name: dim or None}``; ``None`` passes the input
whole to every microbatch, e.g. a mask shared by the batch; a 0-dim tensor always goes whole).

A scalar output (the loss a Hugging Face model returns) has no batch dim to concatenate along.
``analysis.reductions.scalar_reduction`` reads from the graph how the model reduced it, and
``scalar_weights`` turns that into one coefficient per microbatch, so that the batch's value is
``sum(coefficient * microbatch value)`` exactly as eager computes it on the whole batch (the
rules are ``analysis.reductions``'); ``merge_scalars`` adds them up.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from harmony_fx.analysis.reductions import Combine, ScalarReduction

__all__ = ["microbatch_sizes", "refuse_inputs_not_taken_apart", "argument_dims", "batch_size", "split_call", "merge",
           "scalar_weights", "merge_scalars"]



def microbatch_sizes(batch: int, num: int) -> list[int]:
    if num > batch:
        raise ValueError(f"cannot cut a batch of {batch} into {num} microbatches: use at most {batch} microbatches")
    return [batch // num + (1 if i < batch % num else 0) for i in range(num)]


def refuse_inputs_not_taken_apart(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Inputs the capture cannot take apart into dense tensors, refused naming their argument: a
    nested tensor (``torch.nested``: capturing runs the forward on FakeTensors, which its fake copy
    fails, in an assertion of torch's that read as the model's own error; and no dim of it cuts its
    samples into microbatches), and a container pytree does not know (a ``UserDict`` as
    transformers' ``BatchEncoding``, a ``dict`` or ``list`` subclass its constructor does not rebuild
    from its items, ``capture.register_containers``: one opaque leaf, which export refuses and no
    microbatch cuts)."""
    call = (args, kwargs)
    for path, leaf in pytree.tree_flatten_with_path(call)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_nested:
            raise ValueError(
                f"the input {_argument_name(path, call, model)!r} is a nested tensor (torch.nested, "
                f"layout={leaf.layout}): harmony_fx captures and cuts dense tensors only. Pass the padded batch "
                "instead (x.to_padded_tensor(0.0), with the lengths or a mask), and mask the padding where it "
                "matters (attention's mask, the loss).")
        if isinstance(leaf, (Mapping, list, tuple)):
            raise ValueError(
                f"the input {_argument_name(path, call, model)!r} is a {type(leaf).__qualname__}, a container "
                "torch's pytree does not know, so its tensors cannot be captured or cut into microbatches: pass them "
                "as keyword arguments (model(**batch)) or in a plain dict or list (dict(batch)), or register the "
                "type with torch.utils._pytree.register_pytree_node.")


def argument_dims(model: nn.Module, args: tuple, kwargs: dict, batch_dims: int | dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor replaced by its batch dim (``None``: not split). A 0-dim
    tensor (a scalar) has no batch dim: every microbatch gets it whole."""
    if isinstance(batch_dims, int):
        return pytree.tree_map(lambda x: _batch_dim(x, batch_dims) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs).arguments
    # the keywords a ``**kwargs`` takes are named by their own names (or, as a whole, by its name:
    # the Trainer's LossModel passes {"args": ..., "kwargs": {...}})
    var_keyword = next((name for name, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    taken = dict(bound.get(var_keyword, {}))
    unknown = set(batch_dims) - set(bound) - set(taken)
    if unknown:
        named = [name for name in bound if name != var_keyword] + list(taken)
        raise ValueError(f"batch_dims names {sorted(unknown)}, which are not arguments of this call; "
                         f"the arguments are {named}")
    dims_by_name = {name: _dims_like(value, batch_dims.get(name, 0)) for name, value in bound.items()
                    if name != var_keyword}
    if var_keyword in bound:
        each = {key: batch_dims.get(key, 0) for key in taken}
        dims_by_name.update(_dims_like(taken, batch_dims.get(var_keyword, each)))
    positional = tuple(dims_by_name[name] for name in list(bound)[: len(args)])
    keyword = {name: dims_by_name[name] for name in kwargs}
    return positional, keyword


def _dims_like(value: Any, dim: Any) -> Any:
    """``value`` with each tensor replaced by its dim; ``dim`` is one dim for the whole value, or a
    tuple/list with one entry per element of a tuple/list value (e.g. ``*args``)."""
    if isinstance(dim, (tuple, list)) and isinstance(value, (tuple, list)) and len(dim) == len(value):
        return type(value)(_dims_like(item, item_dim) for item, item_dim in zip(value, dim))
    if isinstance(dim, dict) and isinstance(value, dict):
        return {key: _dims_like(item, dim.get(key, 0)) for key, item in value.items()}
    return pytree.tree_map(lambda x: _batch_dim(x, dim) if isinstance(x, torch.Tensor) else x, value)


def _batch_dim(tensor: torch.Tensor, dim: int | None) -> int | None:
    if dim is None or tensor.dim() == 0:
        return None
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"batch_dims says dim {dim} of an input of shape {tuple(tensor.shape)}, which has no such "
                         "dim; give None for an input every microbatch shares whole.")
    return dim % tensor.dim()


class BatchSizesDisagree(ValueError):
    """The inputs cut into microbatches disagree on the batch size; ``finding``: what disagrees,
    without the advice (a batch the planner keeps whole is explained by it)."""

    def __init__(self, finding: str, message: str) -> None:
        super().__init__(message)
        self.finding = finding


def batch_size(call: tuple[tuple, dict], dims: tuple[tuple, dict], model: nn.Module | None = None) -> int:
    """The size of the inputs along their batch dims; where they disagree, a ``ValueError`` naming
    each input's (by the argument ``model.forward`` binds it to, where ``model`` is given)."""
    leaves, _ = pytree.tree_flatten_with_path(call)
    found = [(path, x.shape[d], d, _holds_indices(x)) for (path, x), d in zip(leaves, pytree.tree_leaves(dims))
             if isinstance(x, torch.Tensor) and isinstance(d, int)]
    if not found:
        raise ValueError("no input is cut along a batch dim (batch_dims gives None for every one), so there is "
                         "nothing to cut into microbatches: pass microbatches=1, or None (the planner keeps a batch "
                         "it cannot cut whole).")
    sizes = {size for _, size, _, _ in found}
    if len(sizes) != 1:
        named = [(_argument_name(path, call, model), size, dim, indices) for path, size, dim, indices in found]
        # the size most inputs have, the first input's where tied
        most = max((s for _, s, _, _ in named), key=lambda size: sum(s == size for _, s, _, _ in named))
        listed = ", ".join(f"{name} has {size} along dim {dim}" for name, size, dim, _ in dict.fromkeys(named))
        # an integer input of another size holds indices (a graph's edge_index, offsets): shared whole,
        # each microbatch would index the whole batch, so it is no example of what to share
        shared = ", ".join(dict.fromkeys(f"{name!r}: None" for name, size, _, indices in named
                                         if size != most and not indices))
        example = f": e.g. batch_dims={{{shared}}}" if shared else ""
        finding = f"the inputs split into microbatches disagree on the batch size: {listed}"
        raise BatchSizesDisagree(finding, (
            f"{finding}. Where the batch is not a dim of each input (a graph batch's edge_index, EmbeddingBag "
            "offsets, a list of samples), no dim cuts it: pass microbatches=None (the planner keeps such a batch "
            "whole) or 1. Otherwise say which dim of each input is the batch with batch_dims, None for an input every "
            f"microbatch shares whole (a [time, time] mask, a bias){example}."))
    return sizes.pop()


def _holds_indices(x: torch.Tensor) -> bool:
    return not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool


def _argument_name(path: tuple, call: tuple[tuple, dict], model: nn.Module | None) -> str:
    """The argument a leaf of ``(args, kwargs)`` at ``path`` belongs to: its keyword, or the
    positional parameter of ``model.forward`` it binds to (else ``args[i]``)."""
    where, index = path[0].idx, path[1]
    if where == 1:
        return index.key
    if model is not None:
        try:
            names = list(inspect.signature(model.forward).bind(*call[0], **call[1]).arguments)
            return names[index.idx]
        except (TypeError, ValueError, IndexError):
            pass
    return f"args[{index.idx}]"


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


# ------------------------------------------------------------------------------ scalar outputs

def scalar_weights(reductions: Sequence[ScalarReduction], inputs: Sequence[Mapping[str, torch.Tensor]],
                   sizes: Sequence[int | None], total: Callable[[float], float] | None = None,
                   whole: ScalarReduction | None = None) -> list[float]:
    """One coefficient per microbatch (``reductions[i]``, ``inputs[i]`` and ``sizes[i]`` are
    microbatch i's): the batch's value is ``sum(coefficient_i * value_i)``, and so microbatch i's
    gradient is the batch's times ``coefficient_i``. ``total(local)``: the normaliser of the whole
    batch when these microbatches are only part of it (other processes hold the rest). ``whole``:
    the same output's reduction in the whole batch's graph, whose numbers (``loss.sum() / x.numel()``,
    ``0.5 * kl``) say exactly what each microbatch's would have been at the batch's size."""
    for reduction in reductions:
        if reduction.combine is None:
            raise ValueError(reduction.why)
    if whole is not None and total is not None:
        whole = None  # the whole batch spans processes: no graph holds its numbers
    total = total or (lambda local: local)
    first = reductions[0]
    if first.combine != Combine.LINEAR:
        return _term_weights(reductions, inputs, sizes, total, whole)[0]
    if any(reduction.combine != Combine.LINEAR or len(reduction.terms) != len(first.terms)
           for reduction in (*reductions, *([whole] if whole is not None else []))):
        raise ValueError(f"the loss {first.node!r} is made of other terms at different microbatch sizes (the graphs "
                         "differ); use microbatches that cut the batch into equal sizes, or microbatches=1.")
    # a_i = sum_t c_t * term_t(microbatch i), and the batch's term_t = sum_i w_ti * term_t(microbatch i):
    # the batch's value is sum_i w_i * a_i exactly when w_ti = w_i for every term t
    per_term = [_term_weights([reduction.terms[t] for reduction in reductions], inputs, sizes, total,
                              whole.terms[t] if whole is not None else None)
                for t in range(len(first.terms))]
    weights, normalised = per_term[0]
    for t, (other, _) in enumerate(per_term[1:], 1):
        if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(weights, other)):
            raise ValueError(
                f"the loss {first.node!r} adds {first.terms[0].node!r} and {first.terms[t].node!r}, which these "
                f"microbatches weigh differently ({_rounded(weights)} and {_rounded(other)}: a mean weighs each by its "
                "share of the items it is over, a sum by 1), so one weight per microbatch cannot put it back "
                "together; reduce the terms the same way over the same items, or use microbatches=1.")
    if first.shared and not normalised:
        raise ValueError(f"the loss {first.node!r} adds a value computed without the batch to sums over the batch: "
                         "each microbatch computes that value whole and the sums add them up; divide the sums by "
                         "the batch size, or use microbatches=1.")
    return weights


def _term_weights(reductions: Sequence[ScalarReduction], inputs: Sequence[Mapping[str, torch.Tensor]],
                  sizes: Sequence[int | None], total: Callable[[float], float],
                  whole: ScalarReduction | None) -> tuple[list[float], bool]:
    """The weights of one mean or sum, and whether they are shares of the batch (adding up to 1
    over the whole batch) rather than 1 each."""
    if whole is not None and any(reduction.combine != whole.combine for reduction in reductions):
        raise ValueError(f"the loss {whole.node!r} reduces the batch otherwise in the whole batch's graph than in "
                         "the microbatches' (the graphs differ at these sizes); use microbatches=1.")
    if whole is not None:
        # term_i = m(b_i) * r_i and the batch's term = m(B) * r, where r = sum_i share_i * r_i (a
        # sum's shares are 1): microbatch i weighs m(B) / m(b_i) times its share, whatever m is
        shares = [1.0] * len(reductions) if whole.combine == Combine.SUM else _shares(reductions, inputs, total)
        weights = [share * whole.multiplier / reduction.multiplier for share, reduction in zip(shares, reductions)]
        return weights, math.isclose(sum(weights), 1.0, rel_tol=1e-9)
    if reductions[0].combine == Combine.SUM:
        divisors = [reduction.divisor for reduction in reductions]
        if divisors[0] is not None and (len(set(divisors)) > 1 or divisors == [size and float(size) for size in sizes]):
            whole_divisor = total(sum(divisors))
            return [divisor / whole_divisor for divisor in divisors], True  # a sum over the batch / its size
        scales = [reduction.scale for reduction in reductions]
        if scales[0] is not None and len(set(scales)) > 1 and all(
                size and math.isclose(scale * size, 1.0, rel_tol=1e-6) for scale, size in zip(scales, sizes)):
            whole_size = total(sum(sizes))
            return [size / whole_size for size in sizes], True  # a sum over the batch times one over its size
        return [1.0] * len(reductions), False
    return _shares(reductions, inputs, total), True


def _shares(reductions: Sequence[ScalarReduction], inputs: Sequence[Mapping[str, torch.Tensor]],
            total: Callable[[float], float]) -> list[float]:
    """Each microbatch's share of a mean: its count over the whole batch's (NaN where nothing counts)."""
    counts = [reduction.count(mb_inputs) for reduction, mb_inputs in zip(reductions, inputs)]
    whole = total(sum(counts))
    return [count / whole if whole else float("nan") for count in counts]


def _rounded(weights: Sequence[float]) -> str:
    return "[" + ", ".join(f"{w:.3g}" for w in weights) + "]"


def merge_scalars(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum(w * v)``, leaving out microbatches of weight 0: their mean is over nothing (NaN), and
    eager's mean over the whole batch never sees them."""
    return torch.stack([value * weight for value, weight in zip(values, weights) if weight != 0]).sum(0)
