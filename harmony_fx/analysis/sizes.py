"""Annotate every node of a captured graph with its bytes, FLOPs and the state it reads.

Read-only: writes ``NBYTES``, ``FLOPS`` and ``READS`` (see ``ir.meta``) and changes nothing else.
FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` run on the node's FakeTensor inputs,
so no real compute happens, and only for ATen ops (``OpOverload``), which cannot change Python's
global state. A higher-order op (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``, ...) is
never called: it would set grad mode or autocast around its subgraph, and torch's wrappers do not
restore them if the call fails. Its FLOPs are those of the subgraphs it runs, counted node by node.
An op called alike again (the same shapes, strides, dtypes and constants: a transformer's blocks)
takes the FLOPs counted the first time.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from harmony_fx.ir import meta
from harmony_fx.ir.values import value_bytes

__all__ = ["annotate_sizes"]


def annotate_sizes(gm: fx.GraphModule) -> fx.GraphModule:
    state = {n.name for n in gm.graph.find_nodes(op="placeholder") if meta.role_of(n) in (meta.Role.PARAM, meta.Role.BUFFER)}
    counted: dict[str, int] = {}  # an op's FLOPs by its call (a transformer's blocks repeat theirs)
    for node in gm.graph.nodes:
        node.meta[meta.NBYTES] = value_bytes(node.meta.get(meta.VAL))
        node.meta[meta.READS] = tuple(arg.name for arg in node.all_input_nodes if arg.name in state)
        node.meta[meta.FLOPS] = _flops(node, gm, counted) if node.op == "call_function" else 0
    return gm


def _flops(node: fx.Node, gm: fx.GraphModule, counted: dict[str, int]) -> int:
    if isinstance(node.target, torch._ops.OpOverload):
        if not _may_count(node.target):
            return 0
        # what FLOPs depend on: the op, its arguments' shapes, strides and dtypes, its constants
        call = repr((str(node.target), tree_map(_layout_or_const, (node.args, node.kwargs))))
        if call not in counted:
            counted[call] = _op_flops(node)
        return counted[call]
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return sum(_flops(inner, sub, counted) for sub in _subgraphs(node, gm) for inner in sub.graph.nodes
                   if inner.op == "call_function")
    return 0  # getitem, Python functions: no compute we can count


def _subgraphs(node: fx.Node, gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The graph modules a higher-order op's ``get_attr`` arguments name."""
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            sub = getattr(gm, str(arg.target), None)
            if isinstance(sub, fx.GraphModule):
                found.append(sub)
    return found


def _op_flops(node: fx.Node) -> int:
    args, kwargs = tree_map(_val_or_const, (node.args, node.kwargs))
    fake_mode = _fake_mode_of(node)
    if fake_mode is None:
        return 0
    counter = FlopCounterMode(display=False)
    try:
        with fake_mode, counter:
            node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an ATen op the fake mode cannot run (data-dependent output):
        return 0         # no FLOPs we can count, and no global state an ATen op could have changed
    return counter.get_total_flops()


def _may_count(op: torch._ops.OpOverload) -> bool:
    """Whether ``FlopCounterMode`` can count anything for ``op``: it counts the ops of its registry
    (matmuls, convolutions, attention), also where a composite op (``linear``, ``matmul``)
    decomposes into them. Others (views, elementwise ops, norms' kernels) count none, so they are
    not run: most of a graph's ops, each a FakeTensor dispatch."""
    return (op.overloadpacket in flop_registry
            or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"))


def _layout_or_const(arg: object) -> object:
    if not isinstance(arg, fx.Node):
        return arg
    return tree_map(lambda v: (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v,
                    arg.meta.get(meta.VAL))


def _val_or_const(arg: object) -> object:
    return arg.meta.get(meta.VAL) if isinstance(arg, fx.Node) else arg


def _fake_mode_of(node: fx.Node):
    for arg in node.all_input_nodes:
        val = arg.meta.get(meta.VAL)
        for leaf in tree_flatten(val)[0]:
            mode = getattr(leaf, "fake_mode", None)
            if mode is not None:
                return mode
    return None
