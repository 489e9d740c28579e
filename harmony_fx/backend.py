"""The ``torch.compile`` backend: ``torch.compile(model, backend="harmony", options={...})``.

Dynamo hands the backend one ``fx.GraphModule`` per graph it captured (several when the forward
has graph breaks) with that graph's example inputs. Since torch 2.5 Dynamo inlines ``nn.Module``
calls and lifts the model's parameters and buffers to graph inputs, so the inputs mix the model's
state with the call's activations. The backend

1. sorts the inputs (``_Kind``): an ``nn.Parameter`` is a parameter; a tensor Dynamo reached
   through a module or a global (``self.bn._buffers['running_mean']``, a tensor attribute) is a
   buffer; a Python number Dynamo passes as an input (a symbolic size, a float attribute wrapped in
   a tensor) is a size when it is a dim of an activation, unread where the graph never reads it (an
   input view's storage offset, which changes from batch to batch) and otherwise a constant; every other
   tensor (from the call's arguments, or made by the graph before a break, also as a field of an
   object such as a ``ModelOutput``) is an activation;
2. on the first call (when every input is a real value) wraps the graph in ``_DynamoGraph``, an
   ``nn.Module`` whose parameters and buffers *are* the model's own tensor objects and whose
   forward takes the activations only, and compiles that with ``harmony_fx.compile`` (``options``
   are its keyword options): the host masters are the model's own parameters, gradients accumulate
   into their ``.grad``, buffer updates (BatchNorm statistics) land in the model's buffers;
3. calls the harmony module with the activations; a new activation shape gets its own program,
   and so do new tensors of the model's or new values of the numbers baked in (Dynamo runs one
   graph for every instance of a class: a model loaded from a checkpoint, ``load_state_dict(assign=True)``),
   in place of the program made for the old ones.

A call that compiles raises what the compile raised. Dynamo calls the same compiled frame again on
the next call, so a ``BudgetTooSmallError`` (no packing of this graph fits the budget at these
shapes) is remembered and raised again without planning anew: it cannot change for the same graph,
shapes and options. So is the refusal of ``precision="bf16"`` for a graph in which Dynamo baked a
computation in fp32 (``_dtypes_dynamo_baked``).

Microbatches run the graph at a smaller batch, so its batch dim must be symbolic: with Dynamo's
default static shapes the batch size is baked into the graph (``x.view(8, -1)``), and the backend
refuses ``microbatches > 1`` and says to compile with ``dynamic=True`` (or ``mark_dynamic``); with
the microbatches left to the planner, such a graph runs as one microbatch (a cut could meet a
baked size anywhere), and a refusal of its budget notes that ``dynamic=True`` may fit less.

Options the code does not pass come from the ``HARMONY_FX_*`` environment variables
(``config.options_from_environment``: ``HARMONY_FX_MEMORY_BUDGET=8GiB python train.py``), so that
a script that calls ``torch.compile(model, backend="harmony")`` runs under a budget unedited.

Each graph of a model with graph breaks becomes its own harmony program; gradients cross the break
through autograd, as between any two autograd functions. The backend is registered through the
``torch_dynamo_backends`` entry point (``pyproject.toml``): ``backend="harmony"`` works after a
plain ``import torch``.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import keyword
import re
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.fx import traceback as fx_traceback
from torch.utils import _pytree as pytree

from harmony_fx.api import MANY_VARIANTS, HarmonyModule, compile as harmony_compile
from harmony_fx.compiler.packing import BudgetTooSmallError
from harmony_fx.config import HOST_STATE_OPTIONS, CompileOptions, check_option_names, option_names, with_environment
from harmony_fx.frontend.capture import CaptureError
from harmony_fx.frontend.refusals import MixedDtypes, model_line
from harmony_fx.ir import autograd_functions, meta
from harmony_fx.user_frames import user_stacklevel

__all__ = ["harmony"]


class _Kind(enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"
    ACTIVATION = "activation"
    SIZE = "size"          # a dim of an activation: recomputed from the (micro)batch
    CONSTANT = "constant"  # any other number: baked in at the first call
    UNREAD = "unread"      # a number the graph never reads (an input view's storage offset): any value does


@dataclasses.dataclass(frozen=True)
class _Input:
    name: str
    kind: _Kind
    dim_of: tuple[int, int] | None = None  # SIZE: (graph input index of the activation, dim)


def harmony(gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None,
            mode: str | None = None) -> Callable[..., Any]:
    """Compile one Dynamo graph for harmony; ``options`` are ``harmony_fx.compile``'s keyword options."""
    if mode not in (None, "default"):
        raise ValueError(f"torch.compile(mode={mode!r}) has no meaning for the harmony backend; pass harmony's "
                         f"settings as options={{...}} (any of {', '.join(sorted(option_names()))}).")
    check_option_names(options or {}, option_names(), 'torch.compile(backend="harmony") options')
    # HARMONY_FX_* variables: a script run under a budget unedited. HARMONY_FX_NVME_PATH and
    # HARMONY_FX_HOST_MEMORY are for the Trainer's doors (the optimizer's state), which a script
    # may use beside torch.compile: not refused here, where the user passed neither
    options = {**{name: value for name, value in with_environment(None).items() if name not in HOST_STATE_OPTIONS},
               **(options or {})}
    if not any(node.op in ("call_function", "call_method", "call_module") for node in gm.graph.nodes):
        return gm  # a fragment between graph breaks that computes nothing (it hands values on): as it is
    _warn_at_dynamos_last_compile()
    placeholders = gm.graph.find_nodes(op="placeholder")
    inputs = _sort_inputs(placeholders, example_inputs)
    inputs = _numbers_as_tensors(gm, placeholders, inputs)
    if _updates_parameters(gm, placeholders, inputs) or _returns_only_state(gm, placeholders, inputs):
        # not a forward to train: an optimizer's step (a whole training step compiled, or optimizer.step
        # itself), an EMA or a clip writing the parameters in place. They live in host memory, where
        # harmony keeps them: the graph runs as it is, on them
        return gm
    _copy_stack_values_written_in_place(gm, placeholders, inputs)
    static = None if "batch_dims" in options else _static_batch_input(placeholders, inputs)
    if static is not None and _num_microbatches(options) > 1:
        # raised by the graph when called, not here: Dynamo's suppress_errors would swallow a backend's
        # error and run the function eagerly, outside harmony and its budget, with only a log line
        return _refusing(ValueError(
            f"Dynamo baked the batch size into the graph (its input {_users_name(static)} has the fixed shape "
            f"{tuple(static.meta['example_value'].shape)}), so harmony cannot run it on microbatches. Compile with "
            "torch.compile(model, backend='harmony', dynamic=True, options=...) (or call "
            "torch._dynamo.mark_dynamic(x, 0) on each batched input before the first call), or use microbatches=1."))
    if static is not None and options.get("microbatches") is None:
        # the planner may not cut what Dynamo fixed; a refusal says that dynamic=True would let it
        options = {**options, "microbatches": 1}
    return _Compiled(gm, inputs, options, static_batch=static is not None)


def _numbers_as_tensors(gm: fx.GraphModule, placeholders: Sequence[fx.Node], inputs: list[_Input]) -> list[_Input]:
    """A float Dynamo stopped specializing (a temperature annealed every step) comes as a 0-dim tensor,
    so that a new value compiles nothing, read with ``.item()`` where the graph computes with it.
    Where every use of that number is arithmetic with tensors, the graph computes with the 0-dim
    tensor itself (a 0-dim float does not change the other operand's dtype) and it is an input,
    read at every call, not a constant baked into harmony's program."""
    import operator

    arithmetic = {operator.mul, operator.truediv, operator.add, operator.sub, operator.neg, operator.pow,
                  torch.mul, torch.div, torch.add, torch.sub}
    changed = list(inputs)
    for index, (node, item) in enumerate(zip(placeholders, inputs)):
        grapharg = node.meta.get("grapharg")
        value = node.meta.get("example_value")
        if item.kind != _Kind.CONSTANT or not getattr(grapharg, "pass_arg_as_tensor", False) \
                or not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.is_floating_point():
            continue
        reads = [user for user in node.users if user.op == "call_method" and user.target == "item"]
        if len(reads) != len(node.users) or not all(
                use.op == "call_function" and use.target in arithmetic and any(
                    isinstance(arg, fx.Node) and arg is not read and isinstance(arg.meta.get("example_value"),
                                                                                torch.Tensor) for arg in use.args)
                for read in reads for use in read.users):
            continue
        for read in reads:
            read.replace_all_uses_with(node)
            gm.graph.erase_node(read)
        changed[index] = _Input(item.name, _Kind.ACTIVATION)
    if changed != inputs:
        gm.recompile()
    return changed


_IN_PLACE_OPERATORS = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                                 "ixor"})


def _in_place(node: fx.Node, augmented: bool = True) -> bool:
    """Whether a node of Dynamo's graph (torch functions and methods, not ATen ops) writes its first
    argument: named with a trailing underscore (``add_``, ``torch._foreach_mul_``), or (``augmented``)
    an augmented assignment (``+=``)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or (augmented and name in _IN_PLACE_OPERATORS)


def _copy_stack_values_written_in_place(gm: fx.GraphModule, placeholders: Sequence[fx.Node],
                                        inputs: Sequence[_Input]) -> None:
    """A value Dynamo held on its stack at a graph break (``___stack0``: a BatchNorm's output where
    ``momentum=None`` broke the graph inside it, then ``ReLU(inplace=True)``) that the graph writes in
    place: the graph writes a copy of it instead. Harmony refuses a write into an input (the caller's
    tensor would not change), with advice a user cannot follow for a value no code of theirs holds:
    only the frame Dynamo resumes reads it, and from the graph on."""
    written = [node for node, item in zip(placeholders, inputs)
               if item.kind == _Kind.ACTIVATION and _users_name(node).startswith("___stack")
               and any(_in_place(user) or user.kwargs.get("inplace") for user in node.users)]
    for node in written:
        with gm.graph.inserting_after(placeholders[-1]):
            copied = gm.graph.call_method("clone", (node,))
        copied.meta = {key: value for key, value in node.meta.items() if key == "example_value"}
        node.replace_all_uses_with(copied, delete_user_cb=lambda user, copied=copied: user is not copied)
    if written:
        gm.recompile()


def _returns_only_state(gm: fx.GraphModule, placeholders: Sequence[fx.Node], inputs: Sequence[_Input]) -> bool:
    """Whether everything the graph returns is a parameter or buffer, as it is or updated in place
    (a graph of ``self.calls += 1`` alone, split from the forward by a graph break): nothing for a
    program to compute, it runs as it is."""
    state = {node for node, item in zip(placeholders, inputs) if item.kind in (_Kind.PARAM, _Kind.BUFFER)}

    def is_state(value: Any) -> bool:
        while isinstance(value, fx.Node) and value.op in ("call_function", "call_method") and value.args:
            if not _in_place(value):
                return False
            value = value.args[0]  # what an in-place op returns: what it wrote into
        return not isinstance(value, fx.Node) or value in state

    return all(is_state(value) for value in pytree.tree_leaves(gm.graph.find_nodes(op="output")[0].args))


def _updates_parameters(gm: fx.GraphModule, placeholders: Sequence[fx.Node], inputs: Sequence[_Input]) -> bool:
    """Whether the graph writes a parameter in place (``p.add_(...)``, ``torch._foreach_mul_(params,
    ...)``: Dynamo's graphs are of torch functions and methods, in-place ones named with a trailing
    underscore)."""
    params = {node for node, item in zip(placeholders, inputs) if item.kind == _Kind.PARAM}

    def is_parameter(arg: Any) -> bool:  # lifted to an input, or held by the graph (an optimizer's)
        if arg in params:
            return True
        return (isinstance(arg, fx.Node) and arg.op == "get_attr"
                and isinstance(getattr(gm, str(arg.target), None), nn.Parameter))

    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or not _in_place(node, augmented=False):
            continue
        written = node.args[0] if node.args else None
        if any(is_parameter(arg) for arg in (written if isinstance(written, (list, tuple)) else [written])):
            return True
    return False


def _refusing(error: Exception) -> Callable[..., Any]:
    def refused(*args: Any) -> Any:
        raise error.with_traceback(None)

    return refused


def _warn_at_dynamos_last_compile() -> None:
    """Past ``torch._dynamo.config.recompile_limit`` compiles of one frame, Dynamo runs it eagerly
    without calling the backend: outside harmony, and past its memory budget. Said at the last one."""
    from torch._dynamo import config
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    limit = getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", None)
    if compile_id is None or limit is None or compile_id.frame_compile_id != limit - 1:
        return
    warnings.warn(f"harmony_fx: Dynamo has now compiled this function {limit} times, its limit (torch._dynamo."
                  "config.recompile_limit): a call in a new state after this one (a new sequence length, a new "
                  "batch size) runs eagerly, outside harmony and its memory budget. Compile with dynamic=True "
                  "(shapes that change do not compile again), pad the inputs to a few lengths, or raise the limit.",
                  stacklevel=user_stacklevel())


def _num_microbatches(options: dict) -> int:
    """As ``HarmonyModule`` will decide: ``microbatches``, else one per device."""
    if options.get("microbatches"):
        return options["microbatches"]
    devices = options.get("devices")
    if devices is None:
        return max(torch.cuda.device_count(), 1)
    return devices if isinstance(devices, int) else len(devices) if isinstance(devices, (list, tuple)) else 1


def _sort_inputs(placeholders: Sequence[fx.Node], example_inputs: Sequence[Any]) -> list[_Input]:
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    graphargs = [node.meta.get("grapharg") for node in placeholders]  # Dynamo's record of where each came from
    sources = [getattr(grapharg, "source", None) for grapharg in graphargs]
    activation_of_source = {}
    kinds = []
    for index, (grapharg, value, source) in enumerate(zip(graphargs, example_inputs, sources)):
        if isinstance(value, nn.Parameter):
            kind = _Kind.PARAM
        elif not isinstance(value, torch.Tensor) or getattr(grapharg, "pass_arg_as_tensor", False):
            kind = _Kind.CONSTANT  # refined to SIZE below, once every activation is known
        elif _is_state(source):
            kind = _Kind.BUFFER
        else:
            kind = _Kind.ACTIVATION
            activation_of_source[source] = index
        kinds.append(kind)
    inputs = []
    for node, kind, source in zip(placeholders, kinds, sources):
        if (kind == _Kind.CONSTANT and isinstance(source, TensorPropertySource)
                and source.prop == TensorProperty.SIZE and source.base in activation_of_source):
            inputs.append(_Input(node.name, _Kind.SIZE, (activation_of_source[source.base], source.idx)))
        elif kind == _Kind.CONSTANT and not node.users:
            # Dynamo passes the symbols of what it guards on (the storage offset of a batch sliced
            # from one tensor, source[i:i + bptt]) whether or not the graph computes with them
            inputs.append(_Input(node.name, _Kind.UNREAD))
        else:
            inputs.append(_Input(_users_name(node) if kind == _Kind.ACTIVATION else node.name, kind))
    return inputs


def _is_state(source: Any) -> bool:
    """Whether Dynamo reached the tensor through a module (a parameter, a buffer, a tensor attribute
    of it or of an object it holds) or a global: state that outlives the call. Through a local's
    attribute or item (a ``ModelOutput`` made before a graph break, a batch passed as a dataclass),
    it is an activation, whose gradient must flow. Told by Dynamo's guard source, by its name (its
    methods changed across torch versions)."""
    guard = getattr(source, "guard_source", None)
    guard = guard() if callable(guard) else guard
    name = getattr(guard, "name", "")
    return name.startswith("GLOBAL") or "NN_MODULE" in name or "FSDP" in name


def _static_batch_input(placeholders: Sequence[fx.Node], inputs: Sequence[_Input]) -> fx.Node | None:
    """An activation whose batch size Dynamo fixed (``None``: every batch is symbolic). A batch of
    one sample is fixed even under ``dynamic=True`` (Dynamo specializes sizes 0 and 1): it runs as
    one microbatch, as any batch smaller than the microbatches does."""
    for node, item in zip(placeholders, inputs):
        value = node.meta.get("example_value")
        if item.kind == _Kind.ACTIVATION and isinstance(value, torch.Tensor) and value.dim() > 0:
            if not isinstance(value.shape[0], torch.SymInt) and value.shape[0] != 1:
                return node
    return None


def _users_name(node: fx.Node) -> str:
    """The name the user's code gives the value Dynamo made the placeholder ``node`` of, as an
    identifier (``L['batch']['input_ids']``: ``batch_input_ids``), so that harmony's messages and
    graphs say ``x`` where Dynamo's graph says ``l_x_``; Dynamo's name where it has no source (it
    drops its record of sources once its compile is done: read while the backend is called)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    words = re.findall(r"[A-Za-z_]\w*|\d+", str(getattr(source, "name", "")))
    name = "_".join(words[1:] if words[:1] in (["L"], ["G"]) else words)
    return name if name.isidentifier() and not keyword.iskeyword(name) else node.name


class _DynamoGraph(nn.Module):
    """Dynamo's graph as a module: the model's parameters and buffers are this module's own (the
    same tensor objects), and ``forward`` takes the activations only."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[_Input], args: Sequence[Any]) -> None:
        super().__init__()
        self.graph_module = gm
        self.inputs = list(inputs)
        self.constants: dict[int, Any] = {}
        for index, (item, value) in enumerate(zip(inputs, args)):
            if item.kind == _Kind.PARAM:
                self.register_parameter(item.name, value)
            elif item.kind == _Kind.BUFFER:
                self.register_buffer(item.name, value)
            elif item.kind == _Kind.CONSTANT:
                self.constants[index] = value
        self.activation_indices = [i for i, item in enumerate(inputs) if item.kind == _Kind.ACTIVATION]
        # export names the graph's inputs after forward's parameters: the user's names, not inputs_0
        names: list[str] = []
        for index in self.activation_indices:
            names.append(inputs[index].name if inputs[index].name not in names else f"{inputs[index].name}_{index}")
        self.signature = inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
                                            for name in names])

    @property
    def forward(self) -> Callable[..., Any]:
        """``run`` on this module (a copy's own, as capture in bf16 makes), signed with the names."""
        run = functools.partial(_DynamoGraph.run, self)
        run.__signature__ = self.signature
        return run

    def run(self, *inputs: torch.Tensor) -> Any:
        by_index = dict(zip(self.activation_indices, inputs))
        args = []
        for index, item in enumerate(self.inputs):
            if item.kind == _Kind.ACTIVATION:
                args.append(by_index[index])
            elif item.kind == _Kind.SIZE:
                args.append(by_index[item.dim_of[0]].shape[item.dim_of[1]])
            elif item.kind == _Kind.CONSTANT:
                args.append(self.constants[index])
            elif item.kind == _Kind.UNREAD:
                args.append(None)
            else:
                args.append(getattr(self, item.name))
        # run node by node with each node's meta current, so the captured graph's nodes inherit
        # Dynamo's nn_module_stack ("L['self'].h[0]"), from which find_layers cuts the layers
        with fx_traceback.preserve_node_meta():
            return _Interpreter(self.graph_module).run(*args)


class _Interpreter(fx.Interpreter):
    """Runs Dynamo's graph; while harmony captures it, each autograd Function Dynamo kept whole
    (``autograd_function_apply``, its forward and backward as subgraphs) is recorded as one node
    that applies it (``ir.autograd_functions``): export would trace its forward alone, under
    no_grad, and no gradient would reach what comes before it."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.higher_order.autograd_function_apply and autograd_functions.recording():
            forward, backward, *tensors = args
            return autograd_functions.record("autograd_function_apply", functools.partial(
                _DynamoFunction.apply, forward, backward, kwargs), tuple(tensors), {})
        if target is getattr(torch.ops.higher_order, "tag_activation_checkpoint", None):
            # torch.utils.checkpoint's region, run as it is: harmony recomputes each pack itself
            # (export refuses Dynamo's checkpoint op)
            body, *operands = args
            return body(*operands)
        return super().call_function(target, args, kwargs)


class _DynamoFunction(torch.autograd.Function):
    """An autograd Function Dynamo kept whole (its forward and backward graphs), applied as
    ``torch.ops.higher_order.autograd_function_apply`` applies it, but with the values its forward
    saves held by ``ctx.save_for_backward``: torch's makes a Function class at each call whose
    backward closes over them, and a class lives in a reference cycle, so they (a pack's weights on
    the device, the saved input) outlived the backward until the garbage collector ran, counted
    on the device into the next step (BLOOM's GELU passed its budget)."""

    @staticmethod
    def forward(ctx, forward: fx.GraphModule, backward: fx.GraphModule, kwargs: dict, *args: Any) -> Any:
        output, saved = fx.Interpreter(forward).run(*args)
        ctx.backward_graph = backward
        ctx.tensor_at = [isinstance(value, torch.Tensor) for value in saved]
        ctx.others = [None if is_tensor else value for value, is_tensor in zip(saved, ctx.tensor_at)]
        ctx.save_for_backward(*[value for value in saved if isinstance(value, torch.Tensor)])
        outputs = list(output) if isinstance(output, (tuple, list)) else [output]
        if kwargs.get("dirty_idx"):
            ctx.mark_dirty(*[outputs[i] for i in kwargs["dirty_idx"]])
        if kwargs.get("non_differentiable_idx"):
            ctx.mark_non_differentiable(*[outputs[i] for i in kwargs["non_differentiable_idx"]])
        return output

    @staticmethod
    def backward(ctx, *grads: Any) -> Any:
        tensors = iter(ctx.saved_tensors)
        saved = [next(tensors) if is_tensor else value for value, is_tensor in zip(ctx.others, ctx.tensor_at)]
        result = fx.Interpreter(ctx.backward_graph).run(*grads, *saved)
        return (None, None, None, *(result if isinstance(result, (tuple, list)) else (result,)))


class _Compiled:
    """What Dynamo calls in place of its graph: Dynamo's flat inputs in, the graph's outputs out.
    The harmony module is compiled at the first call with each set of activation shapes."""

    def __init__(self, gm: fx.GraphModule, inputs: Sequence[_Input], options: dict, static_batch: bool = False) -> None:
        self.gm, self.inputs, self.options = gm, list(inputs), options
        self.static_batch = static_batch  # Dynamo fixed the batch size: one microbatch
        # (activation shapes, the state's identity) -> its program, least recently used first
        self.modules: dict[tuple, tuple[_DynamoGraph, HarmonyModule, int]] = {}
        self.refusals: dict[tuple, Exception] = {}  # the same key -> the compile's refusal
        self.states_dropped = 0  # programs let go for the bound (compiled again if their state comes back)

    @property
    def harmony_modules(self) -> list[HarmonyModule]:
        """The harmony modules compiled so far (one per activation shape): ``plan``, ``code``, ``stats``."""
        return [hm for _, hm, _ in self.modules.values()]

    def __call__(self, *args: Any) -> Any:
        activations = [arg for arg, item in zip(args, self.inputs) if item.kind == _Kind.ACTIVATION]
        key = (tuple((tuple(x.shape), x.dtype, x.requires_grad) for x in activations), self._state_key(args))
        if key not in self.modules:
            refusal = self.refusals.get(key)
            if refusal is not None:
                raise _detached(refusal)
            module = _DynamoGraph(self.gm, self.inputs, args)
            try:
                hm = harmony_compile(module, tuple(activations), **self.options)
            except BudgetTooSmallError as error:
                raise self._remembered(key, error)
            except (CaptureError, MixedDtypes) as error:
                baked = _wide_casts_dynamo_baked(self.gm, self.options)
                if baked is None:
                    raise
                raise self._remembered(key, baked) from error
            baked = _dtypes_dynamo_baked(hm)
            if baked is not None:
                raise self._remembered(key, baked)
            self.modules[key] = module, hm, _state_bytes(args, self.inputs)
            self._bound(key)
            if sum(other[1] == key[1] for other in self.modules) == MANY_VARIANTS + 1:
                warnings.warn(
                    f"harmony_fx: this graph has been compiled for {MANY_VARIANTS + 1} input shapes (a program each, "
                    "planned anew, its graphs and buffers kept); dynamic=True spares Dynamo's recompiles, not "
                    "harmony's plans. If the sequence length changes with every batch, pad to a multiple "
                    "(DataCollatorWithPadding(..., pad_to_multiple_of=64)) to bound how many lengths are compiled.",
                    stacklevel=user_stacklevel())
        self.modules[key] = self.modules.pop(key)  # the most recently used last
        return self.modules[key][1](*activations)

    def _state_key(self, args: Sequence[Any]) -> tuple:
        """The identity of the tensors and the numbers harmony's program is planned around: Dynamo
        runs one graph for every instance of a class (each layer of a model where a graph break
        sits in the layer, another model, weights loaded with ``assign=True``) and for new values of
        a number it passes in, where each program holds the first's."""
        return tuple(id(arg) if item.kind in (_Kind.PARAM, _Kind.BUFFER) else _constant_key(arg)
                     for arg, item in zip(args, self.inputs)
                     if item.kind in (_Kind.PARAM, _Kind.BUFFER, _Kind.CONSTANT))  # sizes: the activations

    def _bound(self, newest: tuple) -> None:
        """Each program holds its state's tensors: the least recently used are let go past
        ``_PROGRAMS_KEPT`` programs or ``_STATE_BYTES_KEPT`` bytes of their state (weights loaded
        again and again would otherwise stay alive), and said once."""
        while len(self.modules) > 1 and (len(self.modules) > _PROGRAMS_KEPT or sum(
                nbytes for _, _, nbytes in self.modules.values()) > _STATE_BYTES_KEPT):
            oldest = next(iter(self.modules))
            if oldest == newest:
                break
            del self.modules[oldest]
            self.states_dropped += 1
            if self.states_dropped == 1:
                warnings.warn(
                    f"harmony_fx: Dynamo runs this graph for more states (model instances, layers, weights loaded "
                    f"with assign=True, numbers passed in) than the {_PROGRAMS_KEPT} programs or "
                    f"{_STATE_BYTES_KEPT >> 30} GiB of their tensors harmony keeps for it; the least recently used "
                    "are let go and compiled again if they come back. A number that changes every call is cheaper as "
                    "a tensor.", stacklevel=user_stacklevel())

    def _remembered(self, key: tuple, error: Exception) -> Exception:
        """``error``, kept to be raised again at the next call with ``key``: it cannot change for the
        same graph, shapes and options."""
        if isinstance(error, BudgetTooSmallError):
            error.add_note("harmony_fx: this is the smallest budget of one graph Dynamo made of the model; where it "
                           "breaks the model into several (a hook, a print, data-dependent Python), each is planned "
                           "when Dynamo first runs it and may need more: torch._dynamo.explain(model)(*inputs) lists "
                           "them, and harmony_fx.compile(model) plans a model it captures whole at once")
            if self.static_batch:
                error.add_note("harmony_fx: Dynamo baked the batch size into this graph, so it runs as one "
                               "microbatch; compiled with torch.compile(..., dynamic=True), harmony may cut the batch "
                               "into microbatches, which can fit a smaller budget")
        error.add_note("harmony_fx: remembered for this graph at these shapes and options: later calls raise "
                       "it again without planning")
        self.refusals[key] = _detached(error)  # raising it would keep the call's frames, its inputs, alive
        return error


def _detached(error: BaseException) -> BaseException:
    """A copy of ``error`` (its message, attributes such as ``smallest_budget``, notes and cause) without
    a traceback: a remembered refusal raised as it is would hold the frames of the last call that raised
    it, and with them that call's inputs, for as long as the graph lives."""
    copy = type(error).__new__(type(error), *error.args)
    copy.__dict__.update(error.__dict__)
    if "__notes__" in error.__dict__:
        copy.__notes__ = list(error.__notes__)
    if error.__cause__ is not None:
        copy.__cause__ = _detached(error.__cause__)
    copy.__suppress_context__ = error.__suppress_context__
    return copy


# programs one graph keeps for the states Dynamo runs it for, and the bytes of those states' tensors
_PROGRAMS_KEPT = 64
_STATE_BYTES_KEPT = 4 << 30


def _state_bytes(args: Sequence[Any], inputs: Sequence[_Input]) -> int:
    return sum(arg.numel() * arg.element_size() for arg, item in zip(args, inputs)
               if item.kind in (_Kind.PARAM, _Kind.BUFFER) and isinstance(arg, torch.Tensor))


def _constant_key(value: Any) -> Any:
    """A number Dynamo passes in, as a key: a 0-dim tensor (an unspecialized float) by its value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.flatten().tolist()) if value.numel() <= 16
                else id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_constant_key(item) for item in value)
    try:
        hash(value)
    except TypeError:
        return ("unhashable", repr(value))
    return value


def _wide_casts_dynamo_baked(gm: fx.GraphModule, options: dict) -> ValueError | None:
    """Where capturing Dynamo's graph at a compute dtype failed, a node of it that names a wider
    float dtype (a cache or a cast Dynamo made in float32: the capture met it as a dtype mismatch),
    said as ``_dtypes_dynamo_baked`` says it; ``None`` without one."""
    dtype = CompileOptions(**options).compute_dtype
    if dtype is None:
        return None
    for node in gm.graph.nodes:
        wide = [a for a in pytree.tree_leaves((node.args, node.kwargs))
                if isinstance(a, torch.dtype) and a.is_floating_point and a.itemsize > dtype.itemsize]
        if wide:
            return _baked_refusal(options.get("precision"), node, wide[0])
    return None


def _baked_refusal(precision: str | None, node: fx.Node, wide: torch.dtype) -> ValueError:
    line = model_line(node)
    return ValueError(
        f"precision={precision!r} through torch.compile: Dynamo's graph computes "
        f"{meta.describe(node)} in {wide}" + (f" (the model's `{line}`)" if line else "") + ". Dynamo "
        "bakes in the dtypes it saw (x.to(query.dtype) becomes a cast to float32), and that value would "
        "meet bf16 weights. Compile the model with harmony_fx.compile(model, ..., precision='bf16'), "
        "which captures it as it runs in bf16, or keep precision='fp32' and train under "
        "torch.autocast(device_type, dtype=torch.bfloat16).")


def _dtypes_dynamo_baked(hm: HarmonyModule) -> ValueError | None:
    """Under ``precision="bf16"`` harmony captures a model as it runs on bf16 tensors, so the casts
    that follow a tensor's dtype follow bf16 (``frontend.compute_dtype``). Dynamo's graph has them
    baked already: it turns ``x.to(query.dtype)`` into a cast to the fp32 it saw, and an fp32
    value would then meet bf16 weights. The error that says where, instead of a failure inside the
    first run (``None``: the graph computes in bf16 throughout)."""
    dtype = hm.options.compute_dtype
    if dtype is None:
        return None
    for node in hm.captured.gm.graph.nodes:
        wide = [leaf.dtype for leaf in pytree.tree_leaves(node.meta.get("val"))
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype.itemsize > dtype.itemsize]
        if node.op == "call_function" and wide:
            return _baked_refusal(hm.options.precision, node, wide[0])
    return None
