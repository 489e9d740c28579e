"""Point factory ops at the device packs run on.

Capture runs on the host, so ops that create tensors (``aten.arange``, ``aten.zeros``, ...) carry
``device=cpu`` in their kwargs. On a ``CudaDevice`` those would make host tensors in the middle of a
pack; ``retarget_device`` rewrites every ``device`` kwarg equal to the capture device to the target
device. With several GPUs each device runs its own copy of the packs, retargeted from the first
device to its own (``packs_on``): a pack running on ``cuda:1`` must not make its masks on ``cuda:0``.
A HostDevice needs nothing (it is the host).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import torch
from torch import fx

from harmony_fx.ir.pack import Pack

__all__ = ["retarget_device", "packs_on"]


def retarget_device(gm: fx.GraphModule, target: torch.device, source: torch.device = torch.device("cpu")) -> bool:
    """Every ``device`` kwarg on ``source`` moves to ``target``; returns whether the graph changed."""
    changed = False
    for node in gm.graph.nodes:
        device = node.kwargs.get("device")
        if device is not None and _same(torch.device(device), source) and not _same(target, source):
            node.kwargs = {**node.kwargs, "device": target}
            changed = True
    if changed:
        gm.recompile()
    return changed


def packs_on(packs: Sequence[Pack], source: torch.device, target: torch.device) -> list[Pack]:
    """``packs`` (whose factory ops make tensors on ``source``) for a device at ``target``: the same
    packs where nothing changes, else copies whose graphs are retargeted."""
    if _same(source, target):
        return list(packs)
    result = []
    for pack in packs:
        gm = copy.deepcopy(pack.gm)
        result.append(dataclasses.replace(pack, gm=gm) if retarget_device(gm, target, source) else pack)
    return result


def _same(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    return (a.index or 0) == (b.index or 0)
