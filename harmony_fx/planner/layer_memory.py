"""What each layer holds in memory, measured: its tasks run one layer at a time on the meta device.

The planner's memory model (``planner.costs``) needs, per layer and per sample:

* ``kept``: what a forward with autograd leaves alive of what the layer made: the tensors autograd
  saved for the backward, and the layer's outputs (the recompute's graph);
* ``saved_input``: the bytes of the layer's inputs (values made before it) autograd saved;
* ``forward_work``: the most a forward (with autograd or without) holds at once above what it
  leaves (its temporaries);
* ``backward_work``: the most its backward holds at once above what was resident when it began,
  less its weights' gradients (the weight-gradient key of the pack counts those): the incoming
  gradient, the gradients it makes for its inputs and its temporaries;
* ``grad_in`` / ``grad_out``: of those, the incoming gradients' bytes and the bytes of the
  gradients it makes for its inputs (a pack's task holds them as keys at its edges already).

Each is counted by ``ir.tracking.AllocationTracker`` (each storage once, from birth to death, as the
device's account counts it) over the layer's ATen ops, run node by node on meta tensors: no memory,
no FLOPs, so a 175B-parameter preset profiles as fast as a small model; a layer alike to one
measured before (``passes.find_layers.layer_signature``: a transformer's blocks) is not run again.
A layer whose ops cannot run on meta (a data-dependent op, an op without a meta kernel) gets the
static bound instead: every value it makes, for each figure. Attention runs the kernel the target device would pick
(``analysis.attention``): on meta it would always take the math path and keep the attention weights.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
from torch import fx

from harmony_fx.analysis.attention import SDPA, run_attention
from harmony_fx.analysis.requires_grad import run_node
from harmony_fx.ir import meta
from harmony_fx.ir.tracking import AllocationTracker, storage_key
from harmony_fx.ir.values import leaves, map_tensors, tensors
from harmony_fx.passes.find_layers import Layer, layer_inputs, layer_signature

__all__ = ["LayerMemory", "last_readers", "measure_layer_memory"]

_COMPUTE_DTYPES = {2: torch.bfloat16, 4: torch.float32}


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """Bytes for the whole captured batch (the profile divides them by it)."""

    kept: int
    saved_input: int
    forward_work: int
    backward_work: int
    grad_in: int = 0
    grad_out: int = 0


def last_readers(gm: fx.GraphModule, layers: Sequence[Layer]) -> dict[str, int]:
    """Each value's last layer reading it (``len(layers)``: the graph's output)."""
    layer_of = {name: layer.index for layer in layers for name in layer.nodes}
    last: dict[str, int] = {}
    for node in gm.graph.nodes:
        where = len(layers) if node.op == "output" else layer_of.get(node.name)
        if where is None:
            continue
        for arg in node.all_input_nodes:
            last[arg.name] = max(last.get(arg.name, -1), where)
    return last


def measure_layer_memory(gm: fx.GraphModule, layers: Sequence[Layer], read_after: dict[str, int],
                         made_bytes: Callable[[fx.Node], int], compute_itemsize: int | None = None,
                         device_type: str | None = None) -> list[LayerMemory]:
    """One ``LayerMemory`` per layer of ``gm`` (``passes.find_layers``); ``read_after``: each
    value's last reader (``last_readers``); ``made_bytes(node)``: a value's bytes, for the static
    bound of a layer that cannot run on meta; ``device_type``: the device the layers will run on
    (``"cuda"``, ``"cpu"``; ``None``: ops as meta runs them)."""
    nodes = {node.name: node for node in gm.graph.nodes}
    dtype = _COMPUTE_DTYPES.get(compute_itemsize) if compute_itemsize else None
    result = []
    seen: dict[tuple, LayerMemory] = {}  # a layer alike to one measured before (a transformer's blocks)
    for layer in layers:
        layer_nodes = [nodes[name] for name in layer.nodes]
        external = layer_inputs(layer_nodes)
        outputs = {node.name for node in layer_nodes if read_after.get(node.name, -1) > layer.index}
        signature = layer_signature(layer_nodes, external, outputs)
        if signature not in seen:
            try:
                # a higher-order op (a no_grad region) sets grad mode around its subgraph and does not
                # put it back if the subgraph raises: the context restores it whatever happens
                with torch.set_grad_enabled(torch.is_grad_enabled()):
                    seen[signature] = _measure(gm, layer_nodes, external, outputs, dtype, device_type)
            except Exception:  # noqa: BLE001 - no meta kernel, data-dependent: the static bound instead
                made = sum(made_bytes(node) for node in layer_nodes)
                seen[signature] = LayerMemory(made, 0, made, made)
        result.append(seen[signature])
    return result


def _measure(gm: fx.GraphModule, layer_nodes: list[fx.Node], external: list[fx.Node], outputs: set[str], dtype,
             device_type: str | None) -> LayerMemory:
    with torch.no_grad():
        _, _, _, forward_free = _forward(gm, layer_nodes, outputs, _inputs(external, dtype), device_type)
    inputs = _inputs(external, dtype)
    saved_inputs: dict[int, int] = {}
    input_storages = {storage_key(t): t.untyped_storage().nbytes()
                      for value in inputs.values() for t in tensors(value)}
    params = [t for node, value in zip(external, inputs.values()) if meta.role_of(node) == meta.Role.PARAM
              for t in tensors(value) if t.requires_grad]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key in input_storages and not any(key == storage_key(p) for p in params):
            saved_inputs[key] = input_storages[key]
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        tracker, env, resident, forward_grad = _forward(gm, layer_nodes, outputs, inputs, device_type)
    kept = tracker.live - resident
    # the backward: from the outputs that require grad, into every input that does
    results = [t for name in outputs for t in tensors(env[name]) if t.requires_grad]
    wanted = [t for value in inputs.values() for t in tensors(value) if t.requires_grad]
    backward_work = grad_in = grad_out = 0
    if results and wanted:
        before = tracker.live
        tracker.reset_peak()
        with tracker.mode():
            incoming = [torch.ones_like(t) for t in results]
            grad_in = sum(g.untyped_storage().nbytes() for g in incoming)
            grads = torch.autograd.grad(results, wanted, incoming, allow_unused=True)
            del incoming
            weight_grads = {storage_key(g): g.untyped_storage().nbytes() for g, t in zip(grads, wanted)
                            if g is not None and any(t is p for p in params)}
        grad_out = sum({storage_key(g): g.untyped_storage().nbytes() for g in grads
                        if g is not None and storage_key(g) not in weight_grads}.values())
        backward_work = max(tracker.peak - before - sum(weight_grads.values()), 0)
        del grads
    return LayerMemory(kept, sum(saved_inputs.values()), max(forward_free, forward_grad), backward_work, grad_in,
                       grad_out)


def _inputs(external: list[fx.Node], dtype) -> dict[str, object]:
    """Fresh meta tensors for the values a layer reads from outside it, requiring grad as in eager."""
    values = {}
    for node in external:
        flags = node.meta.get(meta.REQUIRES_GRAD)
        value = node.meta[meta.VAL] if node.op != "get_attr" else getattr(node.graph.owning_module, node.target)
        if flags is None:  # not annotated: parameters and floating activations require grad
            flags = [meta.role_of(node) in (meta.Role.PARAM, None) for _ in leaves(value)]
        values[node.name] = _fresh_leaves(value, flags, dtype)
    return values


def _fresh_leaves(value, flags, dtype):
    flags = iter(flags)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        wants = next(flags, False)
        floating = t.is_floating_point()
        copy = torch.empty_strided(t.shape, t.stride(), dtype=dtype if floating and dtype else t.dtype, device="meta")
        return copy.requires_grad_(bool(wants) and floating)

    return map_tensors(fresh, value)


def _forward(gm: fx.GraphModule, layer_nodes: list[fx.Node], outputs: set[str], inputs: dict[str, object],
             device_type: str | None):
    """Run the layer's nodes in order, each value dropped after its last read in the layer unless
    it is an output; return the tracker (the inputs counted first, then what the layer made), the
    values, the inputs' bytes and the most held above what is alive at the end."""
    last_read = {}
    for position, node in enumerate(layer_nodes):
        for arg in node.all_input_nodes:
            last_read[arg.name] = position
    env = dict(inputs)
    tracker = AllocationTracker()
    for value in inputs.values():  # resident already: their views (a weight's ``t()``) add nothing
        for tensor in tensors(value):
            tracker.register(tensor)
    resident = tracker.live
    with tracker.mode():
        for position, node in enumerate(layer_nodes):
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
            if isinstance(kwargs.get("device"), (str, torch.device)):  # a factory's tensor on meta too
                kwargs = {**kwargs, "device": torch.device("meta")}
            fused = run_attention(args, kwargs, device_type) if node.target is SDPA else None
            env[node.name] = run_node(gm, node, args, kwargs) if fused is None else fused
            del args, kwargs
            for arg in node.all_input_nodes:
                if last_read.get(arg.name) == position and arg.name not in outputs:
                    env.pop(arg.name, None)
            if node.name not in outputs and node.name not in last_read:
                env.pop(node.name)  # read by nothing
    return tracker, env, resident, tracker.peak - tracker.live
