"""Packs compiled by inductor (``compile(..., compile_packs=True)``).

Each pack's graph goes to ``torch.compile``: run without gradients (a forward whose outputs only go
to the stash) it is an inference graph; run with them (the recompute, the last pack's forward) AOT
autograd traces forward and backward as one joint graph and torch's min-cut partitioner decides,
inside the pack, what the backward saves and what it recomputes, while what crosses packs stays
the program's. ``torch.autograd.grad`` in the backward task then runs the compiled backward.

Identical packs (the blocks of a transformer) share one compiled function: packs whose graphs
have the same structure (ops, how they connect, shapes and dtypes; weights are inputs, not
constants) get the first one's ``torch.compile`` wrapper, so Dynamo traces and inductor compiles
it once (``structures`` counts them). Random ops run as eager's kernels (inductor's
``fallback_random``), drawing from the generator the runtime saves and restores, so a recompute
draws the forward's masks, compiled or not.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch
from torch import fx

from harmony_fx.ir import meta
from harmony_fx.ir.pack import Pack

__all__ = ["PackCompiler", "structure_key"]


class PackCompiler:
    def __init__(self) -> None:
        self._by_structure: dict[object, Callable] = {}
        self._by_graph: dict[int, Callable] = {}
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # first calls of each compiled graph (tracing and compiling)
        self.graphs = 0             # distinct (structure, grad mode) graphs compiled

    @property
    def structures(self) -> int:
        """Distinct pack structures compiled (identical packs count once)."""
        return len(self._by_structure)

    def run(self, pack: Pack, inputs: list, grad: bool) -> object:
        function = self._by_graph.get(id(pack.gm))
        if function is None:
            key = structure_key(pack.gm)
            with self._lock:
                function = self._by_structure.get(key)
                if function is None:
                    function = torch.compile(pack.gm, backend="inductor", dynamic=False, fullgraph=True,
                                             options={"fallback_random": True})
                    self._by_structure[key] = function
                self._by_graph[id(pack.gm)] = function
        first = (id(function), grad)
        if first in self._seen:
            return function(*inputs)
        with self._lock:  # Dynamo traces one graph at a time; the others wait for it
            started = time.perf_counter()
            outputs = function(*inputs)
            if first not in self._seen:
                self._seen.add(first)
                self.graphs += 1
                self.compile_seconds += time.perf_counter() - started
            return outputs


def structure_key(gm: fx.GraphModule) -> object:
    """What decides a pack's compiled code: each node's op and target, which earlier nodes its
    arguments are, and the shapes and dtypes it makes. A graph that reads attributes of its module
    (constants) is its own structure."""
    index: dict[fx.Node, int] = {}
    parts = []
    for position, node in enumerate(gm.graph.nodes):
        index[node] = position
        if node.op in ("get_attr", "call_module"):
            return ("own", id(gm))
        arguments = fx.node.map_arg((node.args, node.kwargs), lambda n: ("node", index[n]))
        parts.append((node.op, str(node.target) if node.op != "placeholder" else "", repr(arguments),
                      _shapes(node.meta.get(meta.VAL))))
    return tuple(parts)


def _shapes(value: object) -> str:
    leaves = torch.utils._pytree.tree_leaves(value)
    return repr([(tuple(leaf.shape), leaf.dtype, leaf.requires_grad) if isinstance(leaf, torch.Tensor) else leaf
                 for leaf in leaves])
