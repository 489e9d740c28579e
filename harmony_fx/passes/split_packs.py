"""Materialise packs: one GraphModule per contiguous range of layers.

1. Each pack is the contiguous range of layers between two boundaries.
2. For each pack, collect its inputs (values defined outside and used inside: activations and
   model inputs, then parameters and buffers), and its outputs (values used after the pack). A
   higher-order op's subgraph (``get_attr``: a ``no_grad`` region's) is no value: a pack reading
   one that another pack's layer holds copies the ``get_attr``.
3. Copy the pack's nodes into a fresh graph whose placeholders are those inputs and whose output
   is the tuple of those outputs; lint it.

Example: packs ``[blocks.0, blocks.1] [blocks.2, head]`` of an MLP give two GraphModules::

    def forward(self, x, p_blocks_0_0_weight, p_blocks_0_0_bias, p_blocks_1_0_weight, ...):
        ...
        return (relu_1,)
    def forward(self, relu_1, p_blocks_2_0_weight, ..., p_head_weight, p_head_bias):
        ...
        return (linear_3,)
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from harmony_fx.analysis.aliasing import alias_base
from harmony_fx.analysis.buffer_writes import running_statistics, written_arguments
from harmony_fx.analysis.random_ops import draws_random
from harmony_fx.analysis.requires_grad import requires_grad_of
from harmony_fx.ir import meta
from harmony_fx.ir.pack import Pack
from harmony_fx.passes.find_layers import Layer

__all__ = ["split_packs", "annotate_packs", "pack_ranges"]


def split_packs(gm: fx.GraphModule, layers: Sequence[Layer], boundaries: Sequence[int],
                masters: dict[str, object], cache: dict[tuple[int, int], Pack] | None = None) -> list[Pack]:
    """``boundaries``: index of the first layer of each pack (starts with 0, increasing).
    ``masters``: placeholder name → master tensor, to merge tied parameters. ``cache``: the packs
    built before from ``gm``, by (first layer, end): the same layers make the same pack, under
    another index (a search over packings builds most of its packs many times)."""
    if not boundaries or boundaries[0] != 0 or list(boundaries) != sorted(set(boundaries)) or boundaries[-1] >= len(layers):
        raise ValueError(f"split_packs: pack boundaries {list(boundaries)} must start at 0 and increase within {len(layers)} layers")
    nodes = {node.name: node for node in gm.graph.nodes}
    packs = []
    for pack_index, (start, stop) in enumerate(pack_ranges(boundaries, len(layers))):
        pack = None if cache is None else cache.get((start, stop))
        if pack is None:
            pack = _build_pack(gm, layers, pack_index, start, stop, nodes, masters)
            if cache is not None:
                cache[(start, stop)] = pack
        packs.append(pack if pack.index == pack_index else dataclasses.replace(pack, index=pack_index))
    return packs


def pack_ranges(boundaries: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    """``(first layer, end)`` of each pack."""
    return list(zip(boundaries, [*boundaries[1:], num_layers]))


def annotate_packs(gm: fx.GraphModule, layers: Sequence[Layer], boundaries: Sequence[int]) -> fx.GraphModule:
    """Write ``PACK`` on every compute node: the pack its layer falls in, for the packing chosen
    (``split_packs`` itself writes nothing, so evaluating candidates leaves the graph as it was)."""
    nodes = {node.name: node for node in gm.graph.nodes}
    for pack_index, (start, stop) in enumerate(pack_ranges(boundaries, len(layers))):
        for layer in layers[start:stop]:
            for name in layer.nodes:
                nodes[name].meta[meta.PACK] = pack_index
    return gm


def _build_pack(gm, layers, pack_index, start, stop, nodes, masters) -> Pack:
    members = [nodes[name] for layer in layers[start:stop] for name in layer.nodes]
    member_set = set(members)
    act_inputs, state_inputs = [], []
    subgraphs: dict[fx.Node, None] = {}  # a higher-order op's subgraph made in another pack: copied here
    for node in members:
        for arg in node.all_input_nodes:
            if arg in member_set:
                continue
            if arg.op == "get_attr":
                subgraphs[arg] = None
                continue
            role = meta.role_of(arg)
            target = state_inputs if role in (meta.Role.PARAM, meta.Role.BUFFER) else act_inputs
            if arg.name not in target:
                target.append(arg.name)
    # a subgraph is no value: a pack that reads one made elsewhere copies its get_attr (above)
    outputs = [node.name for node in members
               if node.op != "get_attr" and any(user not in member_set for user in node.users)]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in act_inputs + state_inputs:
        placeholder = graph.placeholder(name)
        placeholder.meta.update(nodes[name].meta)
        env[nodes[name]] = placeholder
    for node in subgraphs:
        env[node] = graph.node_copy(node)
    for node in members:
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(tuple(env[nodes[name]] for name in outputs))
    graph.lint()
    with _use_lazy_graph_module(True):  # its code made when first run: a search replays most packs it builds
        pack_gm = _make_graph_module(gm, graph, class_name=f"Pack{pack_index}")

    # Distinct masters: tied parameters read by one pack are fetched once.
    slots: dict[int, int] = {}
    params, buffers = [], []
    for name in state_inputs:
        master = masters[name]
        if id(master) not in slots:
            is_param = meta.role_of(nodes[name]) == meta.Role.PARAM
            (params if is_param else buffers).append(name)
            slots[id(master)] = -1
    ordered = params + buffers
    for position, name in enumerate(ordered):
        slots[id(masters[name])] = position
    state_slot = tuple(slots[id(masters[name])] for name in state_inputs)
    master_to_buffer = {id(masters[b]): b for b in buffers}
    mutated = _mutated_buffers(members, set(buffers), masters, master_to_buffer)
    replayed = _read_before_written(members, [nodes[name] for name in outputs], mutated, masters, master_to_buffer)
    return Pack(
        index=pack_index,
        layers=tuple(range(start, stop)),
        layer_names=tuple(layer.name for layer in layers[start:stop]),
        gm=pack_gm,
        act_inputs=tuple(act_inputs),
        state_inputs=tuple(state_inputs),
        outputs=tuple(outputs),
        params=tuple(params),
        buffers=tuple(buffers),
        mutated_buffers=mutated,
        replayed_buffers=replayed,
        random=any(draws_random(node) for node in members),
        input_requires_grad=tuple(requires_grad_of(nodes[name]) for name in act_inputs),
        state_slot=state_slot,
    )


def _read_before_written(members, outputs, mutated, masters, master_to_buffer) -> tuple[str, ...]:
    """The mutated buffers whose value as the pack begins reaches one of its ``outputs``: followed
    from each buffer's placeholder through every op's arguments, and into what an op writes in
    place; not through a batch or instance norm's running statistics, which its output in training
    never reads (it only updates them)."""
    if not mutated:
        return ()
    reaches: dict[fx.Node, frozenset[str]] = {}
    for node in members:
        for arg in node.all_input_nodes:
            if arg not in reaches and arg.op == "placeholder":
                buffer = master_to_buffer.get(id(masters.get(arg.name)))
                reaches[arg] = frozenset({buffer}) if buffer in mutated else frozenset()
        statistics = set(running_statistics(node))
        read = frozenset().union(*(reaches.get(arg, frozenset()) for arg in node.all_input_nodes
                                   if arg not in statistics))
        reaches[node] = read
        for arg in _written_args(node):  # later readers of what it writes read what it read, through views
            for written in {arg, alias_base(arg)}:
                reaches[written] = reaches.get(written, frozenset()) | read
    found = frozenset().union(*(reaches.get(node, frozenset()) for node in outputs))
    return tuple(name for name in mutated if name in found)


def _written_args(node: fx.Node) -> list[fx.Node]:
    """The arguments an ATen op writes in place, by its schema; any of a call whose schema cannot
    say (a higher-order op's region, a plain torch function), as ``_mutated_buffers`` takes them."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return list(node.all_input_nodes) if node.op in ("call_function", "call_method") else []
    return written_arguments(node)


def _mutated_buffers(members, buffer_names, masters, master_to_buffer) -> tuple[str, ...]:
    """Buffers written in place. ATen ops say so in their schema; for plain torch functions (the
    symbolic_trace path) we cannot tell, so every buffer such a pack reads counts as written."""
    mutated = []
    for node in members:
        # aten.batch_norm updates running statistics without saying so in its schema
        written = _written_args(node) + sorted(running_statistics(node), key=lambda arg: arg.name)
        for arg in written:  # through a view: self.stats[0] += x writes the buffer
            name = master_to_buffer.get(id(masters.get(alias_base(arg).name)))
            if name is not None and name not in mutated:
                mutated.append(name)
    return tuple(mutated)
