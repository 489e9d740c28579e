"""Profiles: what each layer costs, per sample, in FLOPs, bytes and (when measured) seconds.

The planner sees a model as a chain of layers (``passes.find_layers``). For each layer:

* ``param_bytes`` / ``num_params``: the weights it reads (in the compute dtype), moved per pack;
* ``fwd_flops``: forward FLOPs per sample (``torch.utils.flop_counter`` on FakeTensors);
* ``out_bytes``: bytes per sample live across the boundary after it (its output and every skip
  value still needed later): what is stashed when a pack ends there;
* ``saved_bytes``: bytes per sample of what a forward with autograd leaves alive of what the layer
  made: the tensors autograd saved and the layer's outputs (the recompute's graph, measured:
  ``planner.layer_memory``); ``saved_input_bytes``: of its inputs, those autograd saved;
* ``made_bytes``: bytes per sample of every value it makes (what the roofline reads and writes);
* ``forward_work_bytes`` / ``backward_work_bytes``: per sample, the most its forward / backward
  holds at once above what is resident and what it leaves (temporaries; the backward's incoming
  and outgoing gradients), measured;
* ``seconds``: measured forward and backward seconds at a few microbatch sizes (interpolated
  linearly between, and beyond, them); empty when measuring is impossible (a model on the meta
  device, or hardware not at hand) and the cost model uses the device spec's roofline instead.

Everything comes from the captured graph's annotations and a run of each layer on the meta
device, so a model on the meta device profiles in well under a second. ``repeat_block`` turns a
2-block capture of a transformer into the full depth, since every block costs the same.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Callable, Sequence

import torch
from torch import fx

from harmony_fx.analysis.sizes import annotate_sizes
from harmony_fx.ir import meta
from harmony_fx.passes.find_layers import Layer, find_layers
from harmony_fx.planner.layer_memory import last_readers, measure_layer_memory

__all__ = ["LayerProfile", "ModelProfile", "profile_graph", "repeat_block", "measure_seconds"]


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    name: str
    num_params: int
    param_bytes: int
    fwd_flops: float           # per sample
    out_bytes: float           # per sample, live after this layer
    saved_bytes: float         # per sample, made by this layer and kept by autograd or read after it
    # microbatch size -> (forward seconds, backward seconds), measured
    seconds: tuple[tuple[int, float, float], ...] = ()
    num_ops: int = 0           # ATen ops in its forward (each costs ``DeviceSpec.op_seconds`` to issue)
    made_bytes: float = 0.0    # per sample, every value this layer makes
    saved_input_bytes: float = 0.0     # per sample, of its inputs: those autograd keeps
    forward_work_bytes: float = 0.0    # per sample, a forward's temporaries at most
    backward_work_bytes: float = 0.0   # per sample, a backward's working set at most (weight gradients apart)
    grad_in_bytes: float = 0.0         # per sample, of that working set: the gradients of its outputs
    grad_out_bytes: float = 0.0        # per sample, of that working set: the gradients of its inputs

    def measured(self, size: float) -> tuple[float, float] | None:
        """(forward, backward) seconds at ``size`` samples, linear between the measured sizes."""
        if not self.seconds:
            return None
        sizes = [s for s, _, _ in self.seconds]
        if len(sizes) == 1:
            _, fwd, bwd = self.seconds[0]
            return fwd * size / sizes[0], bwd * size / sizes[0]
        i = min(max(bisect.bisect_left(sizes, size), 1), len(sizes) - 1)
        (s0, f0, b0), (s1, f1, b1) = self.seconds[i - 1], self.seconds[i]
        w = (size - s0) / (s1 - s0)
        return max(f0 + w * (f1 - f0), 0.0), max(b0 + w * (b1 - b0), 0.0)


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: tuple[LayerProfile, ...]
    batch_size: int            # the batch the per-sample figures were taken at
    input_bytes: float         # per sample: the model's inputs
    precision: str = "fp32"

    @property
    def num_params(self) -> int:
        return sum(layer.num_params for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def total_flops(self, batch: int) -> float:
        """Forward + recompute + backward (2x forward) FLOPs of one iteration."""
        return 4 * batch * sum(layer.fwd_flops for layer in self.layers)


def profile_graph(name: str, gm: fx.GraphModule, batch_size: int, compute_itemsize: int | None = None,
                  precision: str = "fp32", device_type: str | None = None) -> ModelProfile:
    """The layer chain of a captured graph (placeholders tagged with their ``Role``), its memory
    as a ``device_type`` device (``"cuda"``, ``"cpu"``) would hold it (``planner.layer_memory``).
    ``compute_itemsize``: the bytes of a floating element where the graph was captured wider than
    the devices compute (the ``plan`` command's fp32 presets); a compile's graph is captured in the
    compute dtype already (``frontend.compute_dtype``) and passes ``None``."""
    if meta.NBYTES not in next(iter(gm.graph.nodes)).meta:
        annotate_sizes(gm)
    layers = find_layers(gm)
    nodes = {node.name: node for node in gm.graph.nodes}
    layer_of = {name: layer.index for layer in layers for name in layer.nodes}
    last_reader = last_readers(gm, layers)
    inputs = [n for n in gm.graph.find_nodes(op="placeholder") if meta.role_of(n) == meta.Role.INPUT]

    def nbytes(node: fx.Node) -> int:  # activations are stored in the compute dtype, too
        val = node.meta.get(meta.VAL)
        if compute_itemsize and isinstance(val, torch.Tensor) and val.is_floating_point():
            return val.numel() * compute_itemsize
        return meta.nbytes_of(node)

    # bytes live across boundary i (after layer i): defined at or before i, read after i
    live_after = [0.0] * len(layers)
    for node in [*inputs, *(nodes[n] for layer in layers for n in layer.nodes)]:
        born = layer_of.get(node.name, -1)
        for i in range(max(born, 0), min(last_reader.get(node.name, -1), len(layers))):
            live_after[i] += nbytes(node)

    memory = measure_layer_memory(gm, layers, last_reader, nbytes, compute_itemsize, device_type)
    profiles, counted = [], set()
    for layer, held in zip(layers, memory):
        layer_nodes = [nodes[n] for n in layer.nodes]
        state = {read for node in layer_nodes for read in node.meta[meta.READS]}
        params = [nodes[s].meta[meta.VAL] for s in sorted(state)]
        itemsize = lambda t: compute_itemsize if compute_itemsize and t.is_floating_point() else t.element_size()
        profiles.append(LayerProfile(
            name=_layer_label(layer, layer_nodes),
            # a tied parameter is moved by every layer reading it, but updated once: the first's
            num_params=sum(nodes[s].meta[meta.VAL].numel() for s in _first_reads(state, counted, nodes)),
            param_bytes=sum(t.numel() * itemsize(t) for t in params),
            fwd_flops=sum(n.meta[meta.FLOPS] for n in layer_nodes) / batch_size,
            out_bytes=live_after[layer.index] / batch_size,
            saved_bytes=held.kept / batch_size,
            num_ops=sum(n.op == "call_function" for n in layer_nodes),
            made_bytes=sum(nbytes(n) for n in layer_nodes) / batch_size,
            saved_input_bytes=held.saved_input / batch_size,
            forward_work_bytes=held.forward_work / batch_size,
            backward_work_bytes=held.backward_work / batch_size,
            grad_in_bytes=held.grad_in / batch_size,
            grad_out_bytes=held.grad_out / batch_size,
        ))
    return ModelProfile(name, tuple(profiles), batch_size, sum(nbytes(n) for n in inputs) / batch_size,
                        precision)


def _first_reads(state: set[str], counted: set[str], nodes: dict[str, fx.Node]) -> list[str]:
    """The parameters in ``state`` no earlier layer read (by master tensor: tied names are one)."""
    first = []
    for name in sorted(state):
        node = nodes[name]
        master = node.meta.get(meta.TARGET, name)
        if meta.role_of(node) == meta.Role.PARAM and master not in counted:
            counted.add(master)
            first.append(name)
    return first


def _layer_label(layer: Layer, nodes: Sequence[fx.Node]) -> str:
    return nodes[0].meta.get(meta.LAYER_NAME, layer.name)


def repeat_block(profile: ModelProfile, block: str, copies: int) -> ModelProfile:
    """Replace the layers named like ``block`` (e.g. ``"h."``, captured with 2 blocks) by
    ``copies`` copies of the last of them (the first may carry costs of what precedes it)."""
    positions = [i for i, layer in enumerate(profile.layers) if layer.name.startswith(block)]
    if not positions:
        raise ValueError(f"repeat_block: no layer of {profile.name} is named {block!r}*")
    first, last = positions[0], positions[-1]
    template = profile.layers[last]
    stem = template.name[: template.name.rfind(".") + 1]
    blocks = [dataclasses.replace(template, name=f"{stem}{i}") for i in range(copies)]
    layers = profile.layers[:first] + tuple(blocks) + profile.layers[last + 1:]
    return dataclasses.replace(profile, layers=layers)


def measure_seconds(profile: ModelProfile, run_at: Callable[[int], tuple[fx.GraphModule, list, float]],
                    sizes: Sequence[int], repeats: int = 3) -> ModelProfile:
    """Measure each layer's forward seconds, and the model's backward, at each microbatch size.

    ``run_at(size) -> (gm, example placeholders in order, backward seconds of the whole model)``.
    The forward is timed node by node (an ``fx.Interpreter``) and summed per layer; the backward,
    which autograd runs as one, is shared out among layers in proportion to their forward time.
    """
    per_size: list[list[tuple[int, float, float]]] = [[] for _ in profile.layers]
    for size in sorted(set(sizes)):
        gm, example, backward_seconds = run_at(size)
        layers = find_layers(gm)
        if len(layers) != len(profile.layers):
            raise ValueError(f"measure_seconds: the model has {len(layers)} layers at microbatch size {size} "
                             f"but {len(profile.layers)} in the profile")
        layer_of = {name: layer.index for layer in layers for name in layer.nodes}
        totals = [float("inf")] * len(layers)
        for _ in range(repeats):
            seconds = _NodeTimer(gm, layer_of, len(layers)).time(example)
            totals = [min(a, b) for a, b in zip(totals, seconds)]
        forward = sum(totals) or 1.0
        for i, fwd in enumerate(totals):
            per_size[i].append((size, fwd, backward_seconds * fwd / forward))
    layers = tuple(dataclasses.replace(layer, seconds=tuple(points)) for layer, points in zip(profile.layers, per_size))
    return dataclasses.replace(profile, layers=layers)


class _NodeTimer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, layer_of: dict[str, int], num_layers: int) -> None:
        super().__init__(gm)
        self.layer_of = layer_of
        self.seconds = [0.0] * num_layers

    def run_node(self, node: fx.Node):
        start = time.perf_counter()
        result = super().run_node(node)
        if node.name in self.layer_of:
            self.seconds[self.layer_of[node.name]] += time.perf_counter() - start
        return result

    def time(self, example: list) -> list[float]:
        with torch.no_grad():
            self.run(*example)
        return self.seconds
