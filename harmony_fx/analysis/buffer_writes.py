"""Which op of a captured graph updates the model's buffers in place (a step counter,
spectral_norm's power-iteration vectors, BatchNorm's ``num_batches_tracked``).

Cut into microbatches, a forward that updates a buffer updates it once per microbatch, each
microbatch reading what the one before left: another result than eager's one update for the
batch. The planner does not cut such a batch, and a cut set by hand says so.

An ATen op says what it writes in its schema. A higher-order op that runs a region under a mode
(``wrap_with_set_grad_enabled``, ``wrap_with_autocast``: a ``no_grad`` block) passes its operands to
the region's placeholders in order, and the region is read the same way; any other higher-order
op is taken to write every tensor it is given.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import fx

from harmony_fx.analysis.aliasing import alias_base
from harmony_fx.ir import meta

__all__ = ["first_buffer_write", "written_buffers", "written_arguments", "written_by", "running_statistics"]


# BatchNorm's own buffers: per microbatch, or per device as DDP keeps them, by design
_NORM_STATISTICS = ("num_batches_tracked", "running_mean", "running_var")


def _buffer_writes(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, fx.Node]]:
    """Each node of ``gm`` that writes a buffer placeholder in place, with that placeholder."""
    for node in gm.graph.nodes:
        for arg in map(alias_base, written_by(node)):  # through a view too: self.stats[0] += x
            if arg.op == "placeholder" and meta.role_of(arg) == meta.Role.BUFFER:
                yield node, arg


def first_buffer_write(gm: fx.GraphModule, statistics: bool = True) -> fx.Node | None:
    """The first node of ``gm`` that writes a buffer placeholder in place (``None``: none does);
    ``statistics=False``: not counting a batch norm's statistics."""
    return next((node for node, buffer in _buffer_writes(gm)
                 if statistics or not str(buffer.meta.get(meta.TARGET, "")).endswith(_NORM_STATISTICS)), None)


def written_buffers(gm: fx.GraphModule) -> set[str]:
    """The model's names (``meta.TARGET``) of the buffers ``gm`` writes in place."""
    return {str(buffer.meta.get(meta.TARGET, buffer.name)) for _, buffer in _buffer_writes(gm)}


def written_arguments(node: fx.Node) -> list[fx.Node]:
    """The arguments an ATen op writes in place, by its schema, given by position or by keyword
    (``div.out(a, b, out=buffer)``: spectral_norm's power iteration)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return []
    written = []
    for index, schema_arg in enumerate(node.target._schema.arguments):
        if schema_arg.alias_info is None or not schema_arg.alias_info.is_write:
            continue
        value = node.args[index] if index < len(node.args) else node.kwargs.get(schema_arg.name)
        if isinstance(value, fx.Node):
            written.append(value)
    return written


def written_by(node: fx.Node, unknown_writes_all: bool = True) -> list[fx.Node]:
    """What ``node`` writes in place: an ATen op's written arguments, or the operands a region
    (``torch.no_grad()``'s ``wrap_with_set_grad_enabled``) writes, through views; of another
    higher-order op, every operand (``unknown_writes_all``) or none."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return written_arguments(node)
    if not isinstance(target, torch._ops.HigherOrderOperator):
        return []
    root = node.graph.owning_module
    regions = [(index, getattr(root, arg.target, None)) for index, arg in enumerate(node.args)
               if isinstance(arg, fx.Node) and arg.op == "get_attr" and root is not None]
    if len(regions) == 1 and isinstance(regions[0][1], fx.GraphModule) and target.__name__.startswith("wrap_with_"):
        index, region = regions[0]
        operands = node.args[index + 1:]
        placeholders = region.graph.find_nodes(op="placeholder")
        written = {alias_base(inner) for inner_node in region.graph.nodes
                   for inner in written_by(inner_node, unknown_writes_all)}
        return [operand for operand, placeholder in zip(operands, placeholders)
                if isinstance(operand, fx.Node) and placeholder in written]
    return [arg for arg in node.all_input_nodes if arg.op != "get_attr"] if unknown_writes_all else []


def running_statistics(node: fx.Node) -> list[fx.Node]:
    """A batch or instance norm's running statistics arguments, where it updates them in place
    (training), which ``aten.batch_norm``'s schema does not say; not in eval mode, where its
    ``training`` (``use_input_stats``) argument is a constant ``False``."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return []
    name = node.target._schema.name.split("::")[-1]
    if "batch_norm" not in name and "instance_norm" not in name:
        return []
    arguments = node.target._schema.arguments
    for index, argument in enumerate(arguments):
        if argument.name in ("training", "use_input_stats"):
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if value is False:
                return []
    return [arg for arg, schema_arg in zip(node.args, arguments)
            if isinstance(arg, fx.Node) and schema_arg.name in ("running_mean", "running_var")]
