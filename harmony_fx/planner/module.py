"""Predict a compiled module's iteration: its own programs, simulated with its own key sizes.

This is how the cost model is checked against measurements: bytes moved come from the same
actions and key sizes the runtime counts, and memory from the same residency rules. What a compute
task holds beyond its keys (the autograd graph a recompute keeps, the working memory of a task)
comes from the memory profile: each task's net and peak bytes, recorded when the module ran its
programs on FakeTensors to plan (``runtime.probe.Probe``), exact because memory depends on shapes only.
"""
from __future__ import annotations

from harmony_fx.planner.costs import PackCosts, layer_seconds
from harmony_fx.program.actions import Action, Key, KeyKind
from harmony_fx.planner.profile import profile_graph
from harmony_fx.planner.simulate import Simulation, simulate
from harmony_fx.planner.specs import DeviceSpec, HostSpec

__all__ = ["simulate_module", "eager_seconds"]


def simulate_module(hm, spec: DeviceSpec, host: HostSpec = HostSpec()) -> Simulation:
    """Simulate one iteration of ``hm`` (a ``HarmonyModule``) on ``spec``: its device's, for a
    prediction of what it measures (``harmony_fx.calibrate.spec_for(hm.devices[0], hm.budget)``: its
    GPU's preset, or this machine measured for a HostDevice)."""
    size = hm.mb_sizes[0] or _batch_of(hm)
    # captured in the compute dtype: the graph's bytes are the devices' (no itemsize to apply)
    profile = profile_graph("model", hm.captured.gm, size, None, hm.options.precision, _device_type(hm))
    sizes = [s or size for s in hm.compiled.layout.sizes]  # the larger forward microbatches too
    programs = [forward + backward for forward, backward in hm.device_actions]
    measured = {key: value for memory in hm.task_memory for key, value in memory.items()}
    key_bytes = hm.key_bytes
    if hm.compiled.resident_weights:  # handed over where they live: nothing crosses, nothing new is held
        key_bytes = lambda key: 0 if key.kind in (KeyKind.WEIGHTS, KeyKind.WGRAD) else hm.key_bytes(key)  # noqa: E731
    costs = _MeasuredCosts(profile, [pack.layers for pack in hm.packs], sizes, spec, host, key_bytes,
                           measured, [a for program in programs for a in program],
                           {pack: len(group) for pack, group in hm.update_groups().items()})
    return simulate(programs, costs, spec, host, hm.update_arrivals)


def eager_seconds(hm, spec: DeviceSpec) -> float:
    """What one eager training step of ``hm``'s model takes on ``spec``, by the same cost model:
    every layer's forward and backward on the whole batch, nothing copied, the optimizer on the
    device (reading and writing each parameter, its gradient and two moments: 28 bytes, at memory
    bandwidth): the figure a simulated harmony step on a GPU preset is set beside."""
    batch = _batch_of(hm)
    profile = profile_graph("model", hm.captured.gm, batch, None, hm.options.precision, _device_type(hm))
    compute = sum(sum(layer_seconds(layer, batch, spec, profile.precision)) for layer in profile.layers)
    return compute + 28 * profile.num_params / spec.memory_bandwidth


def _device_type(hm) -> str:
    return hm.devices[0].torch_device.type


def _batch_of(hm) -> int:
    compiled = hm.compiled
    return max((spec[0][d] for spec, d in zip(compiled.input_specs, compiled.flat_dims) if d is not None), default=1)


class _MeasuredCosts(PackCosts):
    """``PackCosts`` whose graph sizes and working memory are the measured ones."""

    def __init__(self, profile, pack_layers, sizes, spec, host, key_bytes, measured, actions: list[Action],
                 tensors: dict[int, int]) -> None:
        super().__init__(profile, pack_layers, sizes, spec, host, key_bytes)
        self.measured = measured
        self.graph_makers = {key: a for a in actions for key in a.writes if key.kind == KeyKind.GRAPH}
        self.tensors = tensors  # per pack: the parameter tensors the host updates

    def update_seconds(self, pack: int) -> float:
        """Its parameters at the host optimizer's throughput, its fixed cost per tensor, and per call
        (one optimizer step per pack)."""
        return (super().update_seconds(pack) + self.tensors.get(pack, 0) * self.host.update_tensor_seconds
                + self.host.update_call_seconds)

    def key_bytes(self, key: Key) -> int:
        if key.kind != KeyKind.GRAPH:
            return self._key_bytes(key)
        # the task that made the graph grew memory by its net bytes: its other new keys, and the
        # graph, which also keeps the inputs it consumed alive
        maker = self.graph_makers[key]
        net, _ = self.measured[(maker.kind.value, maker.pack, maker.mb)]
        others = sum(self._key_bytes(k) for k in maker.writes if k.kind not in (KeyKind.WEIGHTS, KeyKind.WGRAD, KeyKind.GRAPH))
        consumed = sum(self._key_bytes(k) for k in maker.consumes)
        return max(net - others + consumed, 0)

    def task_peak(self, action: Action, allocated: int = 0) -> int:
        return self.measured[(action.kind.value, action.pack, action.mb)][1]
