"""Point factory ops at the device packs run on.

Capture runs on the host, so ops that create tensors (``aten.arange``, ``aten.zeros``, ...) carry
``device=cpu`` in their kwargs. On a ``CudaDevice`` those would make host tensors in the middle of a
pack; this pass rewrites every ``device`` kwarg equal to the capture device to the target device.
A HostDevice needs nothing (it is the host).
"""
from __future__ import annotations

import torch
from torch import fx

__all__ = ["retarget_device"]


def retarget_device(gm: fx.GraphModule, target: torch.device) -> bool:
    """Returns whether the graph changed."""
    changed = False
    for node in gm.graph.nodes:
        device = node.kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu" and target.type != "cpu":
            node.kwargs = {**node.kwargs, "device": target}
            changed = True
    if changed:
        gm.recompile()
    return changed
