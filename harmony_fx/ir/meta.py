"""Every per-node fact harmony_fx keeps lives in ``node.meta`` under one of these keys.

This module is the only place the keys are spelled. Capture and analysis write them on the
captured graph (the model's graph of ATen or torch calls); codegen writes the program keys on
the nodes of the generated program.

=========================  ==============================  ===========================================
key                        written by                      value
=========================  ==============================  ===========================================
``val``                    capture (PyTorch's own key)     FakeTensor (or a Python scalar) of the value
``nn_module_stack``        capture (PyTorch's own key)     the modules the node ran in, outermost first:
                                                           path -> (dotted path, module type)
``harmony_role``           capture                         :class:`Role` of a placeholder
``harmony_target``         capture                         for params/buffers: their dotted name
``harmony_bounded``        passes.bound_sizes              True where ``val`` is the largest a size that
                                                           depends on the values can be (``x[mask]``)
``harmony_nbytes``         analysis.sizes                  bytes of the value (0 for non-tensors)
``harmony_flops``          analysis.sizes                  forward FLOPs of the op (flop_counter)
``harmony_reads``          analysis.sizes                  names of the param/buffer placeholders the
                                                           node reads directly
``harmony_requires_grad``  analysis.requires_grad          one bool per leaf of the value: requires grad
                                                           (as in eager)
``harmony_last_use``       analysis.liveness               name of the last node reading the value (or None)
``harmony_live_packs``     analysis.liveness               (producer pack, last reading pack); -1 = model input
``harmony_layer``          passes.find_layers              index of the layer the node belongs to
``harmony_layer_name``     passes.find_layers              e.g. ``"h.3"`` or the node's own name
``harmony_pack``           passes.split_packs              index of the pack the node belongs to (the
                                                           packing chosen: annotate_packs)
``harmony_action``         program.codegen                 the ``Action`` a program node runs
``harmony_step``           program.codegen                 the comment codegen prints above a step
``harmony_created_by``     program.codegen                 the pass that created the node's action
=========================  ==============================  ===========================================
"""
from __future__ import annotations

import enum
import re

import torch
from torch import fx

__all__ = [
    "VAL", "MODULE_STACK", "ROLE", "TARGET", "BOUNDED", "NBYTES", "FLOPS", "READS", "REQUIRES_GRAD", "LAST_USE", "LIVE_PACKS", "LAYER", "LAYER_NAME", "PACK",
    "ACTION", "STEP", "FROM_PASS", "Role", "role_of", "nbytes_of", "describe", "module_path",
]

VAL = "val"
MODULE_STACK = "nn_module_stack"
ROLE = "harmony_role"
TARGET = "harmony_target"
BOUNDED = "harmony_bounded"
NBYTES = "harmony_nbytes"
FLOPS = "harmony_flops"
READS = "harmony_reads"
REQUIRES_GRAD = "harmony_requires_grad"
LAST_USE = "harmony_last_use"
LIVE_PACKS = "harmony_live_packs"
LAYER = "harmony_layer"
LAYER_NAME = "harmony_layer_name"
PACK = "harmony_pack"
ACTION = "harmony_action"
STEP = "harmony_step"
FROM_PASS = "harmony_created_by"  # not torch.fx's own "from_node", which means something else


class Role(enum.Enum):
    """What a placeholder of the captured graph stands for."""

    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"


def role_of(node: fx.Node) -> Role | None:
    return node.meta.get(ROLE)


def nbytes_of(node: fx.Node) -> int:
    return node.meta.get(NBYTES, 0)


def describe(node: fx.Node) -> str:
    """``node`` as a message names it to a person: its name (as ``hm.code`` and the graphs print
    it), its op and the module it ran in, e.g. ``batch_norm: aten.batch_norm in module
    resnet.embedder.normalization (a BatchNorm2d)``; not fx's own node syntax."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return node.name
    target = node.target
    op = str(target).removesuffix(".default") if isinstance(target, torch._ops.OpOverload) else (
        getattr(target, "__name__", None) or str(target))
    stack = list((node.meta.get(MODULE_STACK) or {}).values())
    if not stack:
        return f"{node.name}: {op}"
    path, kind = stack[-1]
    kind = (kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))).rsplit(".", 1)[-1]
    path = module_path(path)
    return f"{node.name}: {op} in module {path} (a {kind})" if path else f"{node.name}: {op} in the model's forward ({kind})"


def module_path(path: str) -> str:
    """A module's path as ``nn_module_stack`` spells it, in export's spelling: ``L['self'].h[3]``
    (Dynamo's) and ``h.3`` (export's) are both ``h.3``."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")
