"""``harmony_fx.compile``: capture → analyze → plan packs → lower → verify → codegen → run.

Every stage's artifact stays on the ``HarmonyModule``: ``captured`` (the model's graph), ``packs``
(one GraphModule each), ``forward_actions``/``backward_actions`` (the schedule), ``programs``
(the generated GraphModules, printed by ``code``), ``plan`` and, after a call, ``stats``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch._subclasses import FakeTensorMode
from torch.utils import _pytree as pytree

from harmony_fx.analysis.sizes import annotate_sizes
from harmony_fx.capture import Captured, capture
from harmony_fx.config import CompileOptions
from harmony_fx.ir import meta
from harmony_fx.ir.codegen import generate_program
from harmony_fx.ir.pack import Pack
from harmony_fx.passes.find_layers import find_layers
from harmony_fx.passes.lower_program import ProgramSignature, grad_inputs, lower_program
from harmony_fx.passes.plan_packs import balanced, plan_packs
from harmony_fx.passes.retarget_device import retarget_device
from harmony_fx.passes.split_packs import split_packs
from harmony_fx.runtime.devices import Device, HostDevice, resolve_devices
from harmony_fx.runtime.executor import HostState, Runtime, Stats
from harmony_fx.schedule.actions import Action, ActionKind, Key, KeyKind
from harmony_fx.schedule.plan import PackPlan, Plan
from harmony_fx.schedule.simulate import bytes_moved
from harmony_fx.schedule.validate import check_peak, verify_program

__all__ = ["compile", "HarmonyModule"]


def compile(model: nn.Module, example_inputs: tuple | torch.Tensor = (), example_kwargs: dict | None = None, *,
            devices: object = None, memory_budget: int | str | None = None, microbatches: int | None = None,
            parallel: str = "auto", **options: Any) -> "HarmonyModule":
    """Compile ``model`` for training larger than device memory; see DESIGN.md §3."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    opts = CompileOptions(devices=devices, memory_budget=memory_budget, microbatches=microbatches,
                          parallel=parallel, **options)
    return HarmonyModule(model, example_inputs, dict(example_kwargs or {}), opts)


@dataclasses.dataclass
class _Candidate:
    """One packing, lowered, verified and run on FakeTensors."""

    packs: list[Pack]
    forward_actions: list[Action]
    backward_actions: list[Action]
    peak: int


class HarmonyModule:
    """A compiled model: call it like the model; ``loss.backward()`` runs the harmony backward."""

    def __init__(self, model: nn.Module, example_args: tuple, example_kwargs: dict, options: CompileOptions) -> None:
        self.model = model
        self.options = options
        devices = resolve_devices(options.devices, options.memory_budget, options.track_memory)
        if len(devices) > 1:
            raise NotImplementedError(
                f"devices={options.devices!r}: harmony_fx runs on one device today; several devices "
                "(data-parallel and pipeline) are not built yet. Pass one device, e.g. devices=['host:0']."
            )
        self.device: Device = devices[0]
        self.budget = self.device.budget
        self.num_microbatches = options.microbatches or 1
        mb_args, mb_kwargs = _first_microbatch((example_args, example_kwargs), self.num_microbatches)
        self.captured: Captured = capture(model, mb_args, mb_kwargs)
        gm = self.captured.gm
        retarget_device(gm, self.device.torch_device)
        annotate_sizes(gm)
        self.layers = find_layers(gm)
        self._nodes = {node.name: node for node in gm.graph.nodes}
        self._masters = {**self.captured.params, **self.captured.buffers}
        self._example_flat = self.captured.flatten_inputs(example_args, example_kwargs)
        self._output_args = list(gm.graph.find_nodes(op="output")[0].args[0])
        self.signature = self._signature([x.requires_grad for x in self._example_flat])
        boundaries, best = plan_packs(self._layer_costs(), self._evaluate, lambda c: c.peak, self.budget, balanced)
        self.packs = best.packs
        self.forward_actions, self.backward_actions = best.forward_actions, best.backward_actions
        self.programs = {
            "forward": generate_program(self.forward_actions, self._steps(self.forward_actions), "HarmonyForward"),
            "backward": generate_program(self.backward_actions, self._steps(self.backward_actions), "HarmonyBackward"),
        }
        self.plan = self._make_plan(best, "balanced")
        self.host_state = HostState([[self._masters[name] for name in pack.params + pack.buffers] for pack in self.packs])
        self.stats = Stats()

    # ------------------------------------------------------------------ what people look at
    @property
    def code(self) -> str:
        return "\n".join(f"# ---- {name} program ----{program.code}" for name, program in self.programs.items())

    def explain(self) -> str:
        return self.plan.table()

    # ------------------------------------------------------------------ planning
    def _signature(self, requires_grad: Sequence[bool]) -> ProgramSignature:
        gm_nodes = self._nodes
        differentiable = [n.name for n in gm_nodes.values()
                          if isinstance(n.meta.get(meta.VAL), torch.Tensor) and n.meta[meta.VAL].is_floating_point()
                          and meta.role_of(n) not in (meta.Role.PARAM, meta.Role.BUFFER)]
        for arg in self._output_args:
            if isinstance(arg, fx.Node) and (arg.op == "placeholder"):
                raise ValueError(f"the model returns its input or state {arg.name!r} unchanged; harmony_fx needs every "
                                 "output to be computed by the model (return a copy, e.g. x.clone()).")
        outputs = [arg.name for arg in self._output_args if isinstance(arg, fx.Node)]
        inputs_requiring_grad = [name for name, flag in zip(self.captured.inputs, requires_grad) if flag]
        return ProgramSignature(self.captured.inputs, outputs, inputs_requiring_grad, differentiable, self.num_microbatches)

    def _layer_costs(self) -> list[int]:
        costs = []
        for layer in self.layers:
            nodes = [self._nodes[name] for name in layer.nodes]
            state = {read for node in nodes for read in node.meta[meta.READS]}
            costs.append(sum(meta.nbytes_of(self._nodes[s]) for s in state) + sum(meta.nbytes_of(n) for n in nodes))
        return costs

    def _evaluate(self, boundaries: list[int]) -> _Candidate:
        packs = split_packs(self.captured.gm, self.layers, boundaries, self._masters)
        forward, backward = lower_program(packs, self.signature)
        if self.options.verify:
            host_keys = [Key(KeyKind.ACT, v, mb) for v in self.signature.model_inputs for mb in range(self.num_microbatches)]
            grad_keys = [Key(KeyKind.GRAD, v, mb) for v in self.signature.model_outputs for mb in range(self.num_microbatches)]
            forward_results = [a.key for a in forward if a.kind == ActionKind.OFFLOAD and a.key.kind != KeyKind.ACT
                               or a.kind == ActionKind.OFFLOAD and a.key.name in self.signature.model_outputs]
            verify_program(forward, host_keys, forward_results)
            # the backward program continues from the forward's state: check them as one
            backward_results = [a.key for a in backward if a.kind == ActionKind.OFFLOAD]
            verify_program(forward + backward, host_keys + grad_keys, backward_results)
        candidate = _Candidate(packs, forward, backward, 0)
        candidate.peak = self._fake_peak(candidate)
        return candidate

    def _fake_peak(self, candidate: _Candidate) -> int:
        """Run the candidate's programs on FakeTensors on a tracked HostDevice: the static peak."""
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        device = HostDevice("fake", None)
        programs = [generate_program(actions, [""] * len(actions), "Fake")
                    for actions in (candidate.forward_actions, candidate.backward_actions)]
        with fake_mode:
            fake = {name: fake_mode.from_tensor(t) for name, t in self._masters.items()}
            host = HostState([[fake[name] for name in pack.params + pack.buffers] for pack in candidate.packs])
            runtime = Runtime(candidate.packs, device, host, self._grad_inputs(candidate.packs), Stats())
            for name in self.signature.model_inputs:
                value = fake_mode.from_tensor(self._nodes[name].meta[meta.VAL])
                for mb in range(self.num_microbatches):
                    runtime.host_values[Key(KeyKind.ACT, name, mb)] = value
            runtime.run(programs[0])
            for name in self.signature.model_outputs:
                if name in self.signature.differentiable:
                    for mb in range(self.num_microbatches):
                        runtime.host_values[Key(KeyKind.GRAD, name, mb)] = torch.ones_like(self._nodes[name].meta[meta.VAL])
            with torch.random.fork_rng(devices=[]):
                runtime.run(programs[1])
        return device.peak_bytes()

    def _grad_inputs(self, packs: Sequence[Pack]) -> list[tuple[str, ...]]:
        return [grad_inputs(pack, self.signature) for pack in packs]

    def key_bytes(self, key: Key) -> int:
        """Bytes of a key as the plan counts them (from shapes alone)."""
        if key.kind in (KeyKind.ACT, KeyKind.GRAD):
            return meta.nbytes_of(self._nodes[key.name])
        pack = self.packs[int(key.name[1:])]
        if key.kind == KeyKind.WEIGHTS:
            names = pack.params + pack.buffers
        elif key.kind == KeyKind.BUFFERS:
            names = pack.mutated_buffers
        elif key.kind == KeyKind.WGRAD:
            names = tuple(name for name in pack.params if self._masters[name].requires_grad)
        else:
            raise AssertionError(f"{key} is never copied")
        return sum(self._masters[name].numel() * self._masters[name].element_size() for name in names)

    def _make_plan(self, best: _Candidate, policy: str) -> Plan:
        packs = best.packs
        moved = bytes_moved(best.forward_actions + best.backward_actions, self.key_bytes)
        stash = {pack.index: 0 for pack in packs}
        for action in best.forward_actions:
            if action.kind == ActionKind.OFFLOAD and action.key.kind == KeyKind.ACT:
                producer = self._nodes[action.key.name].meta.get(meta.PACK)
                stash[producer] += self.key_bytes(action.key)
        pack_plans = tuple(
            PackPlan(pack.index, pack.layer_names,
                     sum(self._masters[n].numel() for n in pack.params),
                     self.key_bytes(Key(KeyKind.WEIGHTS, pack.name)), stash[pack.index],
                     self.device.name, recompute=pack.index < len(packs) - 1)
            for pack in packs)
        return Plan(pack_plans, self.num_microbatches, (self.device.name,), self.budget,
                    {self.device.name: best.peak}, {f"{d}/{k}": n for (d, k), n in sorted(moved.items())}, policy)

    def _steps(self, actions: Sequence[Action]) -> list[str]:
        """The comment above each task: the pack, its layers and the microbatch."""
        steps, current = [], "start"
        for index, action in enumerate(actions):
            if action.kind in (ActionKind.FWD, ActionKind.RECOMPUTE, ActionKind.BWD):
                pack = self.packs[action.pack]
                current = f"{action.kind.value} {pack.name} ({pack.describe_layers()}) microbatch {action.mb}"
            steps.append(current)
        # transfers issued before a task belong to it: label them with the next task's step
        labels, upcoming = [None] * len(actions), None
        for index in range(len(actions) - 1, -1, -1):
            if actions[index].kind in (ActionKind.FWD, ActionKind.RECOMPUTE, ActionKind.BWD):
                upcoming = steps[index]
            labels[index] = upcoming or steps[index]
        return labels

    # ------------------------------------------------------------------ running
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.captured.flatten_inputs(args, kwargs)
        for given, example, name in zip(flat, self._example_flat, self.captured.inputs):
            if given.shape != example.shape or given.dtype != example.dtype:
                raise ValueError(
                    f"input {name!r} has shape {tuple(given.shape)} and dtype {given.dtype}, but the model was "
                    f"compiled for {tuple(example.shape)} and {example.dtype}; compile again for the new shape."
                )
        if [x.requires_grad for x in flat] != [x.requires_grad for x in self._example_flat]:
            raise ValueError("which inputs require grad differs from the example inputs; compile with inputs "
                             "that require grad exactly where the calls do.")
        params = self._trainable_params()
        needs_grad = torch.is_grad_enabled() and (any(p.requires_grad for p in params) or any(x.requires_grad for x in flat))
        if needs_grad:
            tensor_outputs = _HarmonyFunction.apply(self, len(flat), *flat, *params)
        else:
            runtime = self._start(flat)
            tensor_outputs = self._forward_outputs(runtime)
            runtime.release()
            self._finish_stats(runtime)
        return self._structure_outputs(list(tensor_outputs))

    def _trainable_params(self) -> list[nn.Parameter]:
        seen, params = set(), []
        for param in self.captured.params.values():
            if id(param) not in seen and param.requires_grad:
                seen.add(id(param))
                params.append(param)
        return params

    def _start(self, flat: Sequence[torch.Tensor]) -> Runtime:
        self.stats = Stats(budget={self.device.name: self.budget})
        self.device.reset_peak()
        runtime = Runtime(self.packs, self.device, self.host_state, self._grad_inputs(self.packs), self.stats)
        for name, value in zip(self.captured.inputs, flat):
            for mb, chunk in enumerate(_split(value.detach(), self.num_microbatches)):
                runtime.host_values[Key(KeyKind.ACT, name, mb)] = chunk
        try:
            runtime.run(self.programs["forward"])
        except BaseException:
            runtime.release()
            raise
        return runtime

    def _forward_outputs(self, runtime: Runtime) -> tuple[torch.Tensor, ...]:
        outputs = []
        for name in self.signature.model_outputs:
            chunks = [runtime.host_values[Key(KeyKind.ACT, name, mb)] for mb in range(self.num_microbatches)]
            outputs.append(chunks[0] if len(chunks) == 1 else torch.cat(chunks))
        return tuple(outputs)

    def _structure_outputs(self, tensors: list[torch.Tensor]) -> Any:
        by_name = dict(zip(self.signature.model_outputs, tensors))
        flat = [by_name[arg.name] if isinstance(arg, fx.Node) else arg for arg in self._output_args]
        return self.captured.unflatten_outputs(flat)

    def _finish_stats(self, runtime: Runtime) -> None:
        self.stats.peak_bytes[self.device.name] = self.device.peak_bytes()

    def _backward(self, runtime: Runtime, grad_outputs: Sequence[torch.Tensor | None]) -> tuple[list, list]:
        for name, grad in zip(self.signature.model_outputs, grad_outputs):
            if name not in self.signature.differentiable:
                continue
            value = self._nodes[name].meta[meta.VAL]
            if grad is None:
                grad = torch.zeros(value.shape[0] * self.num_microbatches if self.num_microbatches > 1 else value.shape[0],
                                   *value.shape[1:], dtype=value.dtype)
            for mb, chunk in enumerate(_split(grad, self.num_microbatches)):
                runtime.host_values[Key(KeyKind.GRAD, name, mb)] = chunk
        try:
            runtime.run(self.programs["backward"])
        finally:
            runtime.release()
        self._finish_stats(runtime)
        input_grads = []
        for name in self.captured.inputs:
            chunks = [runtime.host_values.get(Key(KeyKind.GRAD, name, mb)) for mb in range(self.num_microbatches)]
            input_grads.append(None if chunks[0] is None else (chunks[0] if len(chunks) == 1 else torch.cat(chunks)))
        param_grads = [runtime.host_grads.get(id(param)) for param in self._trainable_params()]
        return input_grads, param_grads


class _HarmonyFunction(torch.autograd.Function):
    """Forward runs the forward program; autograd's backward runs the backward program and hands
    the host gradients to autograd, which accumulates them into ``param.grad`` as usual."""

    @staticmethod
    def forward(ctx, hm: HarmonyModule, num_inputs: int, *flat_and_params):
        runtime = hm._start(flat_and_params[:num_inputs])
        ctx.hm, ctx.runtime = hm, runtime
        outputs = hm._forward_outputs(runtime)
        hm._finish_stats(runtime)
        ctx.mark_non_differentiable(*[o for o, name in zip(outputs, hm.signature.model_outputs)
                                      if name not in hm.signature.differentiable])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        input_grads, param_grads = ctx.hm._backward(ctx.runtime, grad_outputs)
        ctx.runtime = None
        return (None, None, *input_grads, *param_grads)


def _split(value: torch.Tensor, num: int) -> list[torch.Tensor]:
    if num == 1:
        return [value]
    if value.dim() == 0 or value.shape[0] % num:
        raise ValueError(f"cannot split a batch of shape {tuple(value.shape)} into {num} equal microbatches "
                         "along dim 0; use a batch size divisible by microbatches.")
    return list(value.chunk(num))


def _first_microbatch(tree: Any, num: int) -> Any:
    return pytree.tree_map(lambda x: _split(x, num)[0] if isinstance(x, torch.Tensor) else x, tree)
