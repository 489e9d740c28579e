"""What a pack's recompute provably leaves on the device for its backward, measured per layer.

``PackingBounds`` (``compiler.packing``) bounds a packing's peak from below by what the device holds
in a pack's backward. As it begins, the pack's recompute has left its graph: the values the pack
returns (its outputs, kept with the graph) and every tensor autograd saved in a node reachable from
them. Which nodes those are depends on where the pack ends, so each storage a layer makes gets one
number, its *reach*: a pack ``[start, end)`` holding the layer holds the storage then when
``reach >= end``:

* a value's own storage: the last layer reading the value (``planner.layer_memory.last_readers``;
  read after ``end``, it is a pack output);
* a storage an autograd node saved: the largest reach of the layer's values whose autograd graph
  reaches that node, where a value's reach, for a value with an autograd node (or that is a layer
  input itself), is the furthest its graph is provably kept: the last layer reading it, or the
  reach of a value whose own graph reaches it (measured: the reader's graph reaches the node that
  made the value, or the leaf standing for it in the reader's layer). A chain of such values that
  leaves the pack passes a pack output, which holds the chain.

While the backward runs, the outputs it does not differentiate are let go, and its last layer's
autograd nodes all run before any of an earlier layer (``LayerHeld``): that layer's backward, run
alone from its outputs into its inputs, says the most it adds.

Each layer runs alone, as ``planner.layer_memory`` runs it, but on FakeTensors of the device the
packs run on, under the planning run's ``AllocationTracker``: a composite op takes the path the
device's kernels take (dropout's mask, attention's weights are the device's), and each storage counts
the bytes the planning run counts. A layer alike to one measured before (a transformer's blocks) is
not run again. What is not measured counts nothing, so the figures never pass what the planning run
holds: a layer whose ops do not run on FakeTensors, a tensor a custom autograd ``Function`` keeps on
its context, an input of the layer saved by it (another layer made it).
"""
from __future__ import annotations

import bisect
import dataclasses
import operator
from typing import Iterable, Mapping, Sequence

import torch
from torch import fx
from torch._subclasses import FakeTensorMode

from harmony_fx.analysis.requires_grad import requires_grad_of, run_node
from harmony_fx.ir import meta
from harmony_fx.ir.tracking import AllocationTracker, storage_key
from harmony_fx.ir.values import differentiable, empty_fake, map_tensors, tensors
from harmony_fx.passes.find_layers import Layer, layer_inputs, layer_signature

__all__ = ["ByReach", "LayerHeld", "measure_held"]


@dataclasses.dataclass(frozen=True)
class ByReach:
    """Storages by reach (see the module docstring): ``reaches`` from the largest down, and
    ``cumulative[i]``: the bytes of those with reach ``reaches[i]`` or more."""

    reaches: tuple[int, ...] = ()
    cumulative: tuple[int, ...] = ()

    def held_until(self, end: int) -> int:
        """Bytes a pack holding this layer and ending before layer ``end`` holds."""
        count = bisect.bisect_right(self.reaches, -end, key=operator.neg)  # reaches fall: their negations rise
        return self.cumulative[count - 1] if count else 0


@dataclasses.dataclass(frozen=True)
class LayerHeld:
    """A layer's storages that a pack's backward begins with (``begins``), those of them it keeps
    while it runs (``during``: the outputs it differentiates, whose gradients it was handed, and what
    autograd saved; the other outputs are let go first), and ``backward``: the most the layer's
    backward adds to what was there, its incoming gradients apart (the weights' and the inputs'
    gradients, its temporaries), which a pack that ends with the layer adds before any node of an
    earlier layer runs (autograd runs a node after every node made after it that it waits for, and
    the earlier layers' nodes were made first). ``backward`` is 0 where it is not provable: the
    layer did not run, or an output is not contiguous (its gradient's strides, which its backward's
    copies depend on, are then not known). ``accumulating``: the same for a later microbatch's
    backward, where the weights' gradients exist and autograd adds each new one into its weight's
    ``.grad`` as soon as it is made (the first's keeps them all)."""

    begins: ByReach = ByReach()
    during: ByReach = ByReach()
    backward: int = 0
    accumulating: int = 0


@dataclasses.dataclass
class _Measured:
    """One layer's run: per value, whether it has an autograd node, the storages it is and those its
    autograd graph saved (indices into ``nbytes``); ``edges``: (value, reader) where the reader's
    graph reaches the value's."""

    has_node: dict[str, bool]
    values: dict[str, set[int]]
    differentiated: dict[str, set[int]]  # of ``values``, the storages of tensors that require grad
    saved: dict[str, set[int]]
    nbytes: list[int]
    edges: list[tuple[str, str]]
    backward: int = 0
    accumulating: int = 0


def measure_held(gm: fx.GraphModule, layers: Sequence[Layer], read_after: Mapping[str, int],
                 device: torch.device) -> list[LayerHeld]:
    """One ``LayerHeld`` per layer of ``gm``; ``read_after``: each value's last reading layer
    (``len(layers)``: the graph's output); ``device``: where the packs run."""
    nodes = {node.name: node for node in gm.graph.nodes}
    measured: list[_Measured | None] = []
    # a layer that repeats one measured before (a transformer's blocks) is that one, renamed
    seen: dict[tuple, tuple[_Measured, list[str]]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), torch.random.fork_rng(devices=[]):
        for layer in layers:
            layer_nodes = [nodes[name] for name in layer.nodes]
            external = layer_inputs(layer_nodes)
            outputs = {name for name in layer.nodes if read_after.get(name, -1) > layer.index}
            names = [node.name for node in layer_nodes + external]
            result: _Measured | None = None
            try:
                signature = layer_signature(layer_nodes, external, outputs)
                if signature in seen:
                    earlier, earlier_names = seen[signature]
                    result = _renamed(earlier, dict(zip(earlier_names, names)))
                else:
                    # a higher-order op (a no_grad region) sets grad mode around its subgraph and
                    # does not put it back if the subgraph raises: the context restores it
                    with torch.enable_grad():
                        result = _measure(gm, layer_nodes, external, device, outputs)
                    seen[signature] = result, names
            except Exception:  # noqa: BLE001 - not runnable on FakeTensors: the layer counts nothing
                result = None
            measured.append(result)
    has_node: dict[str, bool] = {}
    readers: dict[str, list[str]] = {}  # value -> the values whose autograd graph reaches its own
    for layer in measured:
        if layer is not None:
            has_node.update(layer.has_node)
            for value, reader in layer.edges:
                readers.setdefault(value, []).append(reader)
    reach: dict[str, int] = {}
    for node in reversed(gm.graph.nodes):  # readers first
        if has_node.get(node.name):
            reach[node.name] = max([read_after.get(node.name, -1), *(reach.get(r, -1) for r in readers.get(node.name, ()))])
    return [LayerHeld() if layer is None else LayerHeld(_by_reach(layer, layer.values, reach, read_after),
                                                        _by_reach(layer, layer.differentiated, reach, read_after),
                                                        layer.backward, layer.accumulating)
            for layer in measured]


def _by_reach(layer: _Measured, values: Mapping[str, set[int]], reach: Mapping[str, int],
              read_after: Mapping[str, int]) -> ByReach:
    """``values``' storages (an output's, while the pack holds it) and what autograd saved."""
    storage_reach = [-1] * len(layer.nbytes)
    for name, storages in values.items():
        for index in storages:
            storage_reach[index] = max(storage_reach[index], read_after.get(name, -1))
    for name, storages in layer.saved.items():
        for index in storages:
            storage_reach[index] = max(storage_reach[index], reach.get(name, -1))
    pairs = sorted(((r, b) for r, b in zip(storage_reach, layer.nbytes) if r >= 0), reverse=True)
    cumulative, total = [], 0
    for _, nbytes in pairs:
        total += nbytes
        cumulative.append(total)
    return ByReach(tuple(r for r, _ in pairs), tuple(cumulative))


def _renamed(layer: _Measured, names: Mapping[str, str]) -> _Measured:
    return dataclasses.replace(
        layer, has_node={names[k]: v for k, v in layer.has_node.items()},
        values={names[k]: v for k, v in layer.values.items()},
        differentiated={names[k]: v for k, v in layer.differentiated.items()},
        saved={names[k]: v for k, v in layer.saved.items()},
        edges=[(names[value], names[reader]) for value, reader in layer.edges])


def _measure(gm: fx.GraphModule, layer_nodes: list[fx.Node], external: list[fx.Node], device: torch.device,
             outputs: set[str]) -> _Measured:
    """The layer's run (``external``: the values it reads from outside it; ``outputs``: its values
    read after it), then its backward from its outputs into its inputs, as the backward of a pack
    ending with it runs it."""
    inner = {node.name for node in layer_nodes}
    env: dict[str, object] = {node.name: _fresh(node, device) for node in external}
    input_storages = {storage_key(t) for value in env.values() for t in tensors(value)}
    taken = {id(t): name for name, value in env.items() for t in tensors(value)}  # the layer's inputs, by tensor
    made_nodes: dict[str, list] = {}  # value -> the autograd nodes its tensors were made by
    tracker = AllocationTracker()  # what the planning run counts, and its bytes
    for value in env.values():  # on the device already: their views (a weight's ``t()``) add nothing
        for tensor in tensors(value):
            tracker.register(tensor)
    with tracker.mode():
        for node in layer_nodes:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
            value = env[node.name] = run_node(gm, node, args, kwargs)
            del args, kwargs
            made_nodes[node.name] = [t.grad_fn for t in tensors(value) if t.grad_fn is not None]
        del value
    # every value and autograd node stays referenced until here: storage keys are not reused
    made = {key: nbytes for key, nbytes in tracker.storages_since(0).items() if key not in input_storages}
    index_of = {key: index for index, key in enumerate(made)}
    saved_by: dict[int, set[int]] = {}  # id(autograd node) -> the made storages it saved
    attributes: dict[type, tuple[str, ...]] = {}
    result = _Measured({}, {}, {}, {}, list(made.values()), [])
    for node in layer_nodes:
        name = node.name
        # an op that returns its input itself (``to`` its own dtype, ``contiguous`` of a contiguous
        # tensor) keeps, held, the input's autograd node: the input's own, where a layer before made it
        returned = {taken[id(t)] for t in tensors(env[name]) if id(t) in taken}
        result.edges.extend((value, name) for value in returned)
        result.has_node[name] = bool(made_nodes[name] or returned)
        result.values[name] = {index_of[k] for k in map(storage_key, tensors(env[name])) if k in index_of}
        result.differentiated[name] = {index_of[k] for k in (storage_key(t) for t in tensors(env[name]) if t.requires_grad)
                                       if k in index_of}
        reached = _reachable(made_nodes[name])
        saved: set[int] = set()
        for function in reached.values():
            if id(function) not in saved_by:
                saved_by[id(function)] = {index_of[k] for k in map(storage_key, _saved_tensors(function, attributes))
                                          if k in index_of}
            saved |= saved_by[id(function)]
        result.saved[name] = saved
        reached_leaves = {id(f.variable) for f in reached.values()
                          if isinstance(getattr(f, "variable", None), torch.Tensor)}
        for arg in dict.fromkeys(node.all_input_nodes):
            if arg.name in inner:
                hit = any(id(f) in reached for f in made_nodes[arg.name])
            else:
                hit = any(id(t) in reached_leaves for t in tensors(env[arg.name]))
            if hit:
                result.edges.append((arg.name, name))
    # the backward holds its inputs, the outputs it differentiates and what autograd saved; it
    # lets the rest go first, so every other value goes here too
    inputs = [env[node.name] for node in external]
    roots = [t for node in layer_nodes if node.name in outputs for t in tensors(env[node.name]) if t.requires_grad]
    wanted = [t for value in inputs for t in tensors(value) if t.requires_grad]
    env.clear()
    if roots and wanted and all(t.is_contiguous() for t in roots):
        try:
            result.backward = _backward_adds(tracker, roots, lambda incoming: torch.autograd.grad(
                roots, wanted, incoming, allow_unused=True))
        except Exception:  # noqa: BLE001 - a backward that does not run on FakeTensors adds nothing provable
            result.backward = 0
        try:
            result.accumulating = min(_accumulating_backward(gm, layer_nodes, external, device, outputs),
                                      result.backward)
        except Exception:  # noqa: BLE001 - as above
            result.accumulating = 0
    return result


def _accumulating_backward(gm: fx.GraphModule, layer_nodes: list[fx.Node], external: list[fx.Node],
                           device: torch.device, outputs: set[str]) -> int:
    """What the layer's backward adds, its incoming gradients apart, where its weights' gradients
    exist already (a later microbatch's): the layer run again, each weight given a ``.grad``, and
    its backward run as the runtime runs it (``torch.autograd.backward``, whose AccumulateGrad adds
    each new weight gradient into ``.grad`` in place and lets it go)."""
    env: dict[str, object] = {node.name: _fresh(node, device) for node in external}
    tracker = AllocationTracker()
    for node in external:
        for tensor in tensors(env[node.name]):
            tracker.register(tensor)
            if meta.role_of(node) == meta.Role.PARAM and tensor.requires_grad:
                tensor.grad = tracker.register(empty_fake(tensor.shape, tensor.stride(), tensor.dtype, device))
    with tracker.mode():
        for node in layer_nodes:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
            env[node.name] = run_node(gm, node, args, kwargs)
            del args, kwargs
    roots = [t for node in layer_nodes if node.name in outputs for t in tensors(env[node.name]) if t.requires_grad]
    env.clear()
    return _backward_adds(tracker, roots, lambda incoming: torch.autograd.backward(roots, incoming))


def _backward_adds(tracker: AllocationTracker, roots: list[torch.Tensor], backward) -> int:
    """The most ``backward(incoming)`` adds to what ``tracker`` holds, the incoming gradients (ones
    like ``roots``: a pack's backward is handed these, it does not make them) apart."""
    before = tracker.live
    tracker.reset_peak()
    with tracker.mode():
        incoming = [torch.ones_like(t) for t in roots]
        handed = sum(t.untyped_storage().nbytes() for t in incoming)
        backward(incoming)
    return max(tracker.peak - before - handed, 0)


def _fresh(node: fx.Node, device: torch.device) -> object:
    """A layer input as the planning run holds it: a FakeTensor on ``device`` in the graph's dtype,
    a leaf requiring grad as its flags say."""
    value = node.meta[meta.VAL] if node.op != "get_attr" else getattr(node.graph.owning_module, node.target)
    flags = iter(requires_grad_of(node))

    def fresh(t: torch.Tensor) -> torch.Tensor:
        wants = next(flags, False)
        return empty_fake(t.shape, t.stride(), t.dtype, device).requires_grad_(bool(wants) and differentiable(t))

    return map_tensors(fresh, value)


def _reachable(roots: Iterable) -> dict[int, object]:
    """The autograd nodes reachable from ``roots`` (themselves included), by id."""
    seen: dict[int, object] = {}
    stack = list(roots)
    while stack:
        function = stack.pop()
        if id(function) in seen:
            continue
        seen[id(function)] = function
        stack.extend(following for following, _ in function.next_functions if following is not None)
    return seen


def _saved_tensors(function, attributes: dict[type, tuple[str, ...]]) -> list[torch.Tensor]:
    """The tensors an autograd node saved for its backward (its ``_saved_*`` attributes)."""
    kind = type(function)
    if kind not in attributes:
        attributes[kind] = tuple(name for name in dir(function) if name.startswith("_saved_"))
    found: list[torch.Tensor] = []
    for name in attributes[kind]:
        try:
            value = getattr(function, name)
        except Exception:  # noqa: BLE001 - not readable: counted as not saved
            continue
        found.extend(tensors(value) if isinstance(value, (torch.Tensor, list, tuple)) else ())
    return found
