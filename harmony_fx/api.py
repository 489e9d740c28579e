"""``harmony_fx.compile``: capture → analyze → plan packs → lower → verify → codegen → run.

Every stage's artifact stays on the ``HarmonyModule``: ``captured`` (the model's graph at the first
microbatch's size), ``packs`` (one GraphModule each), ``forward_actions``/``backward_actions`` (the
schedule), ``programs`` (the generated GraphModules, printed by ``code``), ``plan`` and, after a
call, ``stats``.

Microbatches of different sizes (a batch of 10 in 4) each get the graph captured at their size
(export bakes sizes into reshapes); the packs of every size share the boundaries and names.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import traceback
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch._subclasses import FakeTensorMode

from harmony_fx import pictures
from harmony_fx.frontend import microbatch
from harmony_fx.analysis.batch_dims import BatchAnalysis, analyze_batch_dims
from harmony_fx.analysis.liveness import annotate_liveness
from harmony_fx.analysis.requires_grad import annotate_requires_grad, any_requires_grad, requires_grad_of
from harmony_fx.analysis.sizes import annotate_sizes
from harmony_fx.frontend.capture import Captured, capture
from harmony_fx.config import CompileOptions
from harmony_fx.ir import meta
from harmony_fx.ir import values as pytrees
from harmony_fx.program.codegen import generate_program
from harmony_fx.program.ops import OP_OF_KIND
from harmony_fx.ir.pack import Pack
from harmony_fx.passes.find_layers import Layer, find_layers
from harmony_fx.lowering.pipeline import lower_pipeline
from harmony_fx.lowering.single import ProgramSignature, grad_inputs, lower_program
from harmony_fx.compiler.packing import BudgetTooSmallError, balanced, plan_packs
from harmony_fx.passes.retarget_device import retarget_device
from harmony_fx.passes.split_packs import split_packs
from harmony_fx.planner.chain import Schedule
from harmony_fx.planner.choose import choose_schedule
from harmony_fx.runtime.devices import Device, HostDevice, resolve_devices
from harmony_fx.runtime.executor import HostState, Runtime, Stats
from harmony_fx.program.actions import Action, ActionKind, Key, KeyKind
from harmony_fx.program.format import format_schedule
from harmony_fx.compiler.plan import PackPlan, Plan
from harmony_fx.program.traffic import bytes_moved
from harmony_fx.program.verify import check_peak, verify_devices, verify_packs, verify_program

__all__ = ["compile", "HarmonyModule"]


def compile(model: nn.Module, example_inputs: tuple | torch.Tensor | None = None, example_kwargs: dict | None = None, *,
            devices: object = None, memory_budget: int | str | None = None, microbatches: int | None = None,
            parallel: str = "auto", **options: Any) -> "HarmonyModule":
    """Compile ``model`` for training larger than device memory.

    With example inputs (positional, and ``example_kwargs``) the model is captured and planned now;
    without them, on the first call, with that call's inputs (as ``torch.compile`` does). Either way
    a batch of another size is planned on its first call. The options are ``CompileOptions``'."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"harmony_fx.compile expects an nn.Module, got {type(model).__name__}")
    opts = CompileOptions(devices=devices, memory_budget=memory_budget, microbatches=microbatches,
                          parallel=parallel, **options)
    if example_inputs is None and example_kwargs is None:
        return HarmonyModule(model, None, None, opts)
    if not isinstance(example_inputs, tuple):
        example_inputs = () if example_inputs is None else (example_inputs,)
    return HarmonyModule(model, example_inputs, dict(example_kwargs or {}), opts)


@dataclasses.dataclass
class _Variant:
    """The model captured at one microbatch size."""

    size: int | None
    captured: Captured
    layers: list[Layer]
    nodes: dict[str, fx.Node]


@dataclasses.dataclass
class _Candidate:
    """One packing, lowered, verified and run on FakeTensors."""

    packs_by_size: dict[int | None, list[Pack]]
    device_actions: list[tuple[list[Action], list[Action]]]  # (forward, backward) per device
    peaks: list[int]
    # per device: (kind, pack, mb) -> (net bytes, peak bytes above the start) of each compute task
    task_memory: list[dict[tuple[str, int, int], tuple[int, int]]]
    # per device: (index in forward + backward, action) after which its program first holds its peak
    peak_at: list[tuple[int, Action] | None] = dataclasses.field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.peaks)


class HarmonyModule:
    """A compiled model: call it like the model; ``loss.backward()`` runs the harmony backward.

    ``example_args=None``: nothing is captured until the first call, which compiles with its own
    inputs; until then what the plan makes (``plan``, ``code``, ``explain()``, ``stats``, ...) does
    not exist, and asking for it says so.

    ``_trainer``: the model's output is a scalar loss per microbatch, the last pack runs forward,
    loss and backward as one task, and (``_update_packs``) the host updates parameters as soon as
    their gradients are complete. Used by ``harmony_fx.Trainer``.
    """

    def __init__(self, model: nn.Module, example_args: tuple | None, example_kwargs: dict | None,
                 options: CompileOptions, _trainer: bool = False, _updates: bool = False, _plan: bool = True) -> None:
        self.model = model
        self.options = options
        if example_args is None:
            self._first_call = (_trainer, _updates)  # compiled by __call__
            return
        self.__dict__.pop("_first_call", None)
        self.devices: list[Device] = resolve_devices(options.devices, options.memory_budget, options.track_memory,
                                                     options.chaos)
        self.device = self.devices[0]
        self.budget = self.device.budget
        self._trainer = _trainer
        example = (example_args, example_kwargs)
        self._example_dims = microbatch.argument_dims(model, example_args, example_kwargs, options.batch_dims)
        # the batch dim of each tensor input, in the order of the captured graph's inputs
        self._flat_dims = [d for x, d in zip(microbatch.pytree.tree_leaves(example),
                                             microbatch.pytree.tree_leaves(self._example_dims))
                           if isinstance(x, torch.Tensor)]
        self._variants: dict[int | None, _Variant] = {}
        # whether cutting the batch computes what the whole batch does (analysis.batch_dims)
        self.batch_analysis: BatchAnalysis | None = None
        self.num_microbatches = options.microbatches or len(self.devices)
        # the planner chooses what the options leave open (planner/choose.py)
        self.schedule: Schedule | None = None
        if _plan and options.pack_boundaries is None and (
                options.microbatches is None or (options.parallel == "auto" and len(self.devices) > 1)):
            self.schedule = self._choose_schedule(model, example_args, example_kwargs)
        # larger forward packs for these boundaries: (boundaries, first pack of each forward group)
        self._forward_groups: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        if options.forward_groups is not None:
            self._forward_groups = (tuple(options.pack_boundaries), tuple(options.forward_groups))
        elif self.schedule is not None and self.schedule.forward_groups:
            self._forward_groups = (self.schedule.boundaries, self.schedule.forward_groups)
        parallel = options.parallel if self.schedule is None else self.schedule.parallel
        if self.schedule is not None:
            self.num_microbatches = self.schedule.microbatches
        num_devices = len(self.devices)
        self.parallel = "single" if num_devices == 1 else ("pp" if parallel == "pp" else "dp")
        if self.parallel == "pp":
            # every device runs its packs on every microbatch
            self.device_microbatches = [tuple(range(self.num_microbatches))] * num_devices
        else:
            if self.num_microbatches < num_devices:
                raise ValueError(f"microbatches={self.num_microbatches} is fewer than the {num_devices} devices: "
                                 "data-parallel needs at least one microbatch per device.")
            # device d runs a contiguous run of microbatches
            sizes = microbatch.microbatch_sizes(self.num_microbatches, num_devices)
            starts = [sum(sizes[:d]) for d in range(num_devices)]
            self.device_microbatches = [tuple(range(start, start + n)) for start, n in zip(starts, sizes)]
        # how many devices report each pack's UPDATE: every one in dp, the one running its backward in pp
        self.update_arrivals = num_devices if self.parallel == "dp" else 1
        if self.num_microbatches > 1:
            self.mb_sizes = microbatch.microbatch_sizes(microbatch.batch_size(example, self._example_dims),
                                                        self.num_microbatches)
        else:
            self.mb_sizes = [None]
        example_mbs = microbatch.split_call(example, self._example_dims, [s for s in self.mb_sizes if s] or [0])
        if self.num_microbatches > 1:
            self._variants.pop(None, None)  # the planner's whole-batch capture
        for size, (mb_args, mb_kwargs) in zip(self.mb_sizes, example_mbs):
            if size not in self._variants:
                self._variants[size] = self._capture_variant(model, size, mb_args, mb_kwargs)
        if self.batch_analysis is None:
            self.batch_analysis = self._analyze_batch_of(example)
        # the dim each output's microbatches are joined along (an output batched along dim 1, say)
        self._output_dims = dict(self.batch_analysis.output_dims) if self.batch_analysis else {}
        primary = self._variants[self.mb_sizes[0]]
        self.captured, self.layers, self._nodes = primary.captured, primary.layers, primary.nodes
        if options.precision == "bf16":
            _refuse_fixed_float_casts(self.captured.gm)
        self._masters = {**self.captured.params, **self.captured.buffers}
        self._example_flat = self.captured.flatten_inputs(*example_mbs[0])
        self._output_args = list(self.captured.gm.graph.find_nodes(op="output")[0].args[0])
        self._updates = _updates
        self.signature = self._signature([x.requires_grad for x in self._example_flat], _trainer)
        policy = balanced if options.pack_boundaries is None else _fixed(options.pack_boundaries)
        if self.schedule is not None:
            try:  # the planner's packs, unless its estimate was optimistic
                boundaries, best = plan_packs(self._layer_costs(), self._evaluate, lambda c: c.peak, self.budget,
                                              _fixed(self.schedule.boundaries), self.device.margin)
                policy = None
            except BudgetTooSmallError:
                # plan as if the planner had not run (what a too-small budget's message describes)
                self.__init__(model, example_args, example_kwargs, options, _trainer, _updates, _plan=False)
                return
        if policy is not None:
            boundaries, best = plan_packs(self._layer_costs(), self._evaluate, lambda c: c.peak, self.budget, policy,
                                          self.device.margin)
        self._packs_by_size = best.packs_by_size
        self.packs = best.packs_by_size[self.mb_sizes[0]]
        annotate_liveness(self.captured.gm)
        self.device_actions = best.device_actions
        self.task_memory = best.task_memory
        self.forward_actions, self.backward_actions = best.device_actions[0]
        published = frozenset(a.event for pair in best.device_actions for actions in pair for a in actions
                              if a.kind == ActionKind.WAIT and a.peer is not None)
        self.device_programs = [
            {phase: generate_program(actions, self._steps(actions), f"Harmony{phase.title()}", published)
             for phase, actions in zip(("forward", "backward"), pair)}
            for pair in best.device_actions
        ]
        if num_devices == 1:
            self.programs = self.device_programs[0]
        else:
            self.programs = {f"{device.name} {phase}": program for device, programs in zip(self.devices, self.device_programs)
                             for phase, program in programs.items()}
        self.plan = self._make_plan(best, "planner" if policy is None else
                                    "balanced" if options.pack_boundaries is None else "fixed")
        self.host_state = _host_state(self.packs, self._masters)
        self.stats = Stats()

    def __getattr__(self, name: str) -> Any:
        # only reached for what __init__ did not set: before the first call of compile(model)
        if "_first_call" in self.__dict__ and not name.startswith("__"):
            raise AttributeError(
                f"HarmonyModule.{name} exists after the first call: harmony_fx.compile(model) without example "
                "inputs captures and plans the model when it is first called (as torch.compile does). Call it "
                "once (hm(*inputs)), or pass example inputs: harmony_fx.compile(model, (x,)).")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def close(self) -> None:
        """Stop the devices' stream threads (chaos mode) and the per-device controller threads; the
        module is unusable afterwards."""
        for device in getattr(self, "devices", ()):
            device.streams.close()
        if getattr(self, "_device_threads", None) is not None:
            self._device_threads.shutdown(wait=True)
        for resized in getattr(self, "_resized", {}).values():
            resized.close()

    # ------------------------------------------------------------------ what people look at
    @property
    def code(self) -> str:
        return "\n".join(f"# ---- {name} program ----{program.code}" for name, program in self.programs.items())

    def save_trace(self, path) -> None:
        """The last iteration's measured timeline as a Chrome trace (see ``harmony_fx.pictures``)."""
        pictures.save_trace(self, path)

    def plot_memory(self, path) -> None:
        """Memory over the last iteration per device, measured and predicted, as a PNG."""
        pictures.plot_memory(self, path)

    def explain(self) -> str:
        """The plan's table, then the schedule: one column per device, one row per compute task."""
        return self.plan.table() + "\n\n" + format_schedule(
            [forward + backward for forward, backward in self.device_actions], [d.name for d in self.devices])

    # ------------------------------------------------------------------ planning
    def _choose_schedule(self, model: nn.Module, args: tuple, kwargs: dict) -> Schedule | None:
        try:
            batch = microbatch.batch_size((args, kwargs), self._example_dims)
        except ValueError:
            return None  # no batch to cut
        if batch < 1:
            return None
        whole = self._variants[None] = self._capture_variant(model, None, args, kwargs)
        self.batch_analysis = self._analyze_batch(whole, batch)
        return choose_schedule(whole.captured.gm, model, batch, self.devices, self.budget, self.options,
                               self.batch_analysis.separable)

    def _analyze_batch_of(self, example: tuple[tuple, dict]) -> BatchAnalysis:
        """``_analyze_batch`` of the largest variant captured (the whole batch's, with one microbatch)."""
        if self.mb_sizes != [None]:
            largest = max(self.mb_sizes)
            return self._analyze_batch(self._variants[largest], largest)
        try:
            batch = microbatch.batch_size(example, self._example_dims)
        except ValueError as error:
            return BatchAnalysis(False, str(error))
        return self._analyze_batch(self._variants[None], batch)

    def _analyze_batch(self, variant: _Variant, batch: int) -> BatchAnalysis:
        """Whether this variant's graph treats the samples apart (and its outputs' batch dims), and
        whether each scalar output (a loss) can be put back together from microbatches."""
        captured = variant.captured
        if batch < 2:
            return BatchAnalysis(False, "a batch of one sample has nothing to cut")
        analysis = analyze_batch_dims(captured.gm, dict(zip(captured.inputs, self._flat_dims)), batch)
        unknown = [reduction.why for name, reduction in captured.reductions.items() if reduction.combine is None]
        if analysis.separable and unknown:
            return BatchAnalysis(False, unknown[0])
        return analysis

    def _capture_variant(self, model: nn.Module, size: int | None, args: tuple, kwargs: dict) -> _Variant:
        captured = capture(model, args, kwargs)
        retarget_device(captured.gm, self.device.torch_device)
        annotate_sizes(captured.gm)
        flags = {name: x.requires_grad for name, x in zip(captured.inputs, captured.flatten_inputs(args, kwargs))}
        flags.update({name: param.requires_grad for name, param in captured.params.items()})
        annotate_requires_grad(captured.gm, flags)
        layers = find_layers(captured.gm)
        variant = _Variant(size, captured, layers, {node.name: node for node in captured.gm.graph.nodes})
        if self._variants:
            first = next(iter(self._variants.values()))
            if [layer.nodes for layer in layers] != [layer.nodes for layer in first.layers]:
                raise ValueError(f"the model's graph at microbatch size {size} differs from the graph at size "
                                 f"{first.size}; use a batch size divisible by microbatches={self.num_microbatches}.")
        return variant

    def _signature(self, requires_grad: Sequence[bool], trainer: bool) -> ProgramSignature:
        differentiable = [n.name for n in self._nodes.values()
                          if any_requires_grad(n) and meta.role_of(n) not in (meta.Role.PARAM, meta.Role.BUFFER)]
        for arg in self._output_args:
            if isinstance(arg, fx.Node) and arg.op == "placeholder":
                raise ValueError(f"the model returns its input or state {arg.name!r} unchanged; harmony_fx needs every "
                                 "output to be computed by the model (return a copy, e.g. x.clone()).")
        outputs = [arg.name for arg in self._output_args if isinstance(arg, fx.Node)]
        inputs_requiring_grad = [name for name, flag in zip(self.captured.inputs, requires_grad) if flag]
        return ProgramSignature(tuple(self.captured.inputs), tuple(dict.fromkeys(outputs)),
                                frozenset(inputs_requiring_grad), frozenset(differentiable),
                                tuple(range(self.num_microbatches)), grouping=self.options.grouping, fuse_last=trainer)

    def _layer_costs(self) -> list[int]:
        costs = []
        for layer in self.layers:
            nodes = [self._nodes[name] for name in layer.nodes]
            state = {read for node in nodes for read in node.meta[meta.READS]}
            costs.append(sum(meta.nbytes_of(self._nodes[s]) for s in state) + sum(meta.nbytes_of(n) for n in nodes))
        return costs

    def _evaluate(self, boundaries: list[int]) -> _Candidate:
        packs_by_size = {size: split_packs(v.captured.gm, v.layers, boundaries, {**v.captured.params, **v.captured.buffers})
                         for size, v in self._variants.items()}
        packs = packs_by_size[self.mb_sizes[0]]
        update_packs = frozenset(self.update_groups(packs)) if self._updates else frozenset()
        if self.parallel == "pp":
            signature = dataclasses.replace(self.signature, update_packs=update_packs)
            device_actions = lower_pipeline(packs, signature, len(self.devices))
        else:
            planned = self._forward_groups
            groups = planned[1] if planned and tuple(boundaries) == planned[0] else ()
            device_actions = [lower_program(packs, dataclasses.replace(self.signature, microbatches=mbs,
                                                                       update_packs=update_packs, forward_groups=groups))
                              for mbs in self.device_microbatches]
        if self.options.verify:
            for variant in self._variants.values():
                verify_packs(variant.captured.gm)
            self.verify(device_actions, update_packs)
        task_memory = [{} for _ in self.devices]
        peak_at: list[tuple[int, Action] | None] = []
        peaks = [self._fake_peak(packs_by_size, forward, backward, mbs, device, memory, peak_at)
                 for (forward, backward), mbs, device, memory
                 in zip(device_actions, self.device_microbatches, self.devices, task_memory)]
        return _Candidate(packs_by_size, device_actions, peaks, task_memory, peak_at)

    def verify(self, device_actions: Sequence[tuple[Sequence[Action], Sequence[Action]]],
               update_packs: frozenset[int] = frozenset()) -> None:
        """Run the program verifier over ``(forward, backward)`` actions per device, as compiling
        does; raises ``ProgramError`` naming the offending action and the pass that made it."""
        if self.parallel == "pp":
            signature = dataclasses.replace(self.signature, update_packs=update_packs)
            offloaded = [a.key for pair in device_actions for actions in pair for a in actions
                         if a.kind == ActionKind.OFFLOAD]
            for forward, backward in device_actions:
                self._verify(list(forward), list(backward), signature, elsewhere=offloaded)
            verify_devices([list(forward) + list(backward) for forward, backward in device_actions])
            return
        for (forward, backward), mbs in zip(device_actions, self.device_microbatches):
            signature = dataclasses.replace(self.signature, microbatches=mbs, update_packs=update_packs)
            self._verify(list(forward), list(backward), signature)

    def update_groups(self, packs: Sequence[Pack] | None = None) -> dict[int, list[nn.Parameter]]:
        """``{pack index: the parameters the host updates after that pack's backward}``: each
        trainable parameter goes with the lowest-index pack that uses it, the last to add to its
        gradient (backward runs packs in reverse)."""
        groups: dict[int, list[nn.Parameter]] = {}
        seen: set[int] = set()
        for pack in packs if packs is not None else self.packs:
            for name in pack.params:
                param = self._masters[name]
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    groups.setdefault(pack.index, []).append(param)
        return groups

    def _verify(self, forward: list[Action], backward: list[Action], signature: ProgramSignature,
                elsewhere: Sequence[Key] = ()) -> None:
        """``elsewhere``: host keys other devices' programs write (their waits are checked across
        devices by ``verify_devices``)."""
        mbs = signature.microbatches
        host_keys = [Key(KeyKind.ACT, v, mb) for v in signature.model_inputs for mb in mbs] + list(elsewhere)
        grad_keys = [Key(KeyKind.GRAD, v, mb) for v in signature.model_outputs for mb in mbs]
        if signature.fuse_last:
            host_keys += grad_keys
        forward_results = [a.key for a in forward if a.kind == ActionKind.OFFLOAD
                           and (a.key.kind != KeyKind.ACT or a.key.name in signature.model_outputs)]
        verify_program(forward, host_keys, forward_results)
        # the backward program continues from the forward's state: check them as one
        backward_results = [a.key for a in backward if a.kind == ActionKind.OFFLOAD]
        verify_program(forward + backward, host_keys + grad_keys, backward_results)

    def _fake_peak(self, packs_by_size, forward: list[Action], backward: list[Action], mbs: Sequence[int],
                   target: Device, task_memory: dict | None = None, peak_at: list | None = None) -> int:
        """Run one device's programs on FakeTensors on a tracked HostDevice: its static peak (and,
        into ``task_memory``, each compute task's net and peak bytes: see ``Runtime._probed``; onto
        ``peak_at``, the ``(index, action)`` of ``forward + backward`` after which it first holds
        the peak, which ``check_peak`` names)."""
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        device = HostDevice("fake", None)
        programs = [generate_program(actions, [""] * len(actions), "Fake") for actions in (forward, backward)]
        packs = packs_by_size[self.mb_sizes[0]]
        where = target.torch_device
        with fake_mode, torch.random.fork_rng(devices=[]):
            fake = {name: _fake_like(t, where) for name, t in self._masters.items()}
            host = _host_state(packs, fake)
            runtime = self._runtime(packs_by_size, device, host, Stats())
            runtime.peer_value = lambda key: self._fake_value(key, where)
            runtime.host_values = _MadeOnDemand(lambda key: self._fake_value(key, where))
            for mb in mbs:
                nodes = self._variants[self.mb_sizes[mb]].nodes
                for name in self.signature.model_inputs:
                    runtime.host_values[Key(KeyKind.ACT, name, mb)] = self._fake_value(Key(KeyKind.ACT, name, mb), where)
                for name in self.signature.model_outputs:
                    if name in self.signature.differentiable:
                        key = Key(KeyKind.GRAD, name, mb)
                        runtime.host_values[key] = self._fake_value(key, where)
            runtime.task_memory = task_memory if task_memory is not None else {}
            traced = _PeakTrace(runtime)
            programs[0](traced)
            programs[1](traced)
        peak = max(device.peak_bytes(), runtime.probe_peak)
        if peak_at is not None:
            actions = forward + backward
            first = next((i for i, seen in enumerate(traced.peaks) if seen >= peak), None)
            peak_at.append(None if first is None else (first, actions[first]))
        return peak

    def _value_of(self, key: Key) -> object:
        """The FakeTensor value (a tensor or a pytree of them) of an activation on microbatch
        ``key.mb``, or of its gradient: the value's structure, ``None`` at the leaves without one."""
        node = self._variants[self.mb_sizes[key.mb]].nodes[key.name]
        value = node.meta[meta.VAL]
        if key.kind == KeyKind.GRAD:
            flags = requires_grad_of(node)
            value = pytrees.with_leaves(value, [leaf if flag else None
                                                for leaf, flag in zip(pytrees.leaves(value), flags, strict=True)])
        return value

    def _fake_value(self, key: Key, where: torch.device) -> object:
        return pytrees.map_tensors(lambda t: _fake_like(t, where), self._value_of(key))

    def _runtime(self, packs_by_size, device: Device, host: HostState, stats: Stats,
                 on_update: Callable[[Runtime, int], None] | None = None, shared: Runtime | None = None,
                 index: int = 0) -> Runtime:
        packs = packs_by_size[self.mb_sizes[0]]
        return Runtime([packs_by_size[size] for size in self.mb_sizes], device, host,
                       [grad_inputs(pack, self.signature) for pack in packs], stats, on_update,
                       self.options.compute_dtype, shared, index)

    def key_bytes(self, key: Key) -> int:
        """Bytes of a key as the plan counts them (from shapes and the compute dtype alone)."""
        if key.kind in (KeyKind.ACT, KeyKind.GRAD):
            return pytrees.value_bytes(self._value_of(key), self._moved_itemsize)
        pack = self.packs[int(key.name[1:])]
        if key.kind == KeyKind.WEIGHTS:
            names = pack.params + pack.buffers
        elif key.kind == KeyKind.BUFFERS:
            names = pack.mutated_buffers
        elif key.kind == KeyKind.WGRAD:
            names = tuple(name for name in pack.params if self._masters[name].requires_grad)
        else:
            raise AssertionError(f"{key} is never copied")
        return sum(pytrees.value_bytes(self._masters[name], self._moved_itemsize) for name in names)

    def _moved_itemsize(self, tensor: torch.Tensor) -> int:
        dtype = self.options.compute_dtype
        return dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()

    def _make_plan(self, best: _Candidate, policy: str) -> Plan:
        if self.options.verify:  # verify's last check: the chosen program fits every device
            for device, peak, at in zip(self.devices, best.peaks, best.peak_at):
                check_peak(peak + device.margin, self.budget, device.name, at)
        packs = self.packs
        every_action = [a for forward, backward in best.device_actions for a in forward + backward]
        moved = bytes_moved(every_action, self.key_bytes)
        stash = {pack.index: 0 for pack in packs}
        for action in every_action:
            if action.kind == ActionKind.OFFLOAD and action.key.kind == KeyKind.ACT and action.key.name in self._nodes:
                producer = self._nodes[action.key.name].meta.get(meta.PACK)
                if producer is not None:
                    stash[producer] += self.key_bytes(action.key)
        placement = ", ".join(d.name for d in self.devices)
        pack_plans = tuple(
            PackPlan(pack.index, pack.layer_names, sum(self._masters[n].numel() for n in pack.params),
                     self.key_bytes(Key(KeyKind.WEIGHTS, pack.name)), stash[pack.index],
                     placement, recompute=pack.index < len(packs) - 1)
            for pack in packs)
        return Plan(pack_plans, self.num_microbatches, tuple(d.name for d in self.devices), self.budget,
                    {d.name: peak for d, peak in zip(self.devices, best.peaks)},
                    {f"{d}/{k}": n for (d, k), n in sorted(moved.items())}, policy, self.parallel,
                    self._batch_note(), self.device.margin, self.device.margin_note)

    def _batch_note(self) -> str:
        analysis = self.batch_analysis
        if analysis is None:
            return ""
        if analysis.separable:
            return "every op treats the samples apart, so microbatches compute what the whole batch does"
        return f"kept whole (microbatches would change the result): {analysis.reason}"

    def _steps(self, actions: Sequence[Action]) -> list[str]:
        """The comment above each action: the task it serves (transfers before a task belong to it)."""
        labels: list[str] = [""] * len(actions)
        upcoming = ""
        for index in range(len(actions) - 1, -1, -1):
            action = actions[index]
            if action.kind in (ActionKind.FWD, ActionKind.RECOMPUTE, ActionKind.BWD):
                pack = self.packs[action.pack]
                upcoming = f"{action.kind.value} {pack.name} ({pack.describe_layers()}) microbatch {action.mb}"
            elif action.kind == ActionKind.UPDATE:
                upcoming = f"UPDATE on the host: parameters last used by p{action.pack}"
            labels[index] = upcoming or "end of the iteration"
        return labels

    # ------------------------------------------------------------------ running
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "_first_call" in self.__dict__:
            trainer, updates = self._first_call
            self.__init__(self.model, args, kwargs, self.options, trainer, updates)
        compiled = self.for_batch(args, kwargs)
        if compiled is not self:
            outputs = compiled(*args, **kwargs)
            self.stats = compiled.stats  # the backward, if any, fills in this same object
            return outputs
        per_mb = self.split_inputs(args, kwargs)
        params = self._trainable_params()
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params) or any(x.requires_grad for flat in per_mb for x in flat))
        if needs_grad:
            flat_whole = self.captured.flatten_inputs(args, kwargs)
            tensor_outputs = _HarmonyFunction.apply(self, per_mb, *flat_whole, *params)
        else:
            iteration = self.start(per_mb)
            tensor_outputs = self._forward_outputs(iteration)
            iteration.release()
            self._finish_stats()
        return self._structure_outputs(list(tensor_outputs))

    def for_batch(self, args: tuple, kwargs: dict) -> "HarmonyModule":
        """The module that runs a call on ``(args, kwargs)``: this one when the batch has the
        example's size, else one compiled for the new batch size, planned on its first call and
        kept for the next ones (the packs and microbatch sizes depend on the batch size). Only the
        batch dim may change between calls: other shapes are baked into the captured graph."""
        flat = self.captured.flatten_inputs(args, kwargs)
        size = example_size = None
        for name, given, expected, dim in zip(self.captured.inputs, flat, self._example_flat, self._flat_dims):
            whole = list(expected.shape)
            if dim is not None and self.mb_sizes[0] is not None:
                whole[dim] = sum(self.mb_sizes)  # the example's microbatches are cut along this dim
            fixed = [n if d != dim else "B" for d, n in enumerate(whole)]
            given_fixed = [n if d != dim else "B" for d, n in enumerate(given.shape)]
            if given_fixed != fixed or given.dtype != expected.dtype:
                free = "no dim of it (batch_dims gives it none)" if dim is None else f"only its batch dim {dim}"
                raise ValueError(
                    f"input {name!r} has shape {tuple(given.shape)} and dtype {given.dtype}, but the model was "
                    f"compiled for {tuple(whole)} and {expected.dtype}; {free} may change between calls (a new batch "
                    "size is planned on its first call), the other dims are baked into the captured graph. Compile "
                    "again with an example of the new shape, or pad the inputs to the compiled one.")
            if dim is not None:
                size, example_size = given.shape[dim], whole[dim]
        if size == example_size:
            return self
        resized = self.__dict__.setdefault("_resized", {})
        if size not in resized:
            resized[size] = HarmonyModule(self.model, args, kwargs, self.options, _trainer=self._trainer,
                                          _updates=self._updates)
        return resized[size]

    def split_inputs(self, args: tuple, kwargs: dict) -> list[list[torch.Tensor]]:
        """The flat tensor inputs of each microbatch, checked against the example."""
        call = (args, kwargs)
        dims = microbatch.argument_dims(self.model, args, kwargs, self.options.batch_dims)
        sizes = [s for s in self.mb_sizes if s is not None]
        if sizes and microbatch.batch_size(call, dims) != sum(sizes):
            raise ValueError(f"the batch has {microbatch.batch_size(call, dims)} samples but the model was compiled for "
                             f"{sum(sizes)}; compile again for the new batch size.")
        per_mb = []
        for size, (mb_args, mb_kwargs) in zip(self.mb_sizes, microbatch.split_call(call, dims, sizes or [0])):
            flat = self._variants[size].captured.flatten_inputs(mb_args, mb_kwargs)
            nodes = self._variants[size].nodes
            for given, name in zip(flat, self.captured.inputs):
                expected = nodes[name].meta[meta.VAL]
                if given.shape != expected.shape or given.dtype != expected.dtype:
                    raise ValueError(
                        f"input {name!r} has shape {tuple(given.shape)} and dtype {given.dtype} in a microbatch, but "
                        f"the model was compiled for {tuple(expected.shape)} and {expected.dtype}; compile again "
                        "for the new shape.")
            per_mb.append(flat)
        if [x.requires_grad for x in per_mb[0]] != [x.requires_grad for x in self._example_flat]:
            raise ValueError("which inputs require grad differs from the example inputs; compile with inputs "
                             "that require grad exactly where the calls do.")
        return per_mb

    def _trainable_params(self) -> list[nn.Parameter]:
        seen, params = set(), []
        for param in self.captured.params.values():
            if id(param) not in seen and param.requires_grad:
                seen.add(id(param))
                params.append(param)
        return params

    def start(self, per_mb: Sequence[Sequence[torch.Tensor]], on_update: Callable[[Runtime, int], None] | None = None,
              output_grads: dict[Key, torch.Tensor] | None = None) -> "_Iteration":
        """Run the forward programs (one per device, side by side); the returned iteration holds
        what the backward programs need."""
        iteration = self._begin(per_mb, on_update, output_grads)
        iteration.run([[programs["forward"]] for programs in self.device_programs])
        return iteration

    def _begin(self, per_mb, on_update, output_grads) -> "_Iteration":
        self.stats = Stats(budget={device.name: self.budget for device in self.devices})
        runtimes: list[Runtime] = []
        for device in self.devices:
            device.reset_peak()
            device.planned_peak = self.plan.predicted_peak.get(device.name)  # named if it runs out of memory
            shared = runtimes[0] if runtimes else None
            runtimes.append(self._runtime(self._packs_by_size, device, self.host_state, self.stats, on_update, shared,
                                          len(runtimes)))
        iteration = _Iteration(runtimes, self._controller())
        for mb, flat in enumerate(per_mb):
            for name, value in zip(self.captured.inputs, flat):
                iteration.host_values[Key(KeyKind.ACT, name, mb)] = value.detach()
        iteration.host_values.update(output_grads or {})
        return iteration

    def run_iteration(self, per_mb: Sequence[Sequence[torch.Tensor]], on_update: Callable[[Runtime, int], None],
                      output_grads: dict[Key, torch.Tensor]) -> "_Iteration":
        """Forward and backward in one go (the Trainer): each device runs its backward program as
        soon as its forward program ends, with no barrier between them (a pipeline's fused last task
        hands gradients to a device that is already in its backward)."""
        iteration = self._begin(per_mb, on_update, output_grads)
        try:
            iteration.run([[programs["forward"], programs["backward"]] for programs in self.device_programs])
        finally:
            iteration.release()
        self._finish_stats()
        return iteration

    def finish(self, iteration: "_Iteration") -> None:
        """Run the backward programs (output gradients already in ``iteration.host_values``)."""
        try:
            iteration.run([[programs["backward"]] for programs in self.device_programs])
        finally:
            iteration.release()
        self._finish_stats()

    def _controller(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """One thread per device issues that device's program, so no device waits for another's
        host-side work; with one device the caller's thread does it."""
        if len(self.devices) == 1:
            return None
        if getattr(self, "_device_threads", None) is None:
            self._device_threads = concurrent.futures.ThreadPoolExecutor(len(self.devices), "harmony-device")
        return self._device_threads

    def _forward_outputs(self, runtime: "_Iteration") -> tuple[torch.Tensor, ...]:
        outputs = []
        for name in self.signature.model_outputs:
            chunks = [runtime.host_values[Key(KeyKind.ACT, name, mb)] for mb in range(self.num_microbatches)]
            dtype = self._nodes[name].meta[meta.VAL].dtype
            if len(chunks) > 1 and chunks[0].dim() == 0:  # a loss: weighted as eager reduces the whole batch
                per_mb = [[runtime.host_values[Key(KeyKind.ACT, n, mb)] for n in self.captured.inputs]
                          for mb in range(self.num_microbatches)]
                runtime.scalar_weights[name] = self.scalar_weights(name, per_mb)
                outputs.append(microbatch.merge_scalars(chunks, runtime.scalar_weights[name]).to(dtype))
                continue
            outputs.append(microbatch.merge([chunk.to(dtype) for chunk in chunks], self._output_dims.get(name, 0)))
        return tuple(outputs)

    def _structure_outputs(self, tensors: list[torch.Tensor]) -> Any:
        by_name = dict(zip(self.signature.model_outputs, tensors))
        flat = [by_name[arg.name] if isinstance(arg, fx.Node) else arg for arg in self._output_args]
        return self.captured.unflatten_outputs(flat)

    def _finish_stats(self) -> None:
        for device in self.devices:
            self.stats.peak_bytes[device.name] = device.peak_bytes()

    def _backward(self, runtime: "_Iteration", grad_outputs: Sequence[torch.Tensor | None]) -> tuple[list, list]:
        sizes = [s for s in self.mb_sizes if s is not None]
        for name, grad in zip(self.signature.model_outputs, grad_outputs):
            if name not in self.signature.differentiable:
                continue
            if grad is None:
                grad = torch.zeros_like(self.output_like(name))
            if name in runtime.scalar_weights:
                chunks = [grad * weight for weight in runtime.scalar_weights[name]]
            else:
                chunks = torch.split(grad, sizes, self._output_dims.get(name, 0)) if len(sizes) > 1 else (grad,)
            for mb, chunk in enumerate(chunks):
                runtime.host_values[Key(KeyKind.GRAD, name, mb)] = chunk
        self.finish(runtime)
        input_grads = []
        for name, dim in zip(self.captured.inputs, self._flat_dims):
            dtype = self._nodes[name].meta[meta.VAL].dtype
            chunks = [runtime.host_values.get(Key(KeyKind.GRAD, name, mb)) for mb in range(self.num_microbatches)]
            input_grads.append(microbatch.merge([c if c is None else c.to(dtype) for c in chunks], dim))
        param_grads = [runtime.host_grads.get(id(param)) for param in self._trainable_params()]
        return input_grads, param_grads

    def scalar_weights(self, name: str, per_mb: Sequence[Sequence[torch.Tensor]],
                       otherwise: list[float] | None = None) -> list[float]:
        """Each microbatch's coefficient in the batch's value of the scalar output ``name`` (its
        loss), from how the graph reduces it (``microbatch.scalar_reduction``), given each
        microbatch's flat inputs ``per_mb``. Where the graph does not say, ``otherwise`` if given,
        else a ``ValueError`` saying what to do."""
        reductions = [self._variants[size].captured.reductions[name] for size in self.mb_sizes]
        if otherwise is not None and any(reduction.combine is None for reduction in reductions):
            return otherwise
        inputs = [dict(zip(self.captured.inputs, flat)) for flat in per_mb]
        return microbatch.scalar_weights(reductions, inputs, self.mb_sizes)

    def output_like(self, name: str) -> torch.Tensor:
        """An empty tensor shaped as the model's output ``name`` on the whole batch (a scalar, such
        as a loss, stays a scalar)."""
        vals = [self._variants[size].nodes[name].meta[meta.VAL] for size in self.mb_sizes]
        if len(vals) == 1 or vals[0].dim() == 0:
            return torch.empty(vals[0].shape, dtype=vals[0].dtype)
        dim = self._output_dims.get(name, 0)
        shape = list(vals[0].shape)
        shape[dim] = sum(v.shape[dim] for v in vals)
        return torch.empty(shape, dtype=vals[0].dtype)


class _PeakTrace:
    """The runtime as a program sees it, recording the device's high-water mark after every
    action (a FakeTensor run on HostStreams: each op's work is done when it returns)."""

    _ACTION_OPS = frozenset(OP_OF_KIND.values())

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.peaks: list[int] = []  # one entry per action, in program order

    def __getattr__(self, name: str):
        op = getattr(self._runtime, name)
        if name not in self._ACTION_OPS:
            return op  # remote/publish: not actions of their own

        def traced(*args):
            result = op(*args)
            runtime = self._runtime
            # the per-task probes reset the device's peak: their running maximum is kept aside
            self.peaks.append(max(runtime.device.peak_bytes(), runtime.probe_peak))
            return result

        return traced


class _MadeOnDemand(dict):
    """Host values of a standalone FakeTensor run: what other devices would have put on the host
    is made when first read."""

    def __init__(self, make: Callable[[Key], torch.Tensor]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: Key) -> torch.Tensor:
        value = self[key] = self._make(key)
        return value


class _Iteration:
    """One iteration in flight: a runtime per device, sharing the host side (inputs, stash,
    gradients on the host)."""

    def __init__(self, runtimes: list[Runtime], controller: concurrent.futures.ThreadPoolExecutor | None) -> None:
        self.runtimes = runtimes
        self.controller = controller
        self.host_values = runtimes[0].host_values
        self.host_grads = runtimes[0].host_grads
        self.scalar_weights: dict[str, list[float]] = {}  # per scalar output: each microbatch's share

    def run(self, programs: Sequence[Sequence[fx.GraphModule]]) -> None:
        """Run each device's programs, in order; the first error is raised once every device has
        stopped, and then nothing stays on any device."""

        def run_device(runtime: Runtime, device_programs: Sequence[fx.GraphModule]) -> None:
            try:
                for program in device_programs:
                    runtime.run(program)
            except BaseException as error:
                runtime.links.abort(error)  # no other device waits forever for this one
                raise

        errors: list[BaseException | None] = []
        try:
            if self.controller is None:
                run_device(self.runtimes[0], programs[0])
                return
            futures = [self.controller.submit(run_device, runtime, device_programs)
                       for runtime, device_programs in zip(self.runtimes, programs)]
            errors = [future.exception() for future in futures]
            # the error that stopped the iteration, not another device's "stopped by another device"
            root = self.runtimes[0].links.failed
            first = root if root in errors else next((error for error in errors if error is not None), None)
            if first is not None:
                raise first
        except BaseException as error:
            self.release()
            # The failed tasks' frames hold device tensors, and through the runtime (the links keep
            # the error) a cycle back to the error: clear them, so the device memory comes back now,
            # not when the garbage collector runs. The traceback keeps its lines, not its locals.
            for failed in {id(e): e for e in [error, *errors] if e is not None}.values():
                traceback.clear_frames(failed.__traceback__)
            raise

    def release(self) -> None:
        for runtime in self.runtimes:
            runtime.release()


def _refuse_fixed_float_casts(gm: fx.GraphModule) -> None:
    """bf16 runs the captured graph on bf16 tensors; a cast to fp32 inside it (``x.float()``) would
    meet bf16 weights. Say where, instead of failing deep inside the first run."""
    casts = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
             torch.ops.aten._assert_tensor_metadata.default}
    for node in gm.graph.nodes:
        if node.target in casts and node.kwargs.get("dtype") in (torch.float32, torch.float64):
            where = (node.meta.get("stack_trace") or "").strip().splitlines()[-1:] or [node.format_node()]
            raise ValueError(
                f"precision='bf16': the model casts to {node.kwargs['dtype']} at {where[0].strip()!r} "
                f"(node {node.name}); remove the cast (harmony_fx computes in bf16 and keeps fp32 masters "
                "itself) or use precision='fp32'.")


def _host_state(packs: Sequence[Pack], masters: dict[str, torch.Tensor]) -> HostState:
    """Each pack's masters in the order its weight copies use: parameters, then buffers."""
    return HostState([[masters[name] for name in pack.params + pack.buffers] for pack in packs])


def _fake_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A FakeTensor (inside a FakeTensorMode) shaped like ``tensor``, on the device packs run on, so
    factory ops retargeted to that device meet tensors of the same device."""
    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return fake.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else fake


def _fixed(boundaries: Sequence[int]):
    """A packing policy that always answers ``boundaries``."""
    return lambda layer_costs, num_packs: list(boundaries)


class _HarmonyFunction(torch.autograd.Function):
    """Forward runs the forward program; autograd's backward runs the backward program and hands
    the host gradients to autograd, which accumulates them into ``param.grad`` as usual."""

    @staticmethod
    def forward(ctx, hm: HarmonyModule, per_mb, *inputs_and_params):
        # the tensors are arguments only so that autograd connects the outputs to them
        runtime = hm.start(per_mb)
        ctx.hm, ctx.runtime = hm, runtime
        outputs = hm._forward_outputs(runtime)
        hm._finish_stats()
        ctx.mark_non_differentiable(*[o for o, name in zip(outputs, hm.signature.model_outputs)
                                      if name not in hm.signature.differentiable])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        input_grads, param_grads = ctx.hm._backward(ctx.runtime, grad_outputs)
        ctx.runtime = None
        return (None, None, *input_grads, *param_grads)
