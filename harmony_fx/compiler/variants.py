"""The model captured at each microbatch size, annotated and cut into layers.

Export bakes sizes into reshapes, so a batch of 10 in 4 microbatches (3, 3, 2, 2) is captured at
sizes 3 and 2; every variant must have the same layers (the packs of every size share their
boundaries and names). ``None`` is the whole batch (one microbatch). Export may also capture other
ops at another size (a ``contiguous`` on a size-1 dim is a no-op it drops); ``check_same_layers``
then says which microbatches capture one size only, and ``compile`` falls back from a planner's
choice that meets it.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Mapping, Sequence

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from harmony_fx.analysis.aliasing import aliased, written_arguments
from harmony_fx.analysis.requires_grad import annotate_requires_grad
from harmony_fx.analysis.sizes import annotate_sizes
from harmony_fx.frontend.capture import Captured, capture
from harmony_fx.ir.values import leaves
from harmony_fx.ir import meta
from harmony_fx.passes.find_layers import Layer, find_layers
from harmony_fx.passes.retarget_device import retarget_device

__all__ = ["Variant", "GraphsDiffer", "ComputesOtherwise", "capture_variant", "check_same_layers",
           "check_computes_alike", "check_outputs_alike"]


class ComputesOtherwise(ValueError):
    """A microbatch's graph computes something else than the whole batch's on its samples;
    ``reason``: what differs, in words (a cut by hand is warned with it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}, so microbatches would compute something else than the batch. Use "
                         "microbatches=1, or make the forward not depend on the batch size.")
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Variant:
    """The model captured at one microbatch size."""

    size: int | None
    captured: Captured
    layers: tuple[Layer, ...]
    nodes: dict[str, fx.Node]
    reused: bool = False  # a copy of an earlier compile's capture (``compiler.capture_cache``)

    @property
    def masters(self) -> dict[str, object]:
        """Placeholder name -> the model's own parameter or buffer."""
        return {**self.captured.params, **self.captured.buffers}


def capture_variant(model: nn.Module, size: int | None, args: tuple, kwargs: dict, target,
                    dtype: torch.dtype | None = None) -> Variant:
    """Capture ``model(*args, **kwargs)`` (a microbatch of ``size`` samples) for the device
    ``target`` (a ``torch.device``), computing in ``dtype`` (``None``: the model's own): sizes,
    requires-grad flags and layers annotated."""
    captured = capture(model, args, kwargs, dtype=dtype)
    retarget_device(captured.gm, target)
    annotate_sizes(captured.gm)
    flags = {name: x.requires_grad for name, x in zip(captured.inputs, captured.flatten_inputs(args, kwargs))}
    flags.update({name: param.requires_grad for name, param in captured.params.items()})
    annotate_requires_grad(captured.gm, flags)
    layers = tuple(find_layers(captured.gm))
    if not layers:
        raise ValueError(f"{type(model).__name__} computes nothing (its captured graph has no op): there is "
                         "nothing for harmony_fx to run; call the model eagerly.")
    return Variant(size, captured, layers, {node.name: node for node in captured.gm.graph.nodes})


class GraphsDiffer(ValueError):
    """Two microbatch sizes capture different layers; ``sizes``: the backward's microbatch sizes,
    ``forward``: whether a larger forward microbatch's graph is one of the two."""

    def __init__(self, message: str, sizes: Sequence[int | None], forward: bool) -> None:
        super().__init__(message)
        self.sizes, self.forward = tuple(sizes), forward


def check_same_layers(variants: dict[int | None, Variant], backward_sizes: Sequence[int | None],
                      forward_sizes: Sequence[int] = ()) -> None:
    """Every variant has the first's layers, node for node; else a ``ValueError`` saying where
    they differ and which microbatches to use instead. ``backward_sizes``: the microbatches'
    sizes; ``forward_sizes``: the larger forward microbatches', if any."""
    first, *others = variants.values()
    for variant in others:
        if [layer.nodes for layer in variant.layers] == [layer.nodes for layer in first.layers]:
            continue
        only_one = set(first.nodes) ^ set(variant.nodes)
        written = [node for v in (first, variant) for name, node in v.nodes.items()
                   if name in only_one and _copy_written_into(node)]
        if written:
            raise ValueError(
                f"at a microbatch of {min(s or 0 for s in (first.size, variant.size))} sample(s) export drops "
                f"{written[0].name!r} ({written[0].target}), a copy the model then writes into in place (`t = "
                "h.transpose(0, 1).contiguous(); t.relu_()`: at one sample the copy is the tensor itself, and the "
                "write reaches h): such a microbatch computes something else than the batch. Use microbatches "
                "of at least 2 samples each, or microbatches=1.")
        where = next(((a, b) for a, b in zip(first.layers, variant.layers) if a.nodes != b.nodes), None)
        detail = ""
        if where is not None:
            only = sorted(set(where[0].nodes) ^ set(where[1].nodes))
            detail = (f", first in layer {where[0].name!r} (nodes only one of them has: "
                      f"{', '.join(only[:3])}{', ...' if len(only) > 3 else ''})")
        raise GraphsDiffer(
            f"the model's graph at microbatch size {variant.size} differs from the graph at size {first.size}"
            f"{detail}: export specialises some ops on the sizes it sees (a size-1 dim, for one, makes a "
            "`contiguous` a no-op it drops), and the packs of every microbatch size must share their layers. "
            + _same_size_advice(first.size, variant.size, backward_sizes, forward_sizes),
            backward_sizes, bool({first.size, variant.size} & (set(forward_sizes) - set(backward_sizes))))


def _same_size_advice(a: int | None, b: int | None, backward_sizes: Sequence[int | None],
                      forward_sizes: Sequence[int]) -> str:
    """What makes every microbatch one size, for the sizes ``a`` and ``b`` that capture differently."""
    num = len(backward_sizes)
    if {a, b} & (set(forward_sizes) - set(backward_sizes)):
        advice = (f"The forward runs microbatches of {max(forward_sizes)} samples and the backward of "
                  f"{min(s for s in backward_sizes if s)}: give microbatches as one int (e.g. microbatches={num}).")
    else:
        batch = sum(s for s in backward_sizes if s)
        advice = (f"A batch of {batch} in microbatches={num} is cut into sizes "
                  f"{', '.join(map(str, sorted(set(backward_sizes), reverse=True)))}: use a batch size divisible "
                  f"by {num}, or a number of microbatches that divides {batch}.")
    if 1 in (a, b):
        advice += " Microbatches of one sample capture differently most often: prefer at least 2 samples each."
    return advice


def check_computes_alike(whole: Variant, part: Variant, batch: int,
                         value_dims: Mapping[str, int] | None = None) -> None:
    """A microbatch's graph computes what the whole batch's (of ``batch`` samples) does on its
    samples: the same ops, each op on the samples' values taking the same numbers. A number that
    differs there (``h * x.shape[0]``) or an op one graph runs and the other does not (``if
    x.shape[0] > 4: h = h * 2``) means the model computes with its batch size, and microbatches would
    compute something else than the batch: ``ComputesOtherwise`` (a planner's cut then falls back). Ops
    that make sizes (``view``, ``arange``, ``expand``) take other numbers by design, export drops a
    ``contiguous`` on a size-1 dim, and a scaled loss (a 0-dim value) is weighed by
    ``analysis.reductions``. ``value_dims``: the whole graph's batched values' batch dims (the
    analysis's), each of which must shrink to the microbatch's share: a value that keeps the whole
    batch's size there (``h.expand(5, 5, 5)`` of one sample) computes the batch from one sample."""
    ours = [node for node in whole.captured.gm.graph.nodes if node.op == "call_function"]
    theirs = [node for node in part.captured.gm.graph.nodes if node.op == "call_function"]
    pairs = _paired_past_layout_ops(ours, theirs)
    opcodes = [] if pairs is not None else difflib.SequenceMatcher(
        a=[n.target for n in ours], b=[n.target for n in theirs], autojunk=False).get_opcodes()
    pairs = pairs or []
    for tag, start, stop, other_start, other_stop in opcodes:
        if tag == "equal":
            pairs.extend(zip(ours[start:stop], theirs[other_start:other_stop]))
            continue
        computing = [node for node in ours[start:stop] + theirs[other_start:other_stop]
                     if node.target not in _LAYOUT_ONLY or _copy_written_into(node)]
        if computing:
            where = "the whole batch" if computing[0] in ours else "a microbatch"
            raise ComputesOtherwise(
                f"the model runs {meta.describe(computing[0])} on {where} only (a batch of {batch}, microbatches "
                f"of {part.size}: Python control flow on the batch size, as in `if x.shape[0] > 4:`)")
    _check_constants_alike(whole, part, batch)
    for node, other in pairs:
        _check_shapes_follow_the_batch(node, other, (value_dims or {}).get(node.name), batch, part.size)
        # arithmetic on the samples' values, or the value a number is made into (/ torch.full((), B))
        if _on_samples(node) or node.target in _FILLS:
            _check_numbers_alike(node, other, batch, part.size)


_FILLS = {torch.ops.aten.full.default, torch.ops.aten.new_full.default, torch.ops.aten.full_like.default,
          torch.ops.aten.scalar_tensor.default, torch.ops.aten.fill.Scalar, torch.ops.aten.fill_.Scalar}


def _check_numbers_alike(node: fx.Node, other: fx.Node, batch: int, size: int | None) -> None:
    """The numbers an op takes as values (not sizes: those come in lists) are the same in both graphs."""
    for value, given in zip(node.args, other.args):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != given:
            raise ComputesOtherwise(
                f"the model computes {meta.describe(node)} with the number {value!r} on the whole batch of {batch} and "
                f"{given!r} on a microbatch of {size} (its batch size as a value, as in `h * x.shape[0]` or "
                "`h.sum() / torch.full((), x.shape[0])`)")


def _check_constants_alike(whole: Variant, part: Variant, batch: int) -> None:
    """A small tensor the forward makes from numbers (``torch.tensor(float(x.shape[0]))``, lifted to a
    constant) holds the same values in both graphs; the model's own buffers are the same tensors."""
    theirs = part.captured.buffers
    for name, ours in whole.captured.buffers.items():
        other = theirs.get(name)
        if other is None or other is ours or ours.shape != other.shape or ours.numel() > 16:
            continue
        if not torch.equal(ours, other):
            raise ComputesOtherwise(
                f"the model makes the constant {name} as {ours.tolist()} on the whole batch of {batch} and "
                f"{other.tolist()} on a microbatch of {part.size} (its batch size as a value, as in `h.sum() / "
                "torch.tensor(float(x.shape[0]))`)")


def _check_shapes_follow_the_batch(node: fx.Node, other: fx.Node, dim: int | None, batch: int,
                                   size: int | None) -> None:
    """A value the batch's samples make apart differs between the whole batch and a microbatch along
    its batch dim alone (one that differs along two, ``h ** torch.arange(x.shape[0])``: [B, B], is
    sized by the batch where each sample's own values should be), and there by the microbatch's
    share (``dim``, the analysis's; one that keeps the whole batch's size, ``h.expand(5, 5, 5)`` of
    one sample, computes the batch from one sample)."""
    for index, (ours, theirs) in enumerate(zip(leaves(node.meta.get(meta.VAL)), leaves(other.meta.get(meta.VAL)))):
        if not (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)) or ours.dim() != theirs.dim():
            continue
        shapes = (f"as {list(ours.shape)} on the whole batch of {batch} and {list(theirs.shape)} on a microbatch "
                  f"of {size}")
        if sum(a != b for a, b in zip(ours.shape, theirs.shape)) > 1:
            raise ComputesOtherwise(
                f"the model computes {meta.describe(node)} {shapes}: more than its batch dim follows the batch size "
                "(a size read from the batch, as torch.arange(x.shape[0]) along another dim)")
        if index == 0 and dim is not None and size and theirs.shape[dim] * batch != ours.shape[dim] * size:
            raise ComputesOtherwise(
                f"the model computes {meta.describe(node)} {shapes}: its batch dim ({dim}) does not follow the batch "
                "size (a size written as a number, as h.expand(5, 5, 5) of a batch of 5)")


def check_outputs_alike(whole: Variant, part: Variant, batch: int,
                        output_dims: Mapping[int, int | None] | None = None) -> None:
    """Each output has as many dims on a microbatch as on the whole batch, and its batch dim (by
    position, ``output_dims``: the analysis's) the microbatch's share of it: an op that drops or
    adds dims by their sizes (``squeeze()`` drops a one-sample microbatch's batch dim), or writes a
    size as a number (``h.expand(5, 5, 5)``), makes outputs that cannot be joined as the batch's."""
    outputs = [graph.find_nodes(op="output")[0].args[0] for graph in (whole.captured.gm.graph, part.captured.gm.graph)]
    if len(outputs[0]) != len(outputs[1]):  # paired by position, each would be compared with another output
        raise ValueError(
            f"the model returns {len(outputs[0])} values on the whole batch of {batch} and {len(outputs[1])} on a "
            f"microbatch of {part.size}: an output is a list or tuple with one entry per sample (as Llava's "
            "image_outputs.pooler_output, one tensor per image), so the microbatches' outputs cannot be joined as "
            "the batch's. Use microbatches=1, or None (the planner keeps such a batch whole); or return the "
            "entries stacked along the batch dim.")
    for position, (ours, theirs) in enumerate(zip(*outputs)):
        a, b = (node.meta.get(meta.VAL) if isinstance(node, fx.Node) else None for node in (ours, theirs))
        dim = (output_dims or {}).get(position, 0)  # what the call joins it along (``Compiled.output_dims``)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        if dim is not None and a.dim() > 0 and a.shape == b.shape and part.size and part.size < batch:
            raise ValueError(
                f"{_output_shapes(whole, part, position, ours, batch)}: it does not grow with the batch (a reduction "
                "over the samples, as x.mean(0); a value no sample reaches, as a parameter's slice; the batch size "
                "written as a number, as h.expand(5, 5, 5)), so the microbatches' outputs, joined along its dim "
                f"{dim}, would not be the batch's. Use microbatches=1, or None (the planner keeps such a batch "
                "whole); or return the per-sample values and reduce them after the call.")
        differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if a.dim() == b.dim() and len(differ) == 2 and all(a.shape[i] * part.size == b.shape[i] * batch
                                                           for i in differ):
            raise ValueError(
                f"{_output_shapes(whole, part, position, ours, batch)}: it pairs every sample with every other (a "
                "similarity matrix, as CLIP's and SigLIP's logits_per_image), which microbatches cannot compute (a "
                "contrastive loss over it mixes the samples). Where an input's dim 0 is not a batch of samples (an "
                "unbatched sequence), name each input's batch dim with batch_dims=...; otherwise use "
                "microbatches=1, or None (the planner keeps such a batch whole).")
        if (a.dim() != b.dim() or len(differ) > 1
                or (dim is not None and dim < min(a.dim(), b.dim()) and part.size
                    and b.shape[dim] * batch != a.shape[dim] * part.size)):
            raise ValueError(
                f"{_output_shapes(whole, part, position, ours, batch)}: an op drops or adds dims by their sizes "
                "(squeeze() without a dim drops a one-sample microbatch's batch dim), writes the batch size as a number "
                "(h.expand(5, 5, 5)), or sizes another dim by the batch (an input whose dim 0 is not a batch of "
                "samples, cut as one: name its batch dim with batch_dims=...), so the microbatches' outputs cannot "
                "be joined as the batch's. Name the dim (squeeze(-1)), use microbatches of more than one sample, or "
                "microbatches=1.")


def _output_shapes(whole: Variant, part: Variant, position: int, node: fx.Node, batch: int) -> str:
    """How a refusal names output ``position`` and its shapes on the whole batch and on ``part``."""
    shapes = [variant.captured.gm.graph.find_nodes(op="output")[0].args[0][position].meta[meta.VAL].shape
              for variant in (whole, part)]
    return (f"the model's {_output_name(whole, position, node)} is {list(shapes[0])} on the whole batch of {batch} "
            f"and {list(shapes[1])} on a microbatch of {part.size}")


def _output_name(variant: Variant, position: int, node: fx.Node) -> str:
    """Output ``position`` (made by ``node``) as the model returns it (``output['logits_per_image']
    (matmul)``), else by its position (``output 0 (squeeze)``)."""
    count = len(variant.captured.gm.graph.find_nodes(op="output")[0].args[0])
    try:
        structure = variant.captured.unflatten_outputs(list(range(count)))
        for path, leaf in pytree.tree_flatten_with_path(structure)[0]:
            if leaf == position and path:
                return f"output{pytree.keystr(path)} ({node.name})"
    except Exception:  # noqa: BLE001 - a structure that cannot hold numbers in its tensors' places: by position
        pass
    return f"output {position} ({node.name})"


# ops that only lay values out, which export keeps or drops by the sizes it sees
_LAYOUT_ONLY = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
                torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
                torch.ops.aten.expand.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
                torch.ops.aten.squeeze.default, torch.ops.aten.unsqueeze.default}


def _paired_past_layout_ops(ours: list[fx.Node], theirs: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]] | None:
    """The two graphs' ops paired in order, stepping over an op only one runs where it only lays
    values out (the usual difference: a ``contiguous`` export drops at a size-1 dim), in one pass;
    ``None`` where that does not pair them (a diff then says what differs)."""
    pairs, i, j = [], 0, 0
    while i < len(ours) or j < len(theirs):
        if i < len(ours) and j < len(theirs) and ours[i].target == theirs[j].target:
            pairs.append((ours[i], theirs[j]))
            i, j = i + 1, j + 1
        elif i < len(ours) and ours[i].target in _LAYOUT_ONLY and not _copy_written_into(ours[i]):
            i += 1
        elif j < len(theirs) and theirs[j].target in _LAYOUT_ONLY and not _copy_written_into(theirs[j]):
            j += 1
        else:
            return None
    return pairs


def _copy_written_into(node: fx.Node) -> bool:
    """Whether ``node`` copies (``contiguous``, ``clone``) into a tensor an op then writes in place,
    directly or through a view: where export drops the copy (at a size-1 dim it is the tensor
    itself), the write reaches the tensor it was copied from."""
    if node.target not in (torch.ops.aten.contiguous.default, torch.ops.aten.clone.default):
        return False
    views, seen = [node], set()
    while views:
        current = views.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if current in written_arguments(user):
                return True
            if aliased(user) is current:
                views.append(user)
    return False


def _on_samples(node: fx.Node) -> bool:
    """An element-wise op on values that are not a scalar (where a number is arithmetic, not a size)."""
    value = node.meta.get(meta.VAL)
    return (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
            and isinstance(value, torch.Tensor) and value.dim() > 0)
