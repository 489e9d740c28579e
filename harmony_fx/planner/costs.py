"""Costs of a program's tasks, from a ``ModelProfile`` and a ``DeviceSpec``, for the simulator.

A task on pack ``p`` and a microbatch of ``m`` samples costs its layers' measured seconds at ``m``
(interpolated) or, without measurements, the spec's roofline over their FLOPs and bytes and the
spec's fixed cost of a task (``launch_seconds``) once. The backward is twice the forward's FLOPs.
A task's peak memory (``task_peak``): its new keys plus the largest working set of one of its
layers for that microbatch (measured: a forward's temporaries, a backward's gradients and
temporaries), since layers run one after another; the autograd graph a forward with autograd
leaves is the ``graph`` key: what each layer's forward kept (saved tensors and outputs) and what
its first layer saved of the pack's input.
"""
from __future__ import annotations

from typing import Callable, Sequence

from harmony_fx.planner.profile import ModelProfile
from harmony_fx.planner.specs import DeviceSpec, HostSpec
from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind

__all__ = ["PackCosts", "layer_seconds", "graph_bytes", "chain_key_bytes"]


class PackCosts:
    """``pack_layers[p]``: the profile's layer indices in pack ``p``; ``sizes[mb]``: samples in
    microbatch ``mb``; ``key_bytes``: the program's key sizes (GRAPH keys are sized here)."""

    def __init__(self, profile: ModelProfile, pack_layers: Sequence[Sequence[int]], sizes: Sequence[int],
                 spec: DeviceSpec, host: HostSpec, key_bytes: Callable[[Key], int]) -> None:
        self.profile, self.sizes, self.spec, self.host = profile, list(sizes), spec, host
        self.pack_layers = [[profile.layers[i] for i in layers] for layers in pack_layers]
        # per sample, what is live before each pack's first layer
        self._pack_inputs = [profile.input_bytes if layers[0] == 0 else profile.layers[layers[0] - 1].out_bytes
                             for layers in pack_layers]
        self._key_bytes = key_bytes
        self._seconds: dict[tuple[K, int, int], float] = {}
        self._work: dict[tuple, int] = {}  # a task's working set above its new keys (``task_peak``)
        self._bytes: dict[Key, int] = {}

    def key_bytes(self, key: Key) -> int:
        # the simulator and ``task_peak`` ask for the same keys again and again (a pack's weight
        # gradients sum over its layers): each is worked out once
        nbytes = self._bytes.get(key)
        if nbytes is None:
            if key.kind == KeyKind.GRAPH:
                pack = int(key.name[1:])
                nbytes = int(graph_bytes(self.pack_layers[pack], self._pack_inputs[pack]) * self.sizes[key.mb])
            else:
                nbytes = self._key_bytes(key)
            self._bytes[key] = nbytes
        return nbytes

    def compute_seconds(self, action: Action) -> float:
        size = self.sizes[action.mb]
        cache_key = (action.kind, action.pack, size)
        if cache_key not in self._seconds:
            layers = self.pack_layers[action.pack]
            # measured seconds hold the runtime's own cost; a roofline's task pays the spec's once
            launch = 0.0 if any(layer.seconds for layer in layers) else self.spec.launch_seconds
            self._seconds[cache_key] = sum(self._layer_seconds(layer, action.kind, size) for layer in layers) + launch
        return self._seconds[cache_key]

    def _layer_seconds(self, layer, kind: K, size: int) -> float:
        forward_ops = self.spec.recompute_ops if kind == K.RECOMPUTE else 1.0
        forward, backward = layer_seconds(layer, size, self.spec, self.profile.precision, forward_ops, launch=False)
        return backward if kind == K.BWD else forward

    def task_peak(self, action: Action, allocated: int = 0) -> int:
        """Its new keys, and the largest working set of one of its layers for this microbatch on
        top: a backward's, or a forward's (with autograd or without)."""
        size = self.sizes[action.mb]
        if action.kind != K.BWD:
            # the graph key counts what autograd saved of the pack's input, which the task's input
            # key holds until the task ends: not twice
            graph = any(key.kind == KeyKind.GRAPH for key in action.writes)
            held = sum(self.key_bytes(key) for key in (*action.reads, *action.consumes)
                       if key.kind == KeyKind.ACT) if graph else 0
            cache_key = (action.kind, action.pack, size, graph, held)
        else:
            # ``allocated`` is what its new keys take: where the weight gradients' key is not among
            # them (a later microbatch's backward), autograd makes each layer's gradients afresh and
            # adds them into the key's, so they are working memory too. A layer's measured working
            # set holds its incoming and outgoing gradients: at the pack's edges those are keys,
            # resident (the output's gradient) or among the new ones (the input's)
            written = grads_out = 0
            for key in action.writes:
                nbytes = self.key_bytes(key)
                written += nbytes
                grads_out += nbytes if key.kind == KeyKind.GRAD else 0
            grads_in = sum(self.key_bytes(key) for key in action.consumes if key.kind == KeyKind.GRAD)
            cache_key = (action.kind, action.pack, size, allocated < written, grads_in, min(allocated, grads_out))
        if cache_key not in self._work:  # a simulation asks for the same task on every microbatch
            self._work[cache_key] = self._work_bytes(*cache_key)
        return allocated + self._work[cache_key]

    def _work_bytes(self, kind: K, pack: int, size: int, *edges) -> int:
        layers = self.pack_layers[pack]
        if kind != K.BWD:
            graph, held = edges
            work = int(max(layer.forward_work_bytes for layer in layers) * size)
            if not graph:
                return work
            saved = min(self._pack_inputs[pack], sum(layer.saved_input_bytes for layer in layers)) * size
            return work - int(min(saved, held))
        accumulating, grads_in, grads_out = edges
        last = len(layers) - 1

        def work(index: int, layer) -> float:
            at_edges = (min(layer.grad_in_bytes * size, grads_in) if index == last else 0) \
                + (min(layer.grad_out_bytes * size, grads_out) if index == 0 else 0)
            return max(layer.backward_work_bytes * size - at_edges, 0) + (layer.param_bytes if accumulating else 0)
        return int(max(work(index, layer) for index, layer in enumerate(layers)))

    def pack_params(self, pack: int) -> int:
        return sum(layer.num_params for layer in self.pack_layers[pack])

    def update_seconds(self, pack: int) -> float:
        return self.pack_params(pack) / self.host.update_params_per_second


def graph_bytes(layers: Sequence, input_bytes: float) -> float:
    """Per sample, the autograd graph a forward with autograd leaves over ``layers`` (a pack, in
    order): what each kept of what it made, and of the pack's input (``input_bytes``, what is live
    before its first layer) what its layers saved, at most all of it."""
    return sum(layer.saved_bytes for layer in layers) + min(input_bytes, sum(layer.saved_input_bytes for layer in layers))


def layer_seconds(layer, size: int, spec: DeviceSpec, precision: str, forward_ops: float = 1.0,
                  launch: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of one layer on a microbatch of ``size``: measured
    (interpolated) when the profile has them, else the spec's roofline, the backward twice the
    forward's FLOPs and bytes. Issuing the forward's ops costs ``forward_ops`` times their
    ``op_seconds`` (a recompute: ``spec.recompute_ops``), the backward's ``spec.backward_ops`` times.
    ``launch``: the roofline includes the spec's fixed cost of a task (``launch=False`` where the
    caller charges it once per task of several layers)."""
    measured = layer.measured(size)
    if measured is not None:
        return measured
    issue = layer.num_ops * spec.op_seconds
    forward = spec.compute_seconds(layer.fwd_flops * size, layer.made_bytes * size + layer.param_bytes, precision,
                                   launch)
    backward = spec.compute_seconds(2 * layer.fwd_flops * size, 2 * layer.made_bytes * size + layer.param_bytes,
                                    precision, launch)
    if spec.inline:  # the ops run as they are issued: their issue cost adds up
        return forward + forward_ops * issue, backward + spec.backward_ops * issue
    # a GPU runs while the host issues: a task takes the longer of the two
    return max(forward, forward_ops * issue), max(backward, spec.backward_ops * issue)


def chain_key_bytes(profile: ModelProfile, pack_layers: Sequence[Sequence[int]],
                    sizes: Sequence[int]) -> Callable[[Key], int]:
    """Key sizes of a layer-chain program (``planner.chain``): ``act[x{i}@mb]`` is what is live
    before layer ``i``; weights are the pack's parameters in the compute dtype, their gradients
    in fp32 (summed and copied in the masters' dtype)."""
    layers = profile.layers

    def key_bytes(key: Key) -> int:
        if key.kind in (KeyKind.ACT, KeyKind.GRAD):
            i = int(key.name[1:])
            per_sample = profile.input_bytes if i == 0 else layers[i - 1].out_bytes
            if i == len(layers):  # the model's outputs: a Trainer's loss (4 bytes), or what a module returns
                return max(4, int(per_sample * sizes[key.mb]))
            return int(per_sample * sizes[key.mb])
        if key.kind == KeyKind.WEIGHTS:
            return sum(layers[i].param_bytes for i in pack_layers[int(key.name[1:])])
        if key.kind == KeyKind.WGRAD:
            return sum(4 * layers[i].num_params for i in pack_layers[int(key.name[1:])])
        return 0
    return key_bytes
