"""``harmony_fx.compile`` and ``HarmonyModule``: the front door, a thin facade.

``HarmonyModule`` holds three things and adds little: the ``Compiled`` artifact (the packs, the
programs, the plan and the log of the compile stages: ``compiler.driver``), the ``Session`` that
runs it (``runtime.session``) and the ``Calls`` that turn a call into microbatches and results
back into the model's output (``frontend.calls``). Without example inputs nothing is compiled
until the first call; a batch of another size is compiled on its first call and kept.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import threading
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from harmony_fx import calibrate, pictures
from harmony_fx.calibrate import spec_for
from harmony_fx.compiler.compiled import Compiled
from harmony_fx.compiler.driver import compile_program
from harmony_fx.compiler.host_memory import OptimizerFacts
from harmony_fx.compiler.packing import BudgetTooSmallError, verify_programs
from harmony_fx.compiler.stages import StageLog
from harmony_fx.config import CompileOptions, check_option_names, format_size, option_names
from harmony_fx.frontend import microbatch
from harmony_fx.frontend.attribute_reads import Reads
from harmony_fx.frontend.calls import Calls
from harmony_fx.frontend.capture import CaptureError
from harmony_fx.frontend.frozen import frozen_in_compute_dtype
from harmony_fx.frontend.guards import CallKey
from harmony_fx.planner.module import simulate_module
from harmony_fx.program.actions import Action, Key
from harmony_fx.program.format import format_schedule
from harmony_fx.runtime.autograd import HarmonyFunction
from harmony_fx.runtime.devices import HostDevice
from harmony_fx.runtime.executor import Runtime
from harmony_fx.runtime.host import GradientBuffers
from harmony_fx.runtime.session import Iteration, Session
from harmony_fx.user_frames import user_stacklevel

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
    refuse_compiled_modules(model)
    check_option_names(options, option_names(), "harmony_fx.compile")
    opts = CompileOptions(devices=devices, memory_budget=memory_budget, microbatches=microbatches,
                          parallel=parallel, **options)
    if example_inputs is None and example_kwargs is None:
        return HarmonyModule(model, None, None, opts)
    if not isinstance(example_inputs, tuple):
        example_inputs = () if example_inputs is None else (example_inputs,)
    return HarmonyModule(model, example_inputs, dict(example_kwargs or {}), opts)


def _warn_weights_stay_on_the_host(call: str) -> None:
    warnings.warn(
        f"harmony_fx: {call} on a compiled model leaves its weights in host memory, where harmony_fx keeps "
        "them: each pack goes onto the devices compile(devices=...) named, as the plan says (a model larger than "
        "the device would not fit there whole). Inputs may be on the host or on a device.",
        stacklevel=user_stacklevel())


# the models whose compiled module this thread is calling: a call from inside one (its model's forward
# calling it) would capture itself without end
_models_running = threading.local()

# the model's dicts a compiled module shares (nn.Module's recursion over them reaches the model's
# weights and submodules under their own names)
_SHARED_WITH_THE_MODEL = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")

# HarmonyModule's own attributes: set as plain attributes, never registered in the shared dicts
_OWN_ATTRIBUTES = frozenset({"model", "options", "_roles", "_by_key", "_last", "_timeline_memory", "compiled",
                             "session", "calls", "_key", "_stages_after", "_reads", "_previous_key",
                             "_value_compiles"})


def _the_models(method: str) -> Callable[..., Any]:
    """``HarmonyModule.<method>`` as the model's: a hook registered on the compiled module is the model's."""
    def on_the_model(self: "HarmonyModule", *args: Any, **kwargs: Any) -> Any:
        return getattr(self.model, method)(*args, **kwargs)
    on_the_model.__name__ = method
    return on_the_model


class _Forward:
    """``hm.forward``: the call (a script's ``model.forward(x)`` runs harmony, not the bare model
    eagerly), with the model's forward's signature: code that reads it (transformers' ``Trainer``
    keeps the dataset's columns the forward names and drops the rest) read ``(*args, **kwargs)``.
    Read from the class (``HarmonyModule.forward``) it is the call's own function."""

    def __get__(self, module: "HarmonyModule | None", owner: type | None = None) -> Callable[..., Any]:
        if module is None:
            return _call
        def forward(*args: Any, **kwargs: Any) -> Any:
            return module(*args, **kwargs)

        try:
            forward.__signature__ = inspect.signature(module.model.forward)  # type: ignore[attr-defined]
        except (TypeError, ValueError):  # a forward with no signature to read (a builtin)
            pass
        forward.__doc__ = _call.__doc__
        return forward


def _call(self: "HarmonyModule", *args: Any, **kwargs: Any) -> Any:
    """The call (a script's ``model.forward(x)`` runs harmony, not the bare model eagerly)."""
    return self(*args, **kwargs)


class HarmonyModule(nn.Module):
    """A compiled model: call it like the model; ``loss.backward()`` runs the harmony backward.

    An ``nn.Module`` that is its model's view: it shares the model's parameters, buffers and
    submodules (the same dicts), so a parent module, an optimizer over the parent, ``nn.ModuleList``,
    an EMA (``AveragedModel``) and ``state_dict()`` see the model's own weights under the model's own
    names (no prefix), and ``train()``, ``eval()`` and a dtype reach the model. A device does not:
    the weights stay in host memory (``_apply``).

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
        super().__init__()
        self.model = model
        for shared in _SHARED_WITH_THE_MODEL:
            self.__dict__[shared] = getattr(model, shared)
        self.options = options
        self._roles = dict(trainer=trainer, updates=updates, optimizer=optimizer)
        # every call's ``CallKey`` -> the module compiled for it (this one's own key included)
        self._by_key: dict[CallKey, HarmonyModule] = {}
        self._last: HarmonyModule = self  # the module that ran the last call (its stats are ours)
        self._timeline_memory = True  # a recorded timeline counts a HostDevice's memory (``record_timeline``)
        # the modules' plain attributes the first capture read, whose values every call's key holds
        self._reads: Reads | None = None
        self._previous_key: CallKey | None = None  # the last call's
        self._value_compiles = 0  # calls in a row that each compiled for a new constant's value
        if example_args is not None:
            self._compile(example_args, example_kwargs or {})

    def __setattr__(self, name: str, value: Any) -> None:
        # harmony's own attributes are plain ones: nn.Module would register the model, or a module
        # compiled for another call, as a submodule (in the dicts shared with the model)
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        elif name == "forward":
            raise TypeError(
                "a forward set on a harmony_fx compiled module would never run: it runs the program it captured from "
                "the model's forward. Set it on the model (hm.model.forward = ...), whose new forward the next call "
                "captures; with accelerate, prepare the model first, then compile it (accelerator.prepare sets an "
                "autocast forward on the module it is given).")
        elif self._is_the_models(name):
            setattr(self.model, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._is_the_models(name):
            delattr(self.model, name)
        else:
            super().__delattr__(name)

    def _is_the_models(self, name: str) -> bool:
        """Whether an attribute set or deleted here is the model's, as a read of it is (``__getattr__``):
        a flag its forward reads (hm.use_aux = False) or its methods do (hm.generation_config = ...) was
        kept here, read back as set, and never seen by the model. Not harmony's own attributes, nor
        what is this module's already (nn.Module's hook dicts), nor this class's (its properties,
        nn.Module's ``_compiled_call_impl`` of hm.compile()); a submodule or parameter set here goes
        into the dicts shared with the model either way."""
        return ("model" in self.__dict__ and name not in _OWN_ATTRIBUTES and name not in self.__dict__
                and not hasattr(type(self), name))

    def __deepcopy__(self, memo: dict) -> "HarmonyModule":
        """A copy of the model, compiled with the same options on its first call (a teacher copy,
        an EMA's: ``AveragedModel(hm)``); the devices' threads and plans are this module's own."""
        return HarmonyModule(copy.deepcopy(self.model, memo), None, None, self.options, **self._roles)

    def __reduce__(self):
        """Pickled (``torch.save(hm)``) as its model and options: loaded, it compiles on its first call."""
        return HarmonyModule, (self.model, None, None, self.options), {"_roles": self._roles}

    def __setstate__(self, state: dict) -> None:
        self._roles = state["_roles"]

    def _compile(self, args: tuple, kwargs: dict, key: CallKey | None = None,
                 reuse: Compiled | None = None) -> None:
        """Capture and plan for ``(args, kwargs)``; ``reuse``: the compile of a larger call in the
        same state, whose packing is taken where it fits (``compile_program``)."""
        refuse_compiled_modules(self.model)  # set on the model since compile(): a cycle no capture ends
        key = key or CallKey.of(self.model, args, kwargs)
        forward_only = not self._roles["trainer"] and not _needs_grad(key, self.model, args, kwargs)
        args, kwargs = _outside_inference_mode(args, kwargs)
        # the graph is captured with grad on whatever the caller's mode (a forward-only program is
        # the lowering's choice, not the graph's), under the caller's autocast and training flags;
        # frozen_to_bf16 converts the frozen weights first, and puts them back if compiling fails
        with torch.inference_mode(False), torch.enable_grad(), _outside_the_callers_modes(), frozen_in_compute_dtype(
                self.model, self.options.compute_dtype, self.options.frozen_to_bf16):
            options = self.options if reuse is None else reuse.decisions()
            self.compiled: Compiled = compile_program(self.model, args, kwargs, options, **self._roles,
                                                      forward_only=forward_only, reuse=reuse)
        # the stages after compiling: the call state it was for (``_compile_for``), inductor's
        # compiles of the packs on the first calls (``Session``); ``passes`` shows them last
        self._stages_after = StageLog()
        self.session = Session(self.compiled, self._stages_after)
        self.record_timeline(self.options.timeline, memory=self._timeline_memory)
        self.calls = Calls(self.compiled, self.model)
        # read again: capturing runs the forward, which materializes a lazy module's parameters
        if self._reads is None:
            self._reads = self.compiled.captured.attribute_reads
        self._key = CallKey.of(self.model, args, kwargs, self._reads)
        self._by_key[self._key] = self

    def __getattr__(self, name: str) -> Any:
        # only reached for what is not there: before the first call of compile(model), or an
        # attribute of the wrapped model (``hm.config``), as torch.compile's wrapper does
        if name in ("compiled", "session", "calls", "_key", "_stages_after") or name in _AFTER_COMPILING:
            raise AttributeError(
                f"HarmonyModule.{name} exists after the first call: harmony_fx.compile(model) without example "
                "inputs captures and plans the model when it is first called (as torch.compile does). Call it "
                "once (hm(*inputs)), or pass example inputs: harmony_fx.compile(model, (x,)).")
        model = self.__dict__.get("model")
        if model is not None and not name.startswith("__"):
            attribute = getattr(model, name)
            if callable(attribute) and getattr(attribute, "__self__", None) is model:
                return self._chained(attribute)
            return attribute
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _chained(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """A method of the model that returns the model for chaining (``float()``, ``apply(fn)``,
        ``requires_grad_()``) returns this module instead: ``hm = hm.float()`` keeps harmony (it
        returned the bare model, which then trained eagerly, outside the budget)."""
        model = self.model

        def chained(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return self if result is model else result

        return chained

    def to(self, *args: Any, **kwargs: Any) -> "HarmonyModule":
        """``model.to(dtype)`` converts the model's weights (the next call compiles for them); a
        device is not the weights' to move: they stay in host memory, and each pack goes onto the
        devices ``compile(devices=...)`` named, as the plan says. A script's ``model.to("cuda")``
        keeps working (said once)."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type != "cpu":
            _warn_weights_stay_on_the_host(f"to({str(device)!r})")
        if dtype is not None:
            self.model.to(dtype=dtype, non_blocking=non_blocking)
        return self

    def cuda(self, device: Any = None) -> "HarmonyModule":
        _warn_weights_stay_on_the_host("cuda()")
        return self

    def cpu(self) -> "HarmonyModule":
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "HarmonyModule":
        """What a parent's ``to()``, ``cuda()`` or ``half()`` does to this module's tensors: ``fn``,
        by the model's own ``_apply`` (an RNN's re-flattens its weights), except a move to a device,
        which leaves the weights in host memory (said once) and keeps only a change of dtype. What
        ``fn`` does is read from it on an empty tensor."""
        probe = fn(torch.empty(0))
        if probe.device.type == "cpu":
            self.model._apply(fn, recurse)
            return self
        _warn_weights_stay_on_the_host(f"a move to {probe.device}")
        if probe.dtype != torch.float32:
            self.model.to(dtype=probe.dtype)
        return self

    # ------------------------------------------------------------------ the wrapped model, as nn.Module's
    # A call after any of these finds the graph for the new state (``frontend.guards``).
    @property
    def training(self) -> bool:
        return self.model.training

    @training.setter
    def training(self, mode: bool) -> None:
        if "model" in self.__dict__:  # nn.Module.__init__ sets it before there is a model
            self.model.training = mode

    def train(self, mode: bool = True) -> "HarmonyModule":
        self.model.train(mode)
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> "HarmonyModule":
        self.model.apply(fn)  # the model itself too, not this view of it
        return self

    def state_dict(self, *args: Any, **kwargs: Any):
        # the model's own (its hooks, its extra state), under the caller's prefix: a parent's
        # state_dict() holds the model's weights under the names it would without harmony
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any):
        return self.model.load_state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.model._load_from_state_dict(*args, **kwargs)  # a parent's load_state_dict(): the model's own

    # the names named_modules() and named_parameters() give are the model's: looked up in the model,
    # since this module's own attributes (``model``, ``packs``, ``plan``) would shadow a submodule
    # of that name (a Hugging Face LlamaForCausalLM's ``model``: PEFT's get_peft_model(hm) failed)
    def get_submodule(self, target: str) -> nn.Module:
        return self if target == "" else self.model.get_submodule(target)

    set_submodule = _the_models("set_submodule")
    get_parameter = _the_models("get_parameter")
    get_buffer = _the_models("get_buffer")

    # hooks on the model, where the capture sees them (this module's __call__ runs harmony's
    # program, not nn.Module's, so a hook kept here would never run)
    register_forward_pre_hook = _the_models("register_forward_pre_hook")
    register_forward_hook = _the_models("register_forward_hook")
    register_full_backward_pre_hook = _the_models("register_full_backward_pre_hook")
    register_full_backward_hook = _the_models("register_full_backward_hook")
    register_backward_hook = _the_models("register_backward_hook")
    register_state_dict_pre_hook = _the_models("register_state_dict_pre_hook")
    register_state_dict_post_hook = _the_models("register_state_dict_post_hook")
    register_load_state_dict_pre_hook = _the_models("register_load_state_dict_pre_hook")
    register_load_state_dict_post_hook = _the_models("register_load_state_dict_post_hook")
    _register_state_dict_hook = _the_models("_register_state_dict_hook")
    _register_load_state_dict_pre_hook = _the_models("_register_load_state_dict_pre_hook")

    def close(self) -> None:
        """Stop the devices' stream threads (chaos mode) and the controller threads; the module is
        unusable afterwards."""
        if "session" in self.__dict__:
            self.session.close()
        for module in self._by_key.values():
            if module is not self:
                module.close()

    # ------------------------------------------------------------------ what people look at
    @property
    def passes(self):
        """The compile stages that ran, in order, each with its time and what it decided."""
        return self.compiled.passes + self._stages_after

    @property
    def plan(self):
        """The plan of the last call, the one ``stats`` measured (a call of new shapes or state is
        planned afresh; before any call, the example's); the first call's is ``compiled.plan``."""
        return self._last.compiled.plan

    @property
    def stats(self):
        """Measured over the last call (forward and, once it ran, backward)."""
        return self._last.session.stats

    @property
    def code(self) -> str:
        return "\n".join(f"# ---- {name} program ----{program.code}" for name, program in self.programs.items())

    def explain(self) -> str:
        """The plan's table (and, where it leaves more than half of the budget unused, why), then
        the schedule: one column per device, one row per compute task."""
        unused = self._budget_unused()
        return self.plan.table() + (f"\n{unused}" if unused else "") + "\n\n" + format_schedule(
            [forward + backward for forward, backward in self.device_actions], [d.name for d in self.devices])

    def _budget_unused(self) -> str:
        """Why the plan leaves more than half of the budget unused ("" where it does not): the
        planner's reason, or what fixed the plan instead of it."""
        plan = self.plan
        peak = max(plan.predicted_peak.values(), default=0)
        if plan.budget is None or 2 * peak > plan.budget:
            return ""
        schedule = self.compiled.schedule
        if self.options.pack_boundaries is not None:
            why = "pack_boundaries fixes the packs"
        elif schedule is not None and schedule.budget_note:
            why = schedule.budget_note
        elif schedule is None:
            why = (f"packed by the {plan.policy} policy with the microbatches given (the planner searches when "
                   "microbatches=None)")
        else:
            why = "the planner's fastest schedule needs no more"
        return f"budget: this plan uses {format_size(peak)} of {format_size(plan.budget)}: {why}"

    def record_timeline(self, on: bool = True, *, memory: bool = True) -> None:
        """Record (or stop recording) the next calls' timeline: every op's span and, with ``memory``,
        the device's memory after it, for ``save_trace`` and ``plot_memory``. Off by default
        (``timeline=``), as it costs bookkeeping per task. A HostDevice knows its memory only while
        it counts every tensor (``track_memory``): recording with ``memory`` counts them for the
        recorded calls, which then run as a tracked module does (slower; ``plot_memory`` predicts
        them so); ``memory=False`` records the spans alone, at the untracked speed."""
        self._timeline_memory = memory
        self.session.recording = on
        counting = self.options.tracks_memory or (on and memory and self.session.pack_compiler is None)
        for device in self.devices:
            if isinstance(device, HostDevice):
                device.track_memory = counting
        for module in self._by_key.values():
            if module is not self:
                module.record_timeline(on, memory=memory)

    def save_trace(self, path) -> None:
        """The last iteration's measured timeline as a Chrome trace (see ``harmony_fx.pictures``)."""
        pictures.save_trace(self._last, path)

    def plot_memory(self, path) -> None:
        """Memory over the last iteration per device, measured and predicted (its programs simulated
        on its device's spec, ``calibrate.spec_for``, in the mode it ran: recorded, and on a
        HostDevice counting every tensor or not), as a PNG. On a HostDevice, a measured iteration
        more than 1.25x off its prediction has this machine measured again
        (``calibrate.check_prediction``) before it is drawn."""
        last = self._last
        pictures.check_recorded(last.stats)  # before the simulation (and a first call's calibration)
        tracked = any(isinstance(device, HostDevice) and device.track_memory for device in last.devices)

        def predict():
            spec = spec_for(last.devices[0], last.budget, tracked=tracked, recorded=True)
            return simulate_module(last, spec, calibrate.host_spec())

        predicted = predict()
        if isinstance(last.devices[0], HostDevice):
            measured = max((end for *_, end in last.stats.spans), default=0.0)
            if measured and calibrate.check_prediction(measured, predicted.seconds):
                predicted = predict()
        pictures.plot_memory(last, path, predicted)

    # the artifact's parts, by the names people and tests know
    devices = property(lambda self: list(self.compiled.devices))
    budget = property(lambda self: self.compiled.budget)
    schedule = property(lambda self: self.compiled.schedule)
    layout = property(lambda self: self.compiled.layout)
    num_microbatches = property(lambda self: self.compiled.layout.num_microbatches)
    mb_sizes = property(lambda self: list(self.compiled.layout.mb_sizes))
    parallel = property(lambda self: self.compiled.layout.parallel)
    device_microbatches = property(lambda self: list(self.compiled.layout.device_microbatches))
    update_arrivals = property(lambda self: self.compiled.layout.update_arrivals)
    captured = property(lambda self: self.compiled.captured)
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
        """Bytes of a key as the plan counts them (from shapes and the graph's dtypes alone)."""
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
        own = self.calls.batch_size
        return sorted({m.calls.batch_size for m in self._by_key.values()} - {own})

    @property
    def variants(self) -> list[tuple[CallKey, "HarmonyModule"]]:
        """Every call state compiled so far and its module (this one's first)."""
        return list(self._by_key.items())

    # ------------------------------------------------------------------ running
    # harmony is its own compiler: a torch.compile around the module (nanoGPT's compile=True, a
    # compiled training step) runs it as it is, where Dynamo would trace into harmony's compile
    @torch.compiler.disable(reason="a harmony_fx module runs its own compiled program: call it outside "
                                   "fullgraph=True, or compile the model with torch.compile(model, backend='harmony')")
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        running = _models_running.__dict__.setdefault("ids", set())
        if id(self.model) in running:
            raise CaptureError(
                f"harmony_fx: {self.model._get_name()}'s forward calls its own compiled module (a forward set on the "
                "model that calls the compiled module?): the compiled module runs the model's forward, so it would "
                "call itself without end, as the model called eagerly would. Compile the module whose forward does "
                "the work, and call the compiled module from outside it.")
        running.add(id(self.model))
        try:
            if "compiled" not in self.__dict__:
                self._compile(args, kwargs)
            module = self._last = self.for_batch(args, kwargs)
            return module._run(args, kwargs)
        finally:
            running.discard(id(self.model))

    forward = _Forward()

    def _get_name(self) -> str:
        """The model's: what libraries read as the model's kind, as they read its forward's signature
        (transformers' Trainer shifts a causal LM's labels for label smoothing by its class's name)."""
        return self.model._get_name()

    def __repr__(self) -> str:
        return f"HarmonyModule(\n  (model): {repr(self.model).replace(chr(10), chr(10) + '  ')}\n)"

    def _run(self, args: tuple, kwargs: dict) -> Any:
        """Run the call on this module's program (its key is the call's)."""
        per_mb = self.calls.split(args, kwargs)
        if not self.compiled.signature.forward_only:
            flat_whole = per_mb[0] if len(per_mb) == 1 else self.captured.flatten_inputs(args, kwargs)
            outputs = HarmonyFunction.apply(self.session, self.calls, per_mb, *flat_whole,
                                            *self.compiled.trainable_params())
        else:
            iteration = self.session.start(per_mb)
            try:
                outputs = self.calls.merge_outputs(iteration)
            finally:
                iteration.release()
            self.session.finish_stats()
        return self.calls.structure(list(outputs), args, kwargs)

    def for_batch(self, args: tuple, kwargs: dict, **roles: Any) -> "HarmonyModule":
        """The module that runs a call on ``(args, kwargs)``: this one when the call's ``CallKey``
        (training flags, grad and autocast mode, parameters, input shapes: ``frontend.guards``) is
        the one it was compiled for, else one compiled for the call's key on its first call and
        kept for the next ones. ``roles``: what a module compiled for another key does otherwise
        (``updates=False``)."""
        key = CallKey.of(self.model, args, kwargs, self._reads)
        previous, self._previous_key = self._previous_key, key
        module = self if key == self._key else self._by_key.get(key)
        if module is not None:
            self._value_compiles = 0
            return module
        module = self._by_key[key] = self._compile_for(key, args, kwargs, roles)
        self._by_key[module._key] = module
        self._value_compiles = self._value_compiles + 1 if previous and key.values_changed(previous) else 0
        if self._value_compiles == VALUES_IN_A_ROW:
            changes = key.changes_from(previous, self.model, self._reads)
            warnings.warn(
                f"harmony_fx: each of the last {VALUES_IN_A_ROW} calls compiled the model again (captured and "
                f"planned it), for a new value of a Python number the graph holds as a constant: "
                f"{'; '.join(changes)}.", stacklevel=user_stacklevel())
        if len(self._by_key) == MANY_VARIANTS + 1:
            changes = key.changes_from(self._key, self.model, self._reads)
            padding = (" If the sequence length changes with every batch, pad to a multiple (DataCollatorWithPadding"
                       "(..., pad_to_multiple_of=64)) to bound how many lengths are compiled."
                       if "the inputs' shapes, dtypes or structure" in changes else "")
            warnings.warn(
                f"harmony_fx: this module has compiled for {len(self._by_key)} call states (train/eval, no_grad, "
                "autocast, parameters, input shapes, values passed in, attributes the forward reads), each kept "
                "with its graphs and buffers; this call differs from the first in: "
                f"{'; '.join(changes) or 'nothing it can name'}.{padding}", stacklevel=user_stacklevel())
        return module

    def _compile_for(self, key: CallKey, args: tuple, kwargs: dict, roles: dict) -> "HarmonyModule":
        """A module for a call state not seen before. Where only the inputs' shapes changed (a new
        sequence length, another batch size), the packing of the largest such call compiled so far
        is tried first: it is lowered and checked at the new shapes, and kept if it fits, so no new
        plan is searched. Otherwise (or if it does not fit) the call is planned afresh."""
        module = HarmonyModule(self.model, None, None, self.options, **{**self._roles, **roles})
        module._reads = self._reads  # its key as this module's keys are read
        changes = ", ".join(key.changes_from(self._key, self.model, self._reads))
        donor = self._largest_same_state(key)
        how = "planned afresh"
        if donor is not None:
            packing = f"the packing planned for microbatches of {donor.calls.describe_inputs()}"
            try:
                module._compile(args, kwargs, key, donor.compiled)
                how = f"{packing} reused (it fits)"
            except Exception as error:  # noqa: BLE001 - the donor's decisions are a shortcut: plan afresh
                # (it does not fit; or its microbatches cut this batch into sizes whose graphs differ,
                # a sample's graph having other layers than its packs index)
                # a refusal by its public name (CountedWhenAsked is one too)
                kind = BudgetTooSmallError if isinstance(error, BudgetTooSmallError) else type(error)
                first_line = str(error).splitlines()[0][:80]
                how = f"{packing} does not serve here ({kind.__name__}: {first_line}...): planned afresh"
                module.__dict__.pop("compiled", None)
        if "compiled" not in module.__dict__:  # no packing to reuse, or it did not fit
            try:
                module._compile(args, kwargs, key)
            except BudgetTooSmallError as error:
                error.add_note(f"harmony_fx: this call was planned afresh, as it differs from the first call "
                               f"({self.calls.describe_call()}), which fits the budget, in: {changes}")
                raise
        module._stages_after.add("guards", 0.0, f"a new call state ({changes}): {how}")
        module.record_timeline(self.session.recording, memory=self._timeline_memory)
        return module

    def _largest_same_state(self, key: CallKey) -> "HarmonyModule | None":
        """Of the modules compiled for ``key``'s state with inputs of the same structure and
        dtypes, the one whose inputs are largest."""
        same = [m for k, m in self._by_key.items() if k.same_but_shapes(key)]
        return max(same, key=lambda m: m.calls.input_numel, default=None)

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
                      output_grads: dict[Key, torch.Tensor], on_tier: Callable | None = None,
                      grad_buffers: GradientBuffers | None = None) -> Iteration:
        """Forward and backward in one go (the Trainer); see ``Session.run_iteration``."""
        self._last = self
        return self.session.run_iteration(per_mb, on_update, output_grads, on_tier, grad_buffers)


def refuse_compiled_modules(model: nn.Module, door: str = "harmony_fx.compile") -> None:
    """A module harmony_fx compiled already, as the model or inside it: it runs its own program,
    which no capture can trace (export would run it on FakeTensors). And a ``DistributedDataParallel``
    (what ``accelerate``'s ``prepare`` returns under torchrun): its forward runs DDP's reducer and
    collectives, which no capture can trace either, and a compiled graph would leave its gradient
    all-reduce out."""
    from torch.nn.parallel import DistributedDataParallel

    for name, module in model.named_modules():
        if isinstance(module, DistributedDataParallel):
            where = "" if not name else f" as its module {name!r}"
            what = (f"{door} was given a DistributedDataParallel{where}: its forward runs DDP's reducer and "
                    "collectives, which harmony_fx cannot capture into a graph. ")
            if door == "harmony_fx.Trainer":
                raise TypeError(what + "The Trainer trains across processes itself (it sums each pack's gradients "
                                "over torchrun's process group): give it the model DDP wraps (ddp.module).")
            raise TypeError(what + "Compile the model inside and let DDP wrap the compiled module, "
                            "DDP(harmony_fx.compile(model)); after accelerate's prepare, ddp.module = "
                            "harmony_fx.compile(ddp.module), then call the DDP module as before (its reducer sees "
                            "the gradients harmony's backward hands to autograd).")
        if not isinstance(module, HarmonyModule):
            continue
        if not name:
            raise TypeError(
                "harmony_fx was given a module it compiled already (a HarmonyModule): give it that module's model, "
                "hm.model, with the options you want.")
        if module.model is model:
            raise TypeError(
                f"the module {name!r} of {type(model).__name__} is that model's own compiled module, set on it after "
                "compiling: the model now holds itself (a cycle nothing can walk). Keep the compiled module outside "
                f"the model it compiled: del model.{name}, and hold it in a variable or on another object.")
        raise TypeError(
            f"the module {name!r} of {type(model).__name__} is a harmony_fx compiled module, which runs its own "
            "program where a capture needs the model's Python code: compile the outer model whole, with that part "
            "as the plain module it compiled (its .model), or keep the outer model eager around the compiled part.")


# past this many compiled call states a module warns (as Dynamo's recompile limit): each holds its graphs
MANY_VARIANTS = 8
# this many calls in a row, each compiling for a new value of a number (a timestep passed as an int,
# a step counter the forward reads), warn: such a value compiles at every call
VALUES_IN_A_ROW = 3


def _outside_inference_mode(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's inputs as tensors usable outside ``inference_mode`` (capturing needs grad mode):
    an inference tensor is cloned, as the same values."""
    def usable(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_inference():
            with torch.inference_mode(False):
                return x.clone()
        return x
    return microbatch.pytree.tree_map(usable, (args, kwargs))


@contextlib.contextmanager
def _outside_the_callers_modes():
    """Compiling runs the forward on FakeTensors, many times: not under the caller's anomaly mode
    (its checks need values: every compile failed), its saved-tensor hooks (a non-reentrant
    ``torch.utils.checkpoint`` around the call counted those runs' saved tensors as the call's, and
    its recompute raised) nor its dispatch modes (a ``FlopCounterMode`` around the first call, as in
    Lightning's model summary, counted every such run: 8.5x eager's flops). All are the caller's
    again when the compile ends."""
    callers = torch._C._autograd._top_saved_tensors_default_hooks(False)
    # only where the caller has some: functorch's grad refuses to run under any (a model using it is
    # refused in words at capture)
    hooks = torch.autograd.graph.saved_tensors_hooks(_same, _same) if callers is not None else contextlib.nullcontext()
    with torch.autograd.set_detect_anomaly(False), hooks, _disable_current_modes():
        yield


def _same(value: Any) -> Any:
    return value


def _needs_grad(key: CallKey, model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a call with ``key`` builds a graph for a backward: grad on, and a parameter or an
    input that requires grad (else the program is forward-only). Read from the model, not the
    key: a lazy module's parameters, not materialized yet, have no facts in it but require grad."""
    if not key.grad:
        return False
    leaves = microbatch.pytree.tree_leaves((args, kwargs))
    return (any(p.requires_grad for p in model.parameters())
            or any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves))


# what exists once the model is compiled (asking for it before says so, instead of a bare AttributeError)
_AFTER_COMPILING = frozenset(
    name for name, value in vars(HarmonyModule).items() if isinstance(value, property) and not name.startswith("_"))
