"""Liveness of every value of a captured graph: where it is defined and where it is last used.

Read-only: writes ``LAST_USE`` (the name of the last node that reads the value, in topological
order; the output node for model outputs; ``None`` for dead values) and ``LIVE_PACKS`` once packs
exist (the range of packs between the value's producer and its last reader: the packs a stashed
value spans). Lowering keeps a value on the device only while the next pack reads it; these
annotations are what a person reads to see why a value crosses the host.
"""
from __future__ import annotations

from torch import fx

from harmony_fx.ir import meta

__all__ = ["annotate_liveness"]


def annotate_liveness(gm: fx.GraphModule) -> fx.GraphModule:
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        last = max(node.users, key=order.__getitem__, default=None)
        node.meta[meta.LAST_USE] = None if last is None else last.name
        if meta.PACK in node.meta or meta.role_of(node) == meta.Role.INPUT:
            reader_packs = [user.meta[meta.PACK] for user in node.users if meta.PACK in user.meta]
            if reader_packs:
                first = node.meta.get(meta.PACK, -1)
                node.meta[meta.LIVE_PACKS] = (first, max(reader_packs))
    return gm
