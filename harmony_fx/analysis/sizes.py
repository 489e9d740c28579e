"""Annotate every node of a captured graph with its bytes, FLOPs and the state it reads.

Read-only: writes ``NBYTES``, ``FLOPS`` and ``READS`` (see ``ir.meta``) and changes nothing else.
FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` run on the node's FakeTensor inputs,
so no real compute happens.
"""
from __future__ import annotations

from torch import fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from harmony_fx.ir import meta
from harmony_fx.ir.values import value_bytes

__all__ = ["annotate_sizes"]


def annotate_sizes(gm: fx.GraphModule) -> fx.GraphModule:
    state = {n.name for n in gm.graph.find_nodes(op="placeholder") if meta.role_of(n) in (meta.Role.PARAM, meta.Role.BUFFER)}
    for node in gm.graph.nodes:
        node.meta[meta.NBYTES] = value_bytes(node.meta.get(meta.VAL))
        node.meta[meta.READS] = tuple(arg.name for arg in node.all_input_nodes if arg.name in state)
        node.meta[meta.FLOPS] = _flops(node) if node.op == "call_function" else 0
    return gm


def _flops(node: fx.Node) -> int:
    args, kwargs = tree_map(_val_or_const, (node.args, node.kwargs))
    fake_mode = _fake_mode_of(node)
    if fake_mode is None:
        return 0
    counter = FlopCounterMode(display=False)
    try:
        with fake_mode, counter:
            node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op FlopCounter cannot run costs nothing we can count
        return 0
    return counter.get_total_flops()


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
