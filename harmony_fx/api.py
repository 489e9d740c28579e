"""``harmony_fx.compile`` and ``HarmonyModule``: the front door, a thin facade.

``HarmonyModule`` holds three things and adds little: the ``Compiled`` artifact (the packs, the
programs, the plan and the log of the compile stages: ``compiler.driver``), the ``Session`` that
runs it (``runtime.session``) and the ``Calls`` that turn a call into microbatches and results
back into the model's output (``frontend.calls``). Without example inputs nothing is compiled
until the first call; a batch of another size is compiled on its first call and kept.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import nn

from harmony_fx import pictures
from harmony_fx.compiler.compiled import Compiled
from harmony_fx.compiler.driver import compile_program
from harmony_fx.compiler.packing import verify_programs
from harmony_fx.compiler.tier import OptimizerFacts
from harmony_fx.config import CompileOptions
from harmony_fx.frontend.calls import Calls
from harmony_fx.program.actions import Action, Key
from harmony_fx.program.format import format_schedule
from harmony_fx.runtime.autograd import HarmonyFunction
from harmony_fx.runtime.executor import Runtime
from harmony_fx.runtime.session import Iteration, Session

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
    from harmony_fx.config import check_option_names, option_names
    check_option_names(options, option_names(), "harmony_fx.compile")
    opts = CompileOptions(devices=devices, memory_budget=memory_budget, microbatches=microbatches,
                          parallel=parallel, **options)
    if example_inputs is None and example_kwargs is None:
        return HarmonyModule(model, None, None, opts)
    if not isinstance(example_inputs, tuple):
        example_inputs = () if example_inputs is None else (example_inputs,)
    return HarmonyModule(model, example_inputs, dict(example_kwargs or {}), opts)


class HarmonyModule:
    """A compiled model: call it like the model; ``loss.backward()`` runs the harmony backward.

    ``example_args=None``: nothing is captured until the first call, which compiles with its own
    inputs; until then what the plan makes (``plan``, ``code``, ``explain()``, ``stats``, ...) does
    not exist, and asking for it says so.

    ``trainer``: the model's output is its scalar loss, so the last pack runs forward, loss and
    backward as one task per microbatch; ``updates``: the host updates parameters as soon as their
    gradients are complete (``harmony_fx.Trainer`` uses both); ``optimizer``: what the Trainer's
    optimizer keeps, for ``host_memory`` and the NVMe tier.
    """

    def __init__(self, model: nn.Module, example_args: tuple | None, example_kwargs: dict | None,
                 options: CompileOptions, *, trainer: bool = False, updates: bool = False,
                 optimizer: OptimizerFacts | None = None) -> None:
        self.model = model
        self.options = options
        self._roles = dict(trainer=trainer, updates=updates, optimizer=optimizer)
        self._by_batch: dict[int, HarmonyModule] = {}  # the modules compiled for other batch sizes
        self._last: HarmonyModule = self  # the module that ran the last call (its stats are ours)
        if example_args is not None:
            self._compile(example_args, example_kwargs or {})

    def _compile(self, args: tuple, kwargs: dict) -> None:
        self.compiled: Compiled = compile_program(self.model, args, kwargs, self.options, **self._roles)
        self.session = Session(self.compiled)
        self.session.recording = self.options.timeline
        self.calls = Calls(self.compiled, self.model)

    def __getattr__(self, name: str) -> Any:
        # only reached for what is not there: before the first call of compile(model)
        if name in ("compiled", "session", "calls") or name in _AFTER_COMPILING:
            raise AttributeError(
                f"HarmonyModule.{name} exists after the first call: harmony_fx.compile(model) without example "
                "inputs captures and plans the model when it is first called (as torch.compile does). Call it "
                "once (hm(*inputs)), or pass example inputs: harmony_fx.compile(model, (x,)).")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def close(self) -> None:
        """Stop the devices' stream threads (chaos mode) and the controller threads; the module is
        unusable afterwards."""
        if "session" in self.__dict__:
            self.session.close()
        for module in self._by_batch.values():
            module.close()

    # ------------------------------------------------------------------ what people look at
    @property
    def passes(self):
        """The compile stages that ran, in order, each with its time and what it decided."""
        return self.compiled.passes

    @property
    def plan(self):
        return self.compiled.plan

    @property
    def stats(self):
        """Measured over the last call (forward and, once it ran, backward)."""
        return self._last.session.stats

    @property
    def code(self) -> str:
        return "\n".join(f"# ---- {name} program ----{program.code}" for name, program in self.programs.items())

    def explain(self) -> str:
        """The plan's table, then the schedule: one column per device, one row per compute task."""
        return self.plan.table() + "\n\n" + format_schedule(
            [forward + backward for forward, backward in self.device_actions], [d.name for d in self.devices])

    def record_timeline(self, on: bool = True) -> None:
        """Record (or stop recording) the next calls' timeline: every op's span and the device's
        memory after it, for ``save_trace`` and ``plot_memory``. Off by default (``timeline=``),
        as it costs bookkeeping per task."""
        self.session.recording = on
        for module in self._by_batch.values():
            module.record_timeline(on)

    def save_trace(self, path) -> None:
        """The last iteration's measured timeline as a Chrome trace (see ``harmony_fx.pictures``)."""
        pictures.save_trace(self._last, path)

    def plot_memory(self, path) -> None:
        """Memory over the last iteration per device, measured and predicted, as a PNG."""
        pictures.plot_memory(self._last, path)

    # the artifact's parts, by the names people and tests know
    devices = property(lambda self: list(self.compiled.devices))
    device = property(lambda self: self.compiled.devices[0])
    budget = property(lambda self: self.compiled.budget)
    schedule = property(lambda self: self.compiled.schedule)
    layout = property(lambda self: self.compiled.layout)
    num_microbatches = property(lambda self: self.compiled.layout.num_microbatches)
    mb_sizes = property(lambda self: list(self.compiled.layout.mb_sizes))
    parallel = property(lambda self: self.compiled.layout.parallel)
    device_microbatches = property(lambda self: list(self.compiled.layout.device_microbatches))
    update_arrivals = property(lambda self: self.compiled.layout.update_arrivals)
    captured = property(lambda self: self.compiled.captured)
    layers = property(lambda self: list(self.compiled.layers))
    packs = property(lambda self: self.compiled.packs)
    signature = property(lambda self: self.compiled.signature)
    batch_analysis = property(lambda self: self.compiled.batch_analysis)
    device_actions = property(lambda self: self.compiled.device_actions)
    forward_actions = property(lambda self: self.compiled.device_actions[0][0])
    backward_actions = property(lambda self: self.compiled.device_actions[0][1])
    task_memory = property(lambda self: self.compiled.task_memory)
    device_programs = property(lambda self: list(self.compiled.device_programs))
    programs = property(lambda self: self.compiled.programs)
    host_state = property(lambda self: self.session.host_state)

    def key_bytes(self, key: Key) -> int:
        """Bytes of a key as the plan counts them (from shapes and the compute dtype alone)."""
        return self.compiled.key_bytes(key)

    def update_groups(self) -> dict[int, list[nn.Parameter]]:
        """``{pack index: the parameters the host updates after that pack's backward}``."""
        return self.compiled.update_groups()

    def verify(self, device_actions: Sequence[tuple[Sequence[Action], Sequence[Action]]],
               update_packs: frozenset[int] = frozenset()) -> None:
        """Run the program verifier over ``(forward, backward)`` actions per device, as compiling
        does; raises ``ProgramError`` naming the offending action and the pass that made it."""
        signature = dataclasses.replace(self.compiled.signature, update_packs=update_packs)
        verify_programs(device_actions, signature, self.compiled.layout)

    @property
    def batch_sizes(self) -> list[int | None]:
        """The batch sizes compiled for other calls than the example's (each planned on its first call)."""
        return sorted(self._by_batch)

    # ------------------------------------------------------------------ running
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "compiled" not in self.__dict__:
            self._compile(args, kwargs)
        module = self.for_batch(args, kwargs)
        self._last = module
        if module is not self:
            return module(*args, **kwargs)
        per_mb = self.calls.split(args, kwargs)
        params = self.compiled.trainable_params()
        needs_grad = torch.is_grad_enabled() and (
            bool(params) or any(x.requires_grad for flat in per_mb for x in flat))  # params: those requiring grad
        if needs_grad:
            flat_whole = per_mb[0] if len(per_mb) == 1 else self.captured.flatten_inputs(args, kwargs)
            outputs = HarmonyFunction.apply(self.session, self.calls, per_mb, *flat_whole, *params)
        else:
            iteration = self.session.start(per_mb)
            outputs = self.calls.merge_outputs(iteration)
            iteration.release()
            self.session.finish_stats()
        return self.calls.structure(list(outputs))

    def for_batch(self, args: tuple, kwargs: dict, **roles: Any) -> "HarmonyModule":
        """The module that runs a call on ``(args, kwargs)``: this one when the batch has the
        example's size, else one compiled for the new batch size, planned on its first call and
        kept for the next ones (the packs and microbatch sizes depend on the batch size). Only the
        batch dim may change between calls: other shapes are baked into the captured graph.
        ``roles``: what a module compiled for a new size does otherwise (``updates=False``)."""
        size = self.calls.batch_size_of(args, kwargs)
        if size is None:
            return self
        if size not in self._by_batch:
            self._by_batch[size] = module = HarmonyModule(self.model, args, kwargs, self.options,
                                                          **{**self._roles, **roles})
            module.record_timeline(self.session.recording)
        return self._by_batch[size]

    def split_inputs(self, args: tuple, kwargs: dict) -> list[list[torch.Tensor]]:
        """The flat tensor inputs of each microbatch, checked against the example."""
        return self.calls.split(args, kwargs)

    def scalar_weights(self, name: str, per_mb: Sequence[Sequence[torch.Tensor]],
                       otherwise: Callable[[], list[float]] | None = None,
                       total: Callable[[float], float] | None = None) -> list[float]:
        """Each microbatch's coefficient in the batch's value of the scalar output ``name``
        (``total``: the whole batch's normaliser from this part's, when processes share a batch)."""
        return self.calls.scalar_weights(name, per_mb, otherwise, total)

    def output_like(self, name: str) -> torch.Tensor:
        """An empty tensor shaped as the model's output ``name`` on the whole batch."""
        return self.calls.output_like(name)

    def run_iteration(self, per_mb: Sequence[Sequence[torch.Tensor]], on_update: Callable[[Runtime, int], None],
                      output_grads: dict[Key, torch.Tensor], on_tier: Callable | None = None) -> Iteration:
        """Forward and backward in one go (the Trainer); see ``Session.run_iteration``."""
        self._last = self
        return self.session.run_iteration(per_mb, on_update, output_grads, on_tier)


# what exists once the model is compiled (asking for it before says so, instead of a bare AttributeError)
_AFTER_COMPILING = frozenset(
    name for name, value in vars(HarmonyModule).items() if isinstance(value, property) and not name.startswith("_"))
