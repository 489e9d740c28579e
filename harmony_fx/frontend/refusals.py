"""What a captured graph may hold that harmony_fx cannot run as eager would, each refused at
compile with what to do instead (not a failure deep in planning, or a wrong result):

* **a write into a model input** (``x.add_(1)``): each pack runs on device copies of its inputs,
  so the write would never reach the caller's tensor, and a recompute would apply it twice;
  likewise **into a parameter** (``nn.Embedding(max_norm=...)``), whose pack computes on a copy;
* **a size that depends on the values with no largest value harmony_fx plans for**
  (``repeat_interleave`` by a tensor of repeats, ``bincount``): packs, stash and budget are
  planned for the largest sizes (``passes.bound_sizes`` gives ``x[mask]``, ``nonzero``,
  ``masked_select``, ``unique`` theirs, and ``ir.tracking.SIZED_AT_MOST`` makes them that large);
* **control flow on values as an operator** (``torch.cond``, ``while_loop``): planning runs each
  pack on FakeTensors, which cannot choose the branch;
* **sparse gradients** (``nn.Embedding(sparse=True)``): the runtime moves dense gradients between
  the host and the devices; likewise **a sparse value** (``x.to_sparse()``), which it moves, stashes
  and counts as dense tensors;
* **a matmul or convolution of two floating dtypes** (a float32 value meeting bfloat16 weights under
  ``precision="bf16"``, where the model casts to float32 itself): FakeTensors run it on shapes alone,
  and the kernel would raise at the first call;
* **a functorch transform other than vmap** left in the graph (``torch.func.jvp``'s forward-mode
  nesting): derivatives inside the forward, which the packs' backward does not replay
  (``frontend.functorch_regions`` turns a ``torch.vmap`` into the batched ops it computes).

``first_refused(gm)`` finds the first such node; ``refusal(found)`` is its ``ValueError``, naming the
model's line where the graph has stack traces (``capture`` takes them again to say it).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch import fx
from torch.utils import _pytree as pytree

from harmony_fx.analysis.aliasing import alias_base
from harmony_fx.analysis.buffer_writes import written_by
from harmony_fx.frontend.functorch_regions import functorch_call
from harmony_fx.ir import meta
from harmony_fx.ir.tracking import SIZED_AT_MOST
from harmony_fx.passes.bound_sizes import unbacked_symbols
from harmony_fx.runtime.ambient import Autocast

__all__ = ["first_refused", "refusal", "model_line", "MixedDtypes"]

_CONTROL_FLOW = {"cond", "while_loop"}
# ops that hand a tensor's value to Python as a number
_READ_INTO_PYTHON = {torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default}


def first_refused(gm: fx.GraphModule) -> tuple[fx.Node, Callable[[str], str]] | None:
    """The first node of a construct above, and the message for it given where it is."""
    for node in gm.graph.nodes:
        for written in written_by(node, unknown_writes_all=False):  # inside a no_grad region too
            base = alias_base(written)
            if base.op == "placeholder" and meta.role_of(base) == meta.Role.INPUT:
                writer = _inner_writer(node, written)
                if "register_buffer(" in (model_line(writer) or ""):
                    # torch.export (2.13) records a buffer the root module registers in its forward (a cache
                    # filled on the first call) as a copy into an input: the write is the registration's
                    return writer, lambda where: (
                        f"the model registers a buffer in its forward, at {where} (a cache filled on the first "
                        "call), which torch.export records as a write into an input where the module is the model "
                        "itself: register it in __init__ with its value (or at the largest size it needs, sliced "
                        "per call), or compute it in each call without keeping it.")
                return writer, lambda where, name=base.name: (
                    f"the model modifies its input {name!r} in place at {where}; harmony_fx runs the model on "
                    "copies of its inputs, so the change would not reach your tensor. Compute a new tensor "
                    f"instead (e.g. {name} = {name} + 1 rather than {name}.add_(1)), or clone the input first.")
            if base.op == "placeholder" and meta.role_of(base) == meta.Role.PARAM:
                return _inner_writer(node, written), lambda where, name=str(base.meta.get(meta.TARGET, base.name)): (
                    f"the model modifies its parameter {name!r} in place in its forward, at {where} "
                    "(nn.Embedding(max_norm=...) renormalises the rows it looks up; a weight clipped or projected "
                    "under no_grad): harmony_fx computes on a copy of each pack's weights, so the change would not "
                    "reach the parameter. Do it outside the forward (after optimizer.step(), "
                    f"with torch.no_grad(): ...), or turn it off (nn.Embedding: leave max_norm out).")
        if node.op != "call_function":
            continue
        if functorch_call(node):
            return node, lambda where, call=node.target.__name__: (
                f"the model runs a torch.func transform other than torch.vmap in its forward ({call} at {where}): "
                "forward-mode derivatives computed inside the forward are not something harmony_fx's packs replay "
                "in backward. Compute them outside the compiled model, or write the derivative as ops.")
        if getattr(node.target, "__name__", None) in _CONTROL_FLOW and not isinstance(node.target, torch._ops.OpOverload):
            return node, lambda where, op=node.target.__name__: (
                f"the model runs torch.{op} at {where}: harmony_fx plans each pack by running it on FakeTensors, "
                f"which cannot tell which way a {op} goes. Compute both branches and pick with torch.where, or "
                "leave the choice to Python outside the model.")
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        # an op the planning run cannot make as large as its bounded size (one_hot with its
        # num_classes, tagged too, makes a fixed size: not bounded, not refused)
        unsized = (node.meta.get(meta.BOUNDED) and torch.Tag.dynamic_output_shape in node.target.tags
                   and node.target not in SIZED_AT_MOST)
        if node.target in _READ_INTO_PYTHON and (unbacked_symbols(node.meta.get(meta.VAL))
                                                 or _unsized_without_values(node)):
            return node, lambda where: (
                f"the model reads a tensor's value into Python (.item(), .tolist(), int(x)) at {where}: harmony_fx "
                "plans every pack on tensors without values, so that number is unknown when it plans. Keep it a "
                "tensor (h * (h > 0).sum() rather than h * (h > 0).sum().item()), or compute it outside the model.")
        # export may have fixed such a size from a later use (bincount(ids, minlength=n) broadcast with
        # n values): the planning run, on FakeTensors without a shape environment, still cannot size it
        if unsized or unbacked_symbols(node.meta.get(meta.VAL)) or (
                node.target not in _READ_INTO_PYTHON and _unsized_without_values(node)):
            return node, lambda where, op=node.target._schema.name.split("::")[-1]: (
                f"the model makes a tensor whose size depends on its values ({op}), with no largest size "
                f"harmony_fx can plan for, at {where}: harmony_fx plans packs, stash and budget for the largest "
                "sizes, on tensors without values. " + _FIXED_SIZE_ADVICE.get(op, _SELECT_ADVICE))
        if (dtypes := _mixed_operand_dtypes(node)) is not None:
            return node, lambda where, op=node.target._schema.name.split("::")[-1]: (
                f"the model's {op} at {where} takes {dtypes[0]} and {dtypes[1]} tensors, which its kernel refuses "
                "(eager raises 'mat1 and mat2 must have the same dtype' when it runs). Under precision='bf16' the "
                "weights and inputs are bfloat16 while the model casts this value to float32 itself (.float(), "
                "a complex value's .abs()): cast it back to its weight's dtype (.to(layer.weight.dtype)), or train "
                "under torch.autocast instead of precision='bf16'.")
        if _sparse_gradient(node):
            return node, lambda where: (
                f"the model asks for sparse gradients at {where} (sparse=True): harmony_fx moves dense "
                "gradients between the host and the devices. Use sparse=False (and a dense optimizer).")
        if any(isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided
               for leaf in pytree.tree_leaves(node.meta.get(meta.VAL))):
            return node, lambda where, op=node.target._schema.name.split("::")[-1]: (
                f"the model makes a sparse tensor ({op}) at {where}: harmony_fx moves, stashes and counts dense "
                "tensors between packs and the host. Keep the value dense in the model (return it dense and call "
                ".to_sparse() on the output, outside the compiled model).")
    return None


_SELECT_ADVICE = ("Keep the size fixed or bounded: mask instead of selecting (torch.where(mask, x, 0) or x * mask), "
                  "or select with a boolean mask (x[mask]), nonzero, masked_select or unique, whose largest sizes it "
                  "knows.")
_FIXED_SIZE_ADVICE = {
    "bincount": "Count into a fixed number of bins n: F.one_hot(ids, n).sum(0), or "
                "torch.zeros(n).scatter_add_(0, ids, torch.ones(ids.shape)) (the same numbers where every id is below n).",
    "repeat_interleave": "Repeat by a Python int or a tuple of ints, or gather with a fixed-size index; or "
                         + _SELECT_ADVICE[0].lower() + _SELECT_ADVICE[1:],
}


# ops whose kernels take one floating dtype for every tensor operand (mat1 and mat2, input and weight)
_ONE_DTYPE = {getattr(torch.ops.aten, name) for name in (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "matmul", "linear", "conv1d", "conv2d", "conv3d",
    "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")}


def _mixed_operand_dtypes(node: fx.Node) -> tuple[torch.dtype, torch.dtype] | None:
    """Two dtypes among the floating tensor operands of an op in ``_ONE_DTYPE`` (FakeTensors run
    it on shapes alone, so the capture and the planning take it; the kernel raises at the first
    call), or ``None``. Not under autocast, which the graph records before its casts: they are made
    as each pack runs."""
    if (not isinstance(node.target, torch._ops.OpOverload) or node.target.overloadpacket not in _ONE_DTYPE
            or Autocast.current().enabled):
        return None
    dtypes = list(dict.fromkeys(value.dtype for arg in node.args if isinstance(arg, fx.Node)
                                if isinstance(value := arg.meta.get(meta.VAL), torch.Tensor)
                                and (value.is_floating_point() or value.is_complex())))
    return (dtypes[0], dtypes[1]) if len(dtypes) > 1 else None


def _unsized_without_values(node: fx.Node) -> bool:
    """Whether ``node``'s op, tagged as sizing its result by its values, cannot be run on
    FakeTensors without a shape environment (the planning run's): ``bincount`` whose size export
    fixed from a later broadcast, say. ``ir.tracking.SIZED_AT_MOST`` sizes its own; an op that
    sizes its result from an argument (``one_hot`` with its ``num_classes``) runs."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    tags = node.target.tags
    if node.target in SIZED_AT_MOST or (torch.Tag.dynamic_output_shape not in tags
                                        and torch.Tag.data_dependent_output not in tags):
        return False

    def fake(value):
        if isinstance(value, fx.Node) and isinstance(value.meta.get(meta.VAL), torch.Tensor):
            real = value.meta[meta.VAL]
            return torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=real.device)
        return value

    try:
        with FakeTensorMode():
            args, kwargs = fx.map_arg((node.args, node.kwargs), fake)
            node.target(*args, **kwargs)
    except (DynamicOutputShapeException, DataDependentOutputException):
        return True
    except Exception:  # noqa: BLE001 - anything else is the planning run's to meet, with its own words
        return False
    return False


def _inner_writer(node: fx.Node, written: fx.Node) -> fx.Node:
    """The op that writes ``written``: ``node`` itself, or the one inside the ``torch.no_grad()``
    region ``node`` runs (whose stack trace names the model's line; the region's names none)."""
    if isinstance(node.target, torch._ops.OpOverload) or node.graph.owning_module is None:
        return node
    for index, arg in enumerate(node.args):
        region = getattr(node.graph.owning_module, arg.target, None) if getattr(arg, "op", None) == "get_attr" else None
        if not isinstance(region, fx.GraphModule):
            continue
        inner = dict(zip(node.args[index + 1:], region.graph.find_nodes(op="placeholder"))).get(written)
        for inner_node in region.graph.nodes if inner is not None else ():
            if any(alias_base(w) is inner for w in written_by(inner_node, unknown_writes_all=False)):
                return _inner_writer(inner_node, inner)
    return node


class MixedDtypes(ValueError):
    """A matmul or convolution of two floating dtypes (``first_refused``): through ``torch.compile``
    under ``precision="bf16"``, the backend says it as a cast Dynamo baked in."""


def refusal(found: tuple[fx.Node, Callable[[str], str]]) -> ValueError:
    """The error for what ``first_refused`` found."""
    node, message = found
    line = model_line(node)
    error = MixedDtypes if _mixed_operand_dtypes(node) is not None else ValueError
    return error(message(f"{line!r} (node {meta.describe(node)})" if line else f"node {meta.describe(node)}"))


def model_line(node: fx.Node) -> str | None:
    """The model's line that made ``node``: the innermost frame of its stack trace outside torch
    and fx's generated code (a ``torch.cond``'s innermost frames are Dynamo's), ``None`` without
    a trace."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [(lines[i], lines[i + 1].strip()) for i in range(len(lines) - 1) if lines[i].lstrip().startswith("File ")]
    outside = [code for frame, code in frames if f"{os.sep}torch{os.sep}" not in frame and "<eval_with_key>" not in frame]
    return (outside or [code for _, code in frames] or [None])[-1]


def _sparse_gradient(node: fx.Node) -> bool:
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == "sparse":
            value = node.args[index] if index < len(node.args) else node.kwargs.get("sparse", argument.default_value)
            return value is True
    return False
