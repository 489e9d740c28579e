"""Which values of a captured graph require grad, leaf by leaf, exactly as in eager.

1. Every placeholder requires grad as its tensor does (``placeholder_requires_grad``): the model's
   parameters as they are, the example inputs as the caller made them, buffers not.
2. The graph runs once on its FakeTensors with autograd on (node by node, here: ``fx.Interpreter``
   would start a progress-bar thread), so autograd itself decides for every node, as eager would: a ``detach``, a ``no_grad`` region, an integer result, an argument an op
   is not differentiable for (``soft_margin_loss``'s target) all come out as they do in eager.
3. ``REQUIRES_GRAD`` on each node: a tuple with one bool per leaf of its value (see
   ``ir.values.leaves``); ``False`` for non-tensor leaves.

The runtime makes a pack's inputs require grad where these flags say so, and no more: a recompute
then builds the graph eager built, and never asks for a gradient eager cannot give.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import fx
from torch._guards import detect_fake_mode

from harmony_fx.ir import meta
from harmony_fx.ir.values import leaves, map_tensors

__all__ = ["annotate_requires_grad", "requires_grad_of", "any_requires_grad", "run_node"]


def annotate_requires_grad(gm: fx.GraphModule, placeholder_requires_grad: Mapping[str, bool]) -> fx.GraphModule:
    """``placeholder_requires_grad``: placeholder name -> whether its tensor requires grad (absent:
    it does not)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    values = [node.meta.get(meta.VAL) for node in placeholders]
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    with fake_mode or contextlib.nullcontext(), torch.enable_grad():
        # fresh fakes: the graph's own values must not take part in (or keep) an autograd graph
        env = {node: map_tensors(lambda t: _fresh(t, placeholder_requires_grad.get(node.name, False)), value)
               for node, value in zip(placeholders, values)}
        for node in placeholders:
            _record(node, env[node])
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            result = env[node] = run_node(gm, node, args, kwargs)
            _record(node, result)
    return gm


def run_node(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict) -> object:
    """What ``node`` of ``gm`` computes from ``args`` and ``kwargs`` (its own, with values in place
    of the nodes it reads), as fx's interpreter would, without the interpreter."""
    if node.op == "get_attr":
        return getattr(gm, node.target)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def requires_grad_of(node: fx.Node) -> tuple[bool, ...]:
    return node.meta.get(meta.REQUIRES_GRAD, ())


def any_requires_grad(node: fx.Node) -> bool:
    return any(requires_grad_of(node))


def _fresh(value: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return copy.requires_grad_(requires_grad and (value.is_floating_point() or value.is_complex()))


def _record(node: fx.Node, result: object) -> None:
    node.meta[meta.REQUIRES_GRAD] = tuple(isinstance(leaf, torch.Tensor) and leaf.requires_grad
                                          for leaf in leaves(result))
