"""The model and its loss as one module, a batch as that module's call, and how the microbatches'
losses add up to the batch's.

The loss is part of the compiled graph (``loss_fn(model(*inputs), target)``), so the last pack runs
forward, loss and backward as one task per microbatch without its weights leaving the device.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch
from torch import nn

from harmony_fx.program.actions import Key, KeyKind
from harmony_fx.training.python_values import python_values

__all__ = ["LossModel", "loss_of", "as_call"]


class LossModel(nn.Module):
    """``model`` and its loss as one module, so both are captured in one graph.

    ``takes_target``: ``forward(*inputs, target, **keyword_inputs)`` returns ``loss_fn(output,
    target)``; otherwise ``forward(*inputs, **keyword_inputs)`` returns ``loss_fn(output)``, or with
    no ``loss_fn`` the loss the model returns (see ``loss_of``)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.takes_target = _takes_target(loss_fn)

    def _harmony_guarded_values(self) -> tuple:
        """The loss function's plain Python values, read at every call (``frontend.guards``): a graph
        captured with one aux-loss weight must not run with the next."""
        return python_values(self.loss_fn)

    def forward(self, *args, **kwargs):
        if self.takes_target:
            *inputs, target = args
            return self.loss_fn(self.model(*inputs, **kwargs), target)
        output = self.model(*args, **kwargs)
        return loss_of(output) if self.loss_fn is None else self.loss_fn(output)

    def call_of(self, batch: Any) -> tuple[tuple, dict]:
        """This module's ``(args, kwargs)`` for ``batch`` (the forms of ``Trainer``'s docstring)."""
        if self.takes_target:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise ValueError("with a two-argument loss_fn(output, target), a batch is (inputs, target): inputs a "
                                 "tensor, a tuple of positional inputs or a dict of keyword inputs. For a model that "
                                 "returns its own loss, pass loss_fn=None and the batch alone.")
            inputs, target = batch
            args, kwargs = as_call(inputs)
            return (*args, target), kwargs
        return as_call(batch)

    def batch_dims(self, dims: dict[str, int], args: tuple, kwargs: dict) -> dict:
        """``batch_dims`` named by the model's own arguments, for this module's ``*args, **kwargs``
        (the target is cut along dim 0)."""
        names = list(inspect.signature(self.model.forward).parameters)
        positional = len(args) - self.takes_target
        args_dims = tuple(dims.get(name, 0) for name in names[:positional]) + (0,) * self.takes_target
        ours: dict = {"args": args_dims} if args else {}
        if kwargs:
            ours["kwargs"] = {name: dims.get(name, 0) for name in kwargs}
        return ours


def loss_of(output: Any) -> torch.Tensor:
    """The loss a model returns: the output itself, its ``.loss`` (Hugging Face), its ``"loss"``, or
    the first item of a tuple that is a number (a Hugging Face model with ``return_dict=False``,
    as transformers' Trainer takes it)."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
        loss = output[0]
    else:
        raise ValueError(
            f"loss_fn=None means the model returns its loss, but it returned a {type(output).__name__}; name the "
            "loss with a one-argument loss_fn (e.g. loss_fn=lambda out: out[1] for nanoGPT's (logits, loss)), "
            "or pass labels so that a Hugging Face model computes .loss.")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"the loss must be a scalar tensor, got {type(loss).__name__} of shape "
                         f"{tuple(getattr(loss, 'shape', ()))}; reduce it (e.g. .mean()) in the model or in loss_fn.")
    return loss


def _takes_target(loss_fn: Callable | None) -> bool:
    """Whether ``loss_fn`` is the two-argument ``(output, target)`` form (the one-argument form
    gets the output alone). A callable whose signature says nothing is taken as two-argument."""
    if loss_fn is None:
        return False
    function = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return True
    required = [p for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) != 1


def as_call(inputs: Any) -> tuple[tuple, dict]:
    """A model's ``(args, kwargs)`` from a dict of keyword inputs, a tuple/list of positional ones, or
    one tensor."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


class BatchLoss:
    """How one batch's microbatch losses make the batch's loss, as eager computes it on the whole
    batch: weights from the graph (a mean over labelled tokens, over elements, a sum) where it says
    how the loss reduces, else by microbatch size (``reduction="mean"``) or all 1 (``"sum"``);
    across processes, over every rank's batch (``total`` sums a number over the ranks); or
    ``weights``, the caller's, one per microbatch; each weight times ``scale``."""

    def __init__(self, hm, per_mb: Sequence[Sequence[torch.Tensor]], reduction: str,
                 total: Callable[[float], float] | None, scale: float = 1.0,
                 weights: Sequence[float] | None = None) -> None:
        (self.name,) = hm.signature.model_outputs
        self.microbatches = len(per_mb)
        if weights is None:
            weights = hm.scalar_weights(self.name, per_mb, otherwise=lambda: _size_weights(hm, reduction, total),
                                        total=total)
        self.weights = [scale * weight for weight in weights]
        like = hm.output_like(self.name)
        # the gradient each microbatch's loss starts its backward from: its weight
        self.output_grads = {Key(KeyKind.GRAD, self.name, mb): torch.full(like.shape, w, dtype=like.dtype)
                             for mb, w in enumerate(self.weights)}

    def shares(self, host_values: dict) -> list[torch.Tensor]:
        """Each microbatch's weighted loss, read from what the iteration left on the host. A
        microbatch of weight 0 shares 0: its mean is over nothing (every label ignored: NaN), and
        eager's mean over the whole batch never sees it (``microbatch.merge_scalars`` alike)."""
        losses = {mb: host_values[Key(KeyKind.ACT, self.name, mb)].detach()
                  for mb, w in enumerate(self.weights) if w != 0}
        # fp32 at least (a bf16 loss is summed in fp32); a float64 model's loss stays float64, as eager's
        dtype = functools.reduce(torch.promote_types, [loss.dtype for loss in losses.values()], torch.float32)
        return [w * losses[mb].to(dtype) if w != 0 else torch.zeros((), dtype=dtype)
                for mb, w in enumerate(self.weights)]


def _size_weights(hm, reduction: str, total: Callable[[float], float] | None) -> list[float]:
    sizes = [size or 1 for size in hm.mb_sizes]
    if reduction == "sum":
        return [1.0] * len(sizes)
    whole = total(sum(sizes)) if total is not None else sum(sizes)
    return [size / whole for size in sizes]
