"""Find the layers, the units packs are made of.

1. A node's *layer key* is the model's repeated block it is in: the innermost entry of its
   ``nn_module_stack`` whose path ends in an integer and whose siblings (the other entries of its
   ``nn.Sequential`` or ``nn.ModuleList``) are all of its class (``h.3`` for every node inside
   ``h[3]``; ``layers.0.blocks.1`` inside a hierarchical model's stage ``layers[0]``, whose
   blocks would otherwise make one layer of a whole stage), or all hold modules of their own (a
   stage of unlike blocks: NextViT's ``stages.2.blocks.4``, one ``NTB`` among ``NCB`` blocks);
   where no entry is such a block, the outermost path ending in an integer (a ``Sequential`` of
   different layers: ``mlp.0``).
2. A node with no such entry is a layer of its own (``embedding``, ``ln_f``'s ``layer_norm``, ...).
3. A layer is a maximal *contiguous* run of compute nodes (in topological order) with one key, so
   layers tile the compute nodes in order and packs can be contiguous ranges of layers.
4. An op that writes in place into an activation (``relu_``, ``x[:, 0] = 0``) joins one layer with
   the node that made that activation (through an op that may hand back its input:
   ``nn.Dropout(0.0)``, a ``torch.no_grad()`` region's result), and every layer between, writes
   inside such a region included; one that writes a buffer through a view
   (``self.stats[0] += x``), with the view; and every node that reads a buffer written in place
   joins one layer with its writes: a pack then never writes into one of its inputs, so what it
   stashes, sends and recomputes is what eager saw (and autograd never meets an in-place write into
   a leaf).

Placeholders (parameters, buffers, inputs) and the output node belong to no layer; packs reach
them through their inputs.

Writes ``LAYER`` and ``LAYER_NAME`` on every compute node.
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Iterable

import torch
from torch import fx

from harmony_fx.analysis.aliasing import alias_base, alias_chain
from harmony_fx.analysis.buffer_writes import running_statistics, written_by
from harmony_fx.analysis.requires_grad import requires_grad_of
from harmony_fx.ir import meta
from harmony_fx.ir.values import leaves

__all__ = ["Layer", "find_layers", "layer_inputs", "layer_signature"]

_INDEXED_PATH = re.compile(r"(?:^|\.)\d+$")


@dataclasses.dataclass(frozen=True)
class Layer:
    index: int
    name: str
    nodes: tuple[str, ...]


def find_layers(gm: fx.GraphModule) -> list[Layer]:
    layers: list[Layer] = []
    current_key, current_nodes = None, []
    stacks = {node: _module_stack(node) for node in gm.graph.nodes}
    repeated = _repeated_blocks(stacks.values())

    def close() -> None:
        if current_nodes:
            layers.append(Layer(len(layers), current_key or current_nodes[0], tuple(current_nodes)))

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        key = _block_path(stacks[node], repeated)
        if key is None or key != current_key:
            close()
            current_key, current_nodes = key, []
        current_nodes.append(node.name)
        node.meta[meta.LAYER] = len(layers)
        node.meta[meta.LAYER_NAME] = key or node.name
    close()
    return _merge_in_place_writes(gm, layers)


def _merge_in_place_writes(gm: fx.GraphModule, layers: list[Layer]) -> list[Layer]:
    """Step 4 of the module docstring: merge each run of layers from an activation's producer to
    an op writing into it."""
    reach = list(range(len(layers)))  # reach[i]: the last layer that layer i must share a pack with
    for node in gm.graph.nodes:
        for written in written_by(node, unknown_writes_all=False):  # inside a no_grad region too
            # the activation's producer; for a buffer written through a view (self.stats[0] += x),
            # the view, so the pack that writes holds the buffer it writes
            made = [alias for alias in _writes_through(written) if alias.op != "placeholder"]
            if made and made[-1].meta[meta.LAYER] < node.meta[meta.LAYER]:
                start = made[-1].meta[meta.LAYER]
                reach[start] = max(reach[start], node.meta[meta.LAYER])
    for accesses in _written_state_accesses(gm).values():
        start = min(accesses)
        reach[start] = max(reach[start], max(accesses))
    merged: list[Layer] = []
    start = 0
    while start < len(layers):
        stop, end = start, reach[start]
        while stop < end:  # a layer inside the run may reach further still
            stop += 1
            end = max(end, reach[stop])
        group = layers[start:stop + 1]
        name = group[0].name if len(group) == 1 else f"{group[0].name}+{group[-1].name}"
        merged.append(Layer(len(merged), name, tuple(n for layer in group for n in layer.nodes)))
        start = stop + 1
    if len(merged) != len(layers):
        nodes = {node.name: node for node in gm.graph.nodes}
        for layer in merged:
            for name in layer.nodes:
                nodes[name].meta[meta.LAYER] = layer.index
    return merged


# ops that hand back their input itself where they have nothing to do: dropout at p=0 or in eval,
# a cast to the dtype it has, contiguous of a contiguous tensor
_MAY_RETURN_INPUT = {torch.ops.aten.dropout.default, torch.ops.aten.alpha_dropout.default,
                     torch.ops.aten.feature_dropout.default, torch.ops.aten.feature_alpha_dropout.default,
                     torch.ops.aten.type_as.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
                     torch.ops.aten.to.other, torch.ops.aten.to.device, torch.ops.aten.contiguous.default}


def _writes_through(written: fx.Node) -> list[fx.Node]:
    """What a write into ``written`` may write: its views' chain, and past an op that may hand back
    its own input (``nn.Dropout(0.0)(v) += h`` writes ``v``) or a region's result that is one of its
    operands (``with torch.no_grad(): h.clamp_(...)`` returns ``h``), that input's chain too."""
    chain = alias_chain(written)
    while (source := _handed_back(chain[-1])) is not None:
        chain += alias_chain(source)
    return chain


def _handed_back(node: fx.Node) -> fx.Node | None:
    """The input ``node`` may be at run time: an op's that may hand it back, or the operand a
    ``wrap_with_*`` region returns (written in place inside it)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target in _MAY_RETURN_INPUT:
        return node.args[0]
    region_call = node.args[0]
    if node.target is not operator.getitem or not getattr(region_call.target, "__name__", "").startswith("wrap_with_"):
        return None
    root = node.graph.owning_module
    position = next((i for i, arg in enumerate(region_call.args) if isinstance(arg, fx.Node) and arg.op == "get_attr"),
                    None)
    region = getattr(root, region_call.args[position].target, None) if position is not None else None
    if not isinstance(region, fx.GraphModule):
        return None
    returned = region.graph.find_nodes(op="output")[0].args[0][node.args[1]]
    placeholders = region.graph.find_nodes(op="placeholder")
    base = alias_base(returned) if isinstance(returned, fx.Node) else None
    if base not in placeholders:
        return None
    operand = region_call.args[position + 1 + placeholders.index(base)]
    return operand if isinstance(operand, fx.Node) else None


def _written_state_accesses(gm: fx.GraphModule) -> dict[fx.Node, set[int]]:
    """For each parameter or buffer the graph writes in place, the layers of every node that reads
    it or a view of it. They form one layer: the pack that writes a buffer holds its own copy, which
    another pack reading it would fetch before the write came back to the host, and would recompute
    with after it (a BatchNorm's running statistics count as written: QAT's fused ConvBn reads
    ``bn.running_var`` to scale its weight before its BatchNorm updates it)."""
    written = {base for node in gm.graph.nodes
               for arg in written_by(node, unknown_writes_all=False) + running_statistics(node)
               for base in [alias_base(arg)] if base.op == "placeholder" and meta.role_of(base) != meta.Role.INPUT}
    accesses: dict[fx.Node, set[int]] = {}
    for node in gm.graph.nodes:
        if meta.LAYER not in node.meta:
            continue
        for arg in node.all_input_nodes:
            base = alias_base(arg)
            if base in written:
                accesses.setdefault(base, set()).add(node.meta[meta.LAYER])
    return accesses


def _module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """``node``'s module stack, outermost first: each module's path (export's spelling) and class."""
    return [(meta.module_path(path), str(type_)) for path, type_ in (node.meta.get(meta.MODULE_STACK) or {}).values()]


def _repeated_blocks(stacks: Iterable[list[tuple[str, str]]]) -> frozenset[str]:
    """The paths of modules that are one of two or more siblings of one class: a container's
    repeated blocks (a transformer's ``h.3``, a stage's ``blocks.1``); or one of two or more
    siblings that all hold modules of their own: a stage of blocks of unlike classes (NextViT's
    ``NCB`` and ``NTB`` blocks, DaViT's ``(SpatialBlock, ChannelBlock)`` pairs), which would
    otherwise be one layer of a whole stage (or pair); a Sequential of single layers (``mlp.0``
    a ``Linear``, ``mlp.1`` a ``GELU``) is not such a stage."""
    siblings: dict[str, dict[str, str]] = {}
    parents: set[str] = set()  # paths of modules that hold a module a node ran in
    for stack in stacks:
        for path, type_ in stack:
            if _INDEXED_PATH.search(path):
                siblings.setdefault(path.rpartition(".")[0], {})[path] = type_
        parents.update(path for (path, _), (inner, _) in zip(stack, stack[1:]) if inner.startswith(path + "."))
    return frozenset(path for children in siblings.values()
                     if len(children) >= 2 and (len(set(children.values())) == 1 or parents.issuperset(children))
                     for path in children)


def _block_path(stack: list[tuple[str, str]], repeated: frozenset[str]) -> str | None:
    indexed = [path for path, _type in stack if _INDEXED_PATH.search(path)]
    blocks = [path for path in indexed if path in repeated]
    return blocks[-1] if blocks else (indexed[0] if indexed else None)


def layer_inputs(layer_nodes: list[fx.Node]) -> list[fx.Node]:
    """The nodes a layer reads from outside it, in the order it first reads them."""
    inner = {node.name for node in layer_nodes}
    return list(dict.fromkeys(arg for node in layer_nodes for arg in node.all_input_nodes if arg.name not in inner))


def layer_signature(layer_nodes: list[fx.Node], external: list[fx.Node], outputs: set[str]) -> tuple:
    """What a measurement of a layer run alone depends on: its ops and how they read each other,
    which of its values it hands on (``outputs``), and its inputs' (``external``) roles, flags and
    layouts. Two layers alike in these measure alike (a transformer's blocks): measured once."""
    position = {node: index for index, node in enumerate(external + layer_nodes)}
    ops = tuple((node.op, node.target, repr(fx.node.map_arg((node.args, node.kwargs), position.__getitem__)),
                 node.name in outputs) for node in layer_nodes)
    inputs = tuple((node.op, node.target if node.op == "get_attr" else None, meta.role_of(node), requires_grad_of(node),
                    tuple((tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                          for t in leaves(node.meta.get(meta.VAL))))
                   for node in external)
    return ops, inputs
