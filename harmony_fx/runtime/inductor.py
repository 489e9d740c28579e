"""Packs compiled by inductor (``compile(..., compile_packs=True)``).

A pack's graph is already an ATen graph (``torch.export`` made it), so it goes to inductor's
``compile_fx`` directly, without Dynamo: Dynamo would trace the graph's Python again and check
guards on every input at every call, which here costs about 0.1-0.3 ms a pack call (measured on
the small GPT's blocks), for nothing the runtime does not already know. Run without gradients (a
forward whose outputs only go to the stash) a pack is an inference graph; run with them (the
recompute, the last pack's forward) AOT autograd traces forward and backward as one joint graph
and torch's min-cut partitioner decides, inside the pack, what the backward saves and what it
recomputes, while what crosses packs stays the program's. ``torch.autograd.grad`` in the backward
task then runs the compiled backward.

A compiled function is specialised to its inputs as they were when it was compiled: each tensor's
shape, strides, dtype, device and whether it requires grad, and the grad mode (which Dynamo's
guards would have checked). Calls with the same graph structure and the same inputs share it, so
identical packs (the blocks of a transformer) are compiled once (``structures`` counts the
structures); a call that differs in any of those gets its own compile. Random ops run as eager's
kernels (inductor's ``fallback_random``), drawing from the generator the runtime saves and
restores, so a recompute draws the forward's masks, compiled or not.
"""
from __future__ import annotations

import contextlib
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
        self._by_graph: dict[int, object] = {}  # id(pack.gm) -> its structure key
        self._structures: set[object] = set()
        self._compiled: dict[tuple, Callable] = {}  # (structure, grad mode, inputs) -> compiled function
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # time in compile_fx (the backward's compile runs at its first call)
        self.graphs = 0             # distinct graphs compiled
        # whether an iteration compiled nothing new: until then backward tasks run one at a time
        self.settled = False
        self._graphs_at_end = 0

    @property
    def structures(self) -> int:
        """Distinct pack structures compiled (identical packs count once)."""
        return len(self._structures)

    def run(self, pack: Pack, inputs: list, grad: bool) -> object:
        structure = self._by_graph.get(id(pack.gm))
        if structure is None:
            structure = self._by_graph.setdefault(id(pack.gm), structure_key(pack.gm))
        key = (structure, grad and torch.is_grad_enabled(), _signature(pack, inputs))
        function = self._compiled.get(key)
        if function is None:
            with self._lock:  # one compile at a time; another thread's call may be compiling this one
                function = self._compiled.get(key)
                if function is None:
                    # imported here: inductor takes seconds to import, and most processes never compile a pack
                    from torch._inductor.compile_fx import compile_fx

                    started = time.perf_counter()
                    with torch._inductor.config.patch(fallback_random=True):
                        function = compile_fx(_private_copy(pack.gm), list(inputs))
                    self.compile_seconds += time.perf_counter() - started
                    self._compiled[key] = function
                    self._structures.add(structure)
                    self.graphs += 1
        return function(*inputs)

    def backward_scope(self):
        """Held around a backward task's ``torch.autograd.grad`` until the compiles are over. A
        compile sets ``torch.fx.traceback``'s process-wide flag for keeping node metadata, which
        every Python autograd function's backward (the compiled packs' among them) reads on
        entry and exit; a backward on another thread while a compile runs (the compiled backward
        itself is compiled on its first call) would see the flag change under it."""
        return contextlib.nullcontext() if self.settled else self._lock

    def end_iteration(self) -> None:
        self.settled = self.graphs == self._graphs_at_end
        self._graphs_at_end = self.graphs


def _private_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with a graph of its own (each node's ``meta`` copied): inductor writes its own
    metadata into the nodes it compiles, and the pack's ``meta`` is the passes' (``ir.meta``)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _signature(pack: Pack, inputs: list) -> tuple:
    """What a compiled function is specialised to, per input (see the module docstring)."""
    try:  # all tensors, as nearly always: one comprehension (this runs at every pack call, on ~100 weights)
        return tuple([(x.size(), x.stride(), x.dtype, x.device, x.requires_grad) for x in inputs])
    except AttributeError:
        pass
    signature = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            signature.append((x.size(), x.stride(), x.dtype, x.device, x.requires_grad))
        elif x is None or isinstance(x, (bool, int, float)):
            signature.append(("value", x))
        else:
            raise ValueError(f"compile_packs: pack {pack.name} ({pack.describe_layers()}) takes a {type(x).__name__} "
                             "(a value of several tensors crossing packs), which inductor's compile_fx does not take; "
                             "train this model with compile_packs=False")
    return tuple(signature)


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
