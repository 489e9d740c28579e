"""Which values an op writes into, and whose memory a view shares: what in-place ops touch.

Read-only helpers over a captured graph. ATen ops say it in their schema (``Tensor(a!)`` for an
argument written in place, ``Tensor(a)`` for a result that aliases its first argument); the
``torch.fx.symbolic_trace`` path records in-place methods by their trailing underscore.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from harmony_fx.ir import meta

__all__ = ["written_arguments", "aliased", "alias_chain", "alias_base"]

# ops whose schema promises a new tensor but which return their first argument itself where it has
# the result's dtype and device already (``x.type_as(y)`` is ``x.to(y)``): an in-place op on the
# result writes into the argument (torchtune's Gemma 2: ``q = rope(q).type_as(x); q.mul_(scaling)``)
_SELF_WHEN_SAME_TYPE = frozenset({torch.ops.aten.type_as.default})


def written_arguments(node: fx.Node) -> list[fx.Node]:
    """The arguments ``node`` writes into: ATen's ``Tensor(a!)`` arguments (export), or the object of
    an in-place method such as ``add_`` (symbolic trace)."""
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("__"):
        return [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    written = []
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, fx.Node):
                written.append(value)
    return written


def aliased(node: fx.Node) -> fx.Node | None:
    """The node whose memory ``node`` shares directly: a view's or an in-place op's first argument,
    the list an item of ``split``'s views comes from; None for any other node."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is operator.getitem:  # an item of a list of views
        return node.args[0] if aliased(node.args[0]) is not None else None
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target in _SELF_WHEN_SAME_TYPE:
        value, source = node.meta.get(meta.VAL), node.args[0].meta.get(meta.VAL)
        same = (isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor)
                and (value.dtype, value.device) == (source.dtype, source.device))
        return node.args[0] if same else None
    returns = node.target._schema.returns
    return node.args[0] if returns and returns[0].alias_info is not None else None


def alias_chain(node: fx.Node) -> list[fx.Node]:
    """``node``, the node whose memory it shares, ..., the node that owns that memory."""
    chain = [node]
    while (source := aliased(chain[-1])) is not None:
        chain.append(source)
    return chain


def alias_base(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` shares, through views (``select``, ``view``, an item of
    ``split``'s list, ...) and the results of in-place ops."""
    return alias_chain(node)[-1]
