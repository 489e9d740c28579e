"""The model captured at each microbatch size, annotated and cut into layers.

Export bakes sizes into reshapes, so a batch of 10 in 4 microbatches (3, 3, 2, 2) is captured at
sizes 3 and 2; every variant must have the same layers (the packs of every size share their
boundaries and names). ``None`` is the whole batch (one microbatch).
"""
from __future__ import annotations

import dataclasses

from torch import fx, nn

from harmony_fx.analysis.requires_grad import annotate_requires_grad
from harmony_fx.analysis.sizes import annotate_sizes
from harmony_fx.frontend.capture import Captured, capture
from harmony_fx.passes.find_layers import Layer, find_layers
from harmony_fx.passes.retarget_device import retarget_device

__all__ = ["Variant", "capture_variant", "check_same_layers"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """The model captured at one microbatch size."""

    size: int | None
    captured: Captured
    layers: tuple[Layer, ...]
    nodes: dict[str, fx.Node]

    @property
    def masters(self) -> dict[str, object]:
        """Placeholder name -> the model's own parameter or buffer."""
        return {**self.captured.params, **self.captured.buffers}


def capture_variant(model: nn.Module, size: int | None, args: tuple, kwargs: dict, target) -> Variant:
    """Capture ``model(*args, **kwargs)`` (a microbatch of ``size`` samples) for the device
    ``target`` (a ``torch.device``): sizes, requires-grad flags and layers annotated."""
    captured = capture(model, args, kwargs)
    retarget_device(captured.gm, target)
    annotate_sizes(captured.gm)
    flags = {name: x.requires_grad for name, x in zip(captured.inputs, captured.flatten_inputs(args, kwargs))}
    flags.update({name: param.requires_grad for name, param in captured.params.items()})
    annotate_requires_grad(captured.gm, flags)
    layers = tuple(find_layers(captured.gm))
    return Variant(size, captured, layers, {node.name: node for node in captured.gm.graph.nodes})


def check_same_layers(variants: dict[int | None, Variant], num_microbatches: int) -> None:
    first, *others = variants.values()
    for variant in others:
        if [layer.nodes for layer in variant.layers] != [layer.nodes for layer in first.layers]:
            raise ValueError(f"the model's graph at microbatch size {variant.size} differs from the graph at size "
                             f"{first.size}; use a batch size divisible by microbatches={num_microbatches}.")
