"""The model captured at each microbatch size, annotated and cut into layers.

Export bakes sizes into reshapes, so a batch of 10 in 4 microbatches (3, 3, 2, 2) is captured at
sizes 3 and 2; every variant must have the same layers (the packs of every size share their
boundaries and names). ``None`` is the whole batch (one microbatch). Export may also capture other
ops at another size (a ``contiguous`` on a size-1 dim is a no-op it drops); ``check_same_layers``
then says which microbatches capture one size only, and ``compile`` falls back from a planner's
choice that meets it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import fx, nn

from harmony_fx.analysis.requires_grad import annotate_requires_grad
from harmony_fx.analysis.sizes import annotate_sizes
from harmony_fx.frontend.capture import Captured, capture
from harmony_fx.passes.find_layers import Layer, find_layers
from harmony_fx.passes.retarget_device import retarget_device

__all__ = ["Variant", "GraphsDiffer", "capture_variant", "check_same_layers"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """The model captured at one microbatch size."""

    size: int | None
    captured: Captured
    layers: tuple[Layer, ...]
    nodes: dict[str, fx.Node]
    reused: bool = False  # a copy of an earlier compile's capture (``compiler.capture_cache``)

    @property
    def masters(self) -> dict[str, object]:
        """Placeholder name -> the model's own parameter or buffer."""
        return {**self.captured.params, **self.captured.buffers}


def capture_variant(model: nn.Module, size: int | None, args: tuple, kwargs: dict, target,
                    dtype: torch.dtype | None = None) -> Variant:
    """Capture ``model(*args, **kwargs)`` (a microbatch of ``size`` samples) for the device
    ``target`` (a ``torch.device``), computing in ``dtype`` (``None``: the model's own): sizes,
    requires-grad flags and layers annotated."""
    captured = capture(model, args, kwargs, dtype=dtype)
    retarget_device(captured.gm, target)
    annotate_sizes(captured.gm)
    flags = {name: x.requires_grad for name, x in zip(captured.inputs, captured.flatten_inputs(args, kwargs))}
    flags.update({name: param.requires_grad for name, param in captured.params.items()})
    annotate_requires_grad(captured.gm, flags)
    layers = tuple(find_layers(captured.gm))
    if not layers:
        raise ValueError(f"{type(model).__name__} computes nothing (its captured graph has no op): there is "
                         "nothing for harmony_fx to run; call the model eagerly.")
    return Variant(size, captured, layers, {node.name: node for node in captured.gm.graph.nodes})


class GraphsDiffer(ValueError):
    """Two microbatch sizes capture different layers; ``sizes``: the backward's microbatch sizes,
    ``forward``: whether a larger forward microbatch's graph is one of the two."""

    def __init__(self, message: str, sizes: Sequence[int | None], forward: bool) -> None:
        super().__init__(message)
        self.sizes, self.forward = tuple(sizes), forward


def check_same_layers(variants: dict[int | None, Variant], backward_sizes: Sequence[int | None],
                      forward_sizes: Sequence[int] = ()) -> None:
    """Every variant has the first's layers, node for node; else a ``ValueError`` saying where
    they differ and which microbatches to use instead. ``backward_sizes``: the microbatches'
    sizes; ``forward_sizes``: the larger forward microbatches', if any."""
    first, *others = variants.values()
    for variant in others:
        if [layer.nodes for layer in variant.layers] == [layer.nodes for layer in first.layers]:
            continue
        where = next(((a, b) for a, b in zip(first.layers, variant.layers) if a.nodes != b.nodes), None)
        detail = ""
        if where is not None:
            only = sorted(set(where[0].nodes) ^ set(where[1].nodes))
            detail = (f", first in layer {where[0].name!r} (nodes only one of them has: "
                      f"{', '.join(only[:3])}{', ...' if len(only) > 3 else ''})")
        raise GraphsDiffer(
            f"the model's graph at microbatch size {variant.size} differs from the graph at size {first.size}"
            f"{detail}: export specialises some ops on the sizes it sees (a size-1 dim, for one, makes a "
            "`contiguous` a no-op it drops), and the packs of every microbatch size must share their layers. "
            + _same_size_advice(first.size, variant.size, backward_sizes, forward_sizes),
            backward_sizes, bool({first.size, variant.size} & (set(forward_sizes) - set(backward_sizes))))


def _same_size_advice(a: int | None, b: int | None, backward_sizes: Sequence[int | None],
                      forward_sizes: Sequence[int]) -> str:
    """What makes every microbatch one size, for the sizes ``a`` and ``b`` that capture differently."""
    num = len(backward_sizes)
    if {a, b} & (set(forward_sizes) - set(backward_sizes)):
        advice = (f"The forward runs microbatches of {max(forward_sizes)} samples and the backward of "
                  f"{min(s for s in backward_sizes if s)}: give microbatches as one int (e.g. microbatches={num}).")
    else:
        batch = sum(s for s in backward_sizes if s)
        advice = (f"A batch of {batch} in microbatches={num} is cut into sizes "
                  f"{', '.join(map(str, sorted(set(backward_sizes), reverse=True)))}: use a batch size divisible "
                  f"by {num}, or a number of microbatches that divides {batch}.")
    if 1 in (a, b):
        advice += " Microbatches of one sample capture differently most often: prefer at least 2 samples each."
    return advice
