"""Model → GraphModule whose placeholders are the model's parameters, buffers and inputs.

1. ``torch.export.export(model, args, kwargs, strict=False)`` (the training IR: ATen ops, buffers
   such as BatchNorm statistics mutated in place, dropout as ``aten.dropout``).
2. If export fails, ``torch.fx.symbolic_trace`` with a tracer that enters every module, then lift
   each ``get_attr`` of a parameter or buffer to a placeholder and propagate FakeTensors.
3. Either way every node carries ``meta["val"]``, every placeholder ``meta[ROLE]``, and the
   parameters are mapped back to the *model's own* ``nn.Parameter`` objects (tied weights are one
   object, whatever names they go by).

When both fail, one ``ValueError`` shows both reasons and what to try; for constructs it recognises
(a Hugging Face key/value cache in the output, control flow on tensor values) it names the construct
and the option that avoids it (``use_cache=False``, ``torch.where``).

Keyword inputs and structured outputs (dicts, dataclasses such as Hugging Face's ``ModelOutput``)
go through ``torch.utils._pytree``: ``flatten_inputs`` and ``unflatten_outputs`` convert between them
and the graph's flat placeholders and outputs. Every scalar output (a loss) also gets a
``ScalarReduction`` (see ``analysis.reductions``), so a microbatched run can put it back together.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import operator
import os
import pathlib
import random
import re
import sys
import traceback
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import cast_symbool_to_symint_guardless
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from harmony_fx.analysis.reductions import ScalarReduction, scalar_reduction
from harmony_fx.ir import meta
from harmony_fx.ir.autograd_functions import FunctionUnderVmap, custom_backwards
from harmony_fx.ir.values import fakes_of
from harmony_fx.frontend.backward_hooks import (
    hooks_registered_in_forward, refuse_forward_hooks_keeping_tensors, refuse_module_backward_hooks,
    refuse_tensor_hooks,
)
from harmony_fx.frontend.attribute_reads import Reads, reads_recorded
from harmony_fx.frontend.attribute_writes import new_tensors_taken_back, tensor_attribute_writes_said
from harmony_fx.frontend.compute_dtype import fake_in, in_compute_dtype
from harmony_fx.frontend.causal_masks import causal_masks_applied
from harmony_fx.frontend.checkpoint_regions import checkpoints_as_plain_calls
from harmony_fx.frontend.decomposition_fixes import decomposition_fixes
from harmony_fx.frontend.functorch_regions import inline_vmap_regions
from harmony_fx.frontend.key_value_caches import key_value_caches_off
from harmony_fx.frontend.random_branches import RandomBranchError, certain_random_branches
from harmony_fx.frontend.refusals import first_refused, refusal
from harmony_fx.passes.bound_sizes import bound_sizes
from harmony_fx.user_frames import user_stacklevel

__all__ = ["Captured", "capture", "CaptureError", "raised_when_run", "buffers_put_back", "register_containers"]


class CaptureError(ValueError):
    """The model could not be turned into a graph; ``raised_by_model``: the model's own forward
    raises on those inputs (as it would called eagerly)."""

    raised_by_model = False


@dataclasses.dataclass
class Captured:
    """A captured model.

    ``gm``: placeholders in order: whatever export or tracing produced, each tagged with its role.
    ``params`` / ``buffers``: placeholder name → the model's own tensor (shared between names
    when tied). ``inputs``: placeholder names of the user's tensor inputs in flattening order.
    ``flatten_inputs(args, kwargs)`` returns the user's tensors in that order (and checks the
    structure); ``unflatten_outputs(flat)`` rebuilds the model's output structure.
    ``reductions``: output node name → how that scalar output combines across microbatches.
    ``caches_off``: the model's key/value cache was turned off to capture it.
    ``attribute_reads``: the modules' plain attributes the forward read, which the graph holds as
    constants (``frontend.attribute_reads``; ``frontend.guards`` keys the calls on their values).
    """

    gm: fx.GraphModule
    params: dict[str, nn.Parameter]
    buffers: dict[str, torch.Tensor]
    inputs: list[str]
    flatten_inputs: Callable[[tuple, dict], list[Any]]
    unflatten_outputs: Callable[[list[Any]], Any]
    method: str
    reductions: dict[str, ScalarReduction] = dataclasses.field(default_factory=dict)
    caches_off: bool = False  # a config's use_cache was off while capturing (``frontend.key_value_caches``)
    attribute_reads: Reads = dataclasses.field(default_factory=Reads)
    # the model's lines that registered a hook on a tensor in the forward: moot in a compile with no
    # backward, refused in any other (``frontend.backward_hooks``; a kept capture is checked again)
    tensor_hooks: tuple[str, ...] = ()


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, stack_traces: bool = False,
            dtype: torch.dtype | None = None) -> Captured:
    """Capture ``model(*args, **kwargs)``; see the module docstring. ``stack_traces``: each node's
    ``meta["stack_trace"]``, the model's line that made it (a fifth of export's time on a
    transformer: taken only where an error names the line). ``dtype``: the graph the model makes
    with its floating parameters, buffers and inputs in that dtype (``frontend.compute_dtype``);
    the placeholders still map to the model's own tensors."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"harmony_fx.compile expects an nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = dict(kwargs or {})
    refuse_module_backward_hooks(model)
    _refuse_script_modules(model)
    _refuse_plain_tensor_parameters(model)
    with _grads_set_aside(model), _python_draws_noted(model), tensor_attribute_writes_said(model) as said, \
            _meta_failures_unlogged(), hooks_registered_in_forward() as hooks, \
            key_value_caches_off(model, kwargs) as caches_off, reads_recorded(model) as reads:
        captured, found = _bounded_capture(model, args, kwargs, stack_traces, dtype)
        if found is not None and not stack_traces:  # again with traces, to name the line it is on
            captured, found = _bounded_capture(model, args, kwargs, True, dtype)
        said.gm = captured.gm if captured is not None else None
    refuse_tensor_hooks(hooks)
    refuse_forward_hooks_keeping_tensors(model)
    if found is not None:
        raise refusal(found)
    _refuse_state_requiring_grad(captured)
    captured.reductions = _scalar_reductions(captured.gm, {**captured.params, **captured.buffers})
    captured.caches_off = caches_off
    captured.attribute_reads = reads
    captured.tensor_hooks = tuple(hooks)
    return captured


class _MetaFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def _meta_failures_unlogged():
    """FakeTensors log every op that fails on them at ERROR, with its traceback (hundreds of lines
    on stderr), then raise. A capture catches that error: it is the CaptureError's cause, or a
    microbatch size the compile falls back from, never a failure of the user's run to log."""
    logger, only_these = logging.getLogger("torch._subclasses.fake_tensor"), _MetaFailures()
    logger.addFilter(only_these)
    try:
        yield
    finally:
        logger.removeFilter(only_these)


def _refuse_state_requiring_grad(captured: Captured) -> None:
    """A tensor the forward reads that requires grad but is neither a parameter nor an input (a
    learnable scale kept as a plain attribute, a global weight): eager differentiates it, but the
    graph holds it as a buffer, which harmony never gives a gradient (it would silently not train)."""
    for name, tensor in captured.buffers.items():
        if tensor.requires_grad:
            target = captured.gm.graph.find_nodes(op="placeholder")
            where = next((str(node.meta.get(meta.TARGET, name)) for node in target if node.name == name), name)
            raise CaptureError(
                f"the model reads the tensor {where!r}, which requires grad but is not an nn.Parameter (a plain "
                "attribute, a buffer or a global): eager gives it a gradient, harmony_fx trains parameters only. "
                "Register it as one (self.scale = nn.Parameter(...)), or call requires_grad_(False) on it if it is "
                "not meant to train.")


def _refuse_plain_tensor_parameters(model: nn.Module) -> None:
    """A parameter slot holding a plain tensor: ``torch.func.functional_call`` (``torch.nn.utils.
    stateless``) puts the tensors it is given there for the call. Export refused it with a message
    about control flow; harmony_fx trains the model's own parameters, its packs' host weights."""
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if not isinstance(tensor, nn.Parameter):
            raise CaptureError(
                f"the parameter {name!r} of {type(model).__name__} is a plain tensor, not an nn.Parameter: "
                "torch.func.functional_call (torch.nn.utils.stateless) puts the tensors it is given in the modules' "
                "parameters for the call, and harmony_fx runs and trains the model's own parameters, which it holds "
                "as the packs' weights. Call functional_call on the plain model (hm.model), which runs eagerly, or "
                "copy the values into the parameters (with torch.no_grad(): param.copy_(value)) and call the "
                "compiled module.")


def _refuse_script_modules(model: nn.Module) -> None:
    """A TorchScript module (``torch.jit.script``/``trace``) has no Python forward left to trace:
    export and symbolic tracing both fail on it, each with a message about something else."""
    for name, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            raise CaptureError(
                f"the module {name or type(model).__name__!r} is TorchScript ({type(module).__name__}, from "
                "torch.jit.script or torch.jit.trace): harmony_fx captures the model's Python code, which a "
                "ScriptModule no longer has. Build the model without scripting its modules (a scripted function "
                "called in forward is fine).")


@contextlib.contextmanager
def _python_draws_noted(model: nn.Module):
    """A forward that draws from Python's ``random`` or numpy's global generator (``if
    random.random() < self.layerdrop``) runs once at capture: the graph keeps that call's numbers and
    the branches they chose, every step alike. Said in a warning (at probability 0 the branch is the
    same anyway); the generators are put back as they were, as capturing must leave them."""
    numpy = sys.modules.get("numpy")  # a model drawing from numpy has imported it
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    torch_state = torch.get_rng_state()  # the graph's draws run on fakes: only a reseed changes it
    try:
        yield
    finally:
        drew = [name for name, changed in (
            ("random", random.getstate() != python_state),
            ("numpy.random", numpy_state is not None and not _same_numpy_state(numpy.random.get_state(), numpy_state)),
        ) if changed]
        reseeded = not torch.equal(torch.get_rng_state(), torch_state)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
    if reseeded:
        warnings.warn(
            f"{type(model).__name__} sets torch's random generator in forward (torch.manual_seed, "
            "torch.set_rng_state): the captured graph keeps no trace of it, so every call draws on from the "
            "generator as the caller left it, where eager draws from the state the forward set. Seed before "
            "calling the model instead.", stacklevel=user_stacklevel())
    if drew:
        warnings.warn(
            f"{type(model).__name__} draws from {' and '.join(drew)} in forward: the captured graph keeps the numbers "
            "of the one call that captured it, and every step takes the branches they chose (the same layers "
            "dropped, the same choice made). Draw with torch (torch.rand) and use the numbers in tensor ops "
            "(a mask, torch.where), which the graph draws anew every call, or set the probability that uses "
            "them to 0.", stacklevel=user_stacklevel())


def _same_numpy_state(state: tuple, other: tuple) -> bool:
    return all(bool((a == b).all()) if hasattr(a, "all") else a == b for a, b in zip(state, other))


@contextlib.contextmanager
def _grads_set_aside(model: nn.Module):
    """The parameters' ``.grad`` set aside while capturing: the graph does not read them, and
    export's fake copy of a parameter whose gradient has another dtype than its own (a bf16 weight
    with fp32 gradients: ``Tensor.grad_dtype``) fails to take the gradient."""
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    for param in params:
        param.grad = None
    try:
        yield
    finally:
        for param, grad in zip(params, grads):
            param.grad = grad


def _capture(model: nn.Module, args: tuple, kwargs: dict, stack_traces: bool, dtype: torch.dtype | None) -> Captured:
    try:
        captured = _export_trying_again(model, args, kwargs, stack_traces, dtype)
    except Exception as export_error:  # noqa: BLE001 - every failure falls back to tracing
        try:
            captured = _capture_with_symbolic_trace(model, args, kwargs, dtype)
            _refuse_derivatives_traced(captured.gm, model)
        except Exception as trace_error:  # noqa: BLE001
            taken = next((name for module in model.modules() if isinstance(module, fx.GraphModule)
                          for name in [_derivative_taken(module.graph)] if name is not None), None)
            if taken is not None:
                # Dynamo's graph of a forward that takes a derivative (torch.func.grad: functorch's
                # nesting ops), which trips functorch's own assertion when run on fakes below
                trace_error = _DerivativeInForward(f"the forward calls {taken}")
                raise CaptureError(_capture_failure_message(model, export_error, trace_error, kwargs)) from export_error
            own = raised_when_run(model, args, kwargs)
            if isinstance(own, CaptureError):  # harmony's own words (the forward calls its compiled module)
                raise own
            if own is not None:
                refused = CaptureError(
                    f"{type(model).__name__} raises on these inputs, as it would called eagerly: "
                    f"{type(own).__name__}: {(str(own).strip().splitlines() or [''])[0]}\nCheck the inputs' dtypes "
                    "(token ids are integers), shapes and devices against what the model expects.")
                refused.raised_by_model = True
                raise refused from own
            raise CaptureError(_capture_failure_message(model, export_error, trace_error, kwargs)) from export_error
    return captured


def _refuse_derivatives_traced(gm: fx.GraphModule, model: nn.Module) -> None:
    """``torch.fx.symbolic_trace`` records ``torch.autograd.grad(y, x)`` in the forward as one call,
    which a pack would run on its own inputs alone: cut into packs, it differentiates only the part
    of the model in its pack (wrong outputs and gradients, silently), or runs without grad. Refused
    as export refuses it, by the functions that take a derivative (not ``Function.apply``)."""
    for node in gm.graph.nodes:
        module = getattr(node.target, "__module__", None) or ""
        if (node.op == "call_function" and (node.target in (torch.autograd.grad, torch.autograd.backward)
                                            or module == "torch.autograd.functional"
                                            or module.startswith("torch._functorch"))) \
                or (node.op == "call_method" and node.target == "backward"):
            name = node.target if node.op == "call_method" else f"{module}.{node.target.__name__}"
            raise _DerivativeInForward(f"the forward calls {name}")


# what Dynamo's graph holds of a derivative taken in the forward (torch.func.grad, vjp, jvp, jacrev)
_DERIVATIVE_CALLS = frozenset({"_autograd_grad", "_grad_increment_nesting", "_jvp_increment_nesting", "grad"})


def _derivative_taken(graph: fx.Graph) -> str | None:
    """The first call in ``graph`` that takes a derivative, named; ``None`` where none does."""
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "")
        module = getattr(node.target, "__module__", None) or ""
        if node.op == "call_function" and name in _DERIVATIVE_CALLS and module.startswith(("torch._functorch",
                                                                                          "torch._C._functorch",
                                                                                          "torch.autograd")):
            return f"{module}.{name}"
    return None


class _DerivativeInForward(CaptureError):
    """A derivative the trace recorded as one call (``_refuse_derivatives_traced``)."""


@contextlib.contextmanager
def buffers_put_back(model: nn.Module):
    """The model's buffers as they were before a forward run on FakeTensors of the inputs. Such a
    run computes nothing on the inputs, but an op whose tensors are all real runs for real: a
    BatchNorm's ``num_batches_tracked.add_(1)`` (or a step counter) counted a call nobody made, and
    the next training call started one ahead of eager's. A buffer the forward assigns
    anew (``self.buf = ...``) is set back too, not left a FakeTensor."""
    owners = {name: (model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], buffer)
              for name, buffer in model.named_buffers(remove_duplicate=False)}
    kept = {id(buffer): (buffer._version, buffer.detach().clone()) for _, _, buffer in owners.values()}
    try:
        yield
    finally:
        with torch.no_grad():
            for module, attr, buffer in owners.values():
                if module._buffers.get(attr) is not buffer:
                    module._buffers[attr] = buffer
                version, value = kept[id(buffer)]
                if buffer._version != version:
                    buffer.copy_(value)


def raised_when_run(model: nn.Module, args: tuple, kwargs: dict) -> Exception | None:
    """What the model's forward raises on FakeTensors of the inputs (nothing computed), if anything:
    where both captures failed because the model itself fails on these inputs (float token ids),
    that is the error to show, not advice about tracing."""
    try:
        # with grad, as the caller's training call: a forward that takes a derivative needs it
        with buffers_put_back(model), fakes_of((args, kwargs)) as (fake_args, fake_kwargs), torch.enable_grad():
            model(*fake_args, **fake_kwargs)
    except Exception as error:  # noqa: BLE001 - the model's own error, shown to the user
        # not FakeTensors' own refusals (a value read by Python control flow, an op with no fake kernel)
        return None if type(error).__module__.startswith(("torch._subclasses", "torch.fx", "torch._dynamo")) else error
    return None


def _export_trying_again(model: nn.Module, args: tuple, kwargs: dict, stack_traces: bool,
                         dtype: torch.dtype | None) -> Captured:
    """``_capture_with_export``, again where what failed can be helped: a data-dependent guard (a
    branch on a random draw whose outcome is certain: ``random_branches``), a plain dataclass or a
    ``dict``/``list`` subclass in the output (taught to pytree, found by its type in one FakeTensor
    run, not by export's message, whose wording changes between torch versions: 2.11 raises
    "unhashable type" where 2.13 says "Found <class> in output"). Each help is tried once; the first
    try costs other models nothing."""
    certain_draws = registered = False
    guarded: Exception | None = None
    while True:
        try:
            return _capture_with_export(model, args, kwargs, stack_traces, dtype, certain_draws)
        except Exception as error:  # noqa: BLE001 - raised again unless a help is left to try
            if not certain_draws and _guards_on_data(error):
                certain_draws, guarded = True, error
            elif not registered and _register_output_containers(model, args, kwargs):
                registered = True
            elif guarded is not None and _random_branch(error) is not None:
                raise guarded from error  # export's error names the model's line; the branch, what to set to 0
            elif guarded is not None and _guards_on_data(error):
                raise guarded  # it names the model's line; the second try's names random_branches'
            else:
                raise


def _guards_on_data(error: BaseException | None) -> bool:
    """Whether export failed on ``bool()`` of a value it does not know, by the error's type."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    while error is not None:
        if isinstance(error, GuardOnDataDependentSymNode):
            return True
        error = error.__cause__ or error.__context__
    return False


def _register_output_containers(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Register with pytree every dataclass type and rebuildable ``dict``/``list`` subclass in the
    model's output that pytree does not know (``register_containers``), found by one run on
    FakeTensors; whether any output type is
    known now that was not before. The registration is process-wide, as Hugging Face's own for
    ``ModelOutput``, which registers itself when made outside a trace: a ``ModelOutput`` class first
    imported while something was traced (``torch.compiler.is_compiling()``) is never registered by
    transformers until the run here makes one."""
    known = set(pytree.SUPPORTED_NODES)
    try:
        with buffers_put_back(model), fakes_of((args, kwargs)) as (fake_args, fake_kwargs):
            output = model(*fake_args, **fake_kwargs)
    except Exception:  # noqa: BLE001 - then export's own error stands
        return False
    found, seen = register_containers(output)
    return bool(found) or bool(seen - known)


def register_containers(value: Any) -> tuple[set[type], set[type]]:
    """Register with pytree every dataclass type in ``value`` (through tuples, lists, dicts and
    dataclasses) that it does not know, and every ``dict`` or ``list`` subclass its constructor
    rebuilds from its items (``_register_rebuilt``); the types registered, and every such type seen.
    An input that is one (a batch object) is registered before anything reads the call's structure:
    as a pytree leaf, export refuses it, and its tensors are neither inputs the graph reads nor ones
    a microbatch cuts; an output that is one comes back as its own type."""
    found: set[type] = set()
    seen: set[type] = set()

    def visit(item: Any) -> None:
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            seen.add(type(item))
            if type(item) not in pytree.SUPPORTED_NODES:
                torch.export.register_dataclass(type(item))
                found.add(type(item))
            for field in dataclasses.fields(item):
                visit(getattr(item, field.name))
            return
        if isinstance(item, (dict, list)) and type(item) not in (dict, list):
            if type(item) not in pytree.SUPPORTED_NODES and _register_rebuilt(item):
                found.add(type(item))
            if type(item) in pytree.SUPPORTED_NODES:  # one left a leaf is not seen: another try cannot help
                seen.add(type(item))
        if isinstance(item, (tuple, list)):
            for child in item:
                visit(child)
        elif isinstance(item, dict):
            for child in item.values():
                visit(child)

    visit(value)
    return found, seen


def _register_rebuilt(item: dict | list) -> bool:
    """Register ``type(item)``, a ``dict`` or ``list`` subclass, with pytree, where its constructor
    given ``item``'s items rebuilds it (the same type, the same items, the same attributes): a
    ``defaultdict`` (its factory first) or a class taking other arguments stays a leaf."""
    cls, mapping = type(item), isinstance(item, dict)
    children = _items(item)
    rebuild = (lambda pairs: cls(pairs)) if mapping else (lambda pairs: cls(value for _, value in pairs))
    try:
        rebuilt = rebuild(children)
        again = _items(rebuilt)
        same = (type(rebuilt) is cls and vars(rebuilt).keys() == vars(item).keys() and len(again) == len(children)
                and all(k == j and v is w for (k, v), (j, w) in zip(again, children)))
    except Exception:  # noqa: BLE001 - a constructor of other arguments: not rebuilt, a leaf as before
        return False
    if same:
        key = pytree.MappingKey if mapping else pytree.SequenceKey
        pytree.register_pytree_node(
            cls, lambda x: ([v for _, v in _items(x)], [k for k, _ in _items(x)]),
            lambda values, keys: rebuild(zip(keys, values)),
            flatten_with_keys_fn=lambda x: ([(key(k), v) for k, v in _items(x)], [k for k, _ in _items(x)]),
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    return same


def _items(container: dict | list) -> list[tuple]:
    """``(key, value)`` of a dict, ``(index, value)`` of a list: what pytree flattens it to, with its keys."""
    return list(container.items()) if isinstance(container, dict) else list(enumerate(container))


def _bounded_capture(model: nn.Module, args: tuple, kwargs: dict, stack_traces: bool, dtype: torch.dtype | None):
    """The capture with its sizes bounded (``passes.bound_sizes``), and the first construct
    ``frontend.refusals`` refuses in it (``None``: none)."""
    captured = _capture(model, args, kwargs, stack_traces, dtype)
    _drop_value_asserts(captured.gm)
    bound_sizes(captured.gm)
    return captured, first_refused(captured.gm)


_COMPARISONS = {operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne}
# what a check passes its read through before comparing: ``torch._check_tensor_all(cond)`` (transformers'
# ``torch_compilable_check``, e.g. a vision-language model's image-token count) is captured as
# _is_all_true -> item -> sym_ite(item, 1, 0) -> ge/le/eq -> _assert_scalar (torch 2.11: item ->
# cast_symbool_to_symint_guardless -> eq -> _assert_scalar)
_CHECK_STEPS = {torch.sym_ite, torch.sym_not, operator.not_, cast_symbool_to_symint_guardless}
_ASSERT = torch.ops.aten._assert_scalar.default
_METADATA_CHECK = torch.ops.aten._assert_tensor_metadata.default


def _drop_value_asserts(gm: fx.GraphModule) -> None:
    """A value read into Python only to assert on it (XLM's ``assert lengths.max().item() <= slen``,
    captured as ``item`` -> ``le`` -> ``_assert_scalar``; transformers' ``torch_compilable_check`` of a
    vision-language model's image-token count, through ``sym_ite``) sizes and computes nothing, but the
    planning run on FakeTensors cannot read it: the read, its comparisons and the assertion are
    dropped, and what only the read used. The check is then not made (eager's would raise)."""
    reads = [(read, checks) for target in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)
             for read in gm.graph.find_nodes(op="call_function", target=target) if (checks := _asserted_only(read))]
    if not reads:  # most graphs: their code is not made again
        return
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    for read, checks in reads:
        unused = list(read.all_input_nodes)  # erasing a node forgets its inputs
        for node in sorted(checks, key=order.__getitem__, reverse=True):  # users first
            gm.graph.erase_node(node)
        while unused:  # what only the read used (the max it reads), and export's checks of its dtype
            node = unused.pop()
            if (node.op == "call_function" and node in order and not node.is_impure()
                    and all(user.target is _METADATA_CHECK for user in node.users)):
                for check in list(node.users):
                    gm.graph.erase_node(check)
                unused.extend(node.all_input_nodes)
                gm.graph.erase_node(node)
                del order[node]
    gm.recompile()


def _asserted_only(read: fx.Node) -> set[fx.Node]:
    """``read`` and all it reaches, where all of it compares or asserts and an assertion is among
    it; else none."""
    reached, frontier = {read}, [read]
    while frontier:
        for user in frontier.pop().users:
            if user.target not in _COMPARISONS and user.target not in _CHECK_STEPS and user.target is not _ASSERT:
                return set()
            if user not in reached:
                reached.add(user)
                frontier.append(user)
    return reached if any(node.target is _ASSERT for node in reached) else set()


def _scalar_reductions(gm: fx.GraphModule, state: dict[str, torch.Tensor]) -> dict[str, ScalarReduction]:
    # read now, before any pass rewrites the graph: the label counting copies part of it to run on the host
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    return {node.name: scalar_reduction(gm, node, state) for node in outputs
            if isinstance(node, fx.Node) and isinstance(node.meta.get(meta.VAL), torch.Tensor)
            and node.meta[meta.VAL].dim() == 0}


# export's words for a torch.Generator passed in or made in the forward, which it cannot lift: a script
# object (torch 2.13), or a type it names (torch 2.11: "Unsupported input type <class 'torch._C.Generator'>",
# "argument of type: <class 'torch._C.Generator'>")
_GENERATOR = ("unsupported exported input kind InputKind.CUSTOM_OBJ", "<class 'torch._C.Generator'>")
# export's words for a value it could not trace through, left as a constant: autograd.grad in the
# forward, vmap's out_dims (torch 2.11-2.13)
_FAKE_CONSTANT = "found a fake tensor in the exported program constant"


def _raised_in(error: BaseException | None, path_part: str) -> bool:
    """Whether ``error`` or what caused it passed through a file whose path holds ``path_part``."""
    while error is not None:
        if any(path_part in frame.filename for frame in traceback.extract_tb(error.__traceback__)):
            return True
        error = error.__cause__ or error.__context__
    return False


_CACHE_IN_OUTPUT = re.compile(r"Found <class '([\w.]*Cache)'> in output")
_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output")
_CACHE_IN_INPUT = re.compile(r"Unsupported input type <class '([\w.]*Cache)'>")
_DATA_DEPENDENT = ("data-dependent", "data dependent", "GuardOnDataDependentSymNode")
# export's symptom of a value read into a Python int (int(t.max()) + 1 as a size), not a branch
_SIZED_BY_VALUE = "Could not extract specialized integer from data-dependent expression"
# export names the user frame it stopped in: "Caused by: (path/model.py:1062 in forward)"
_CAUSED_BY = re.compile(r"Caused by: \(([^()\n]+?:\d+ in \w+)\)")
# a data-dependent guard names the user's frame it came from, with its code (the function may be
# Python's own name for a comprehension or lambda: Qwen2-VL's split is in a ``<listcomp>``)
_RAISED_BY = re.compile(r'The following call raised this error:\n\s*File "([^"\n]+)", line (\d+), '
                        r'in ([\w<>]+)\n\s*(\S[^\n]*)')


def _capture_failure_message(model: nn.Module, export_error: Exception, trace_error: Exception,
                             kwargs: dict) -> str:
    def first_line(err: Exception) -> str:
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0] if text else ''}"

    where = _where_and_labels(export_error, kwargs)
    if re.search(r"The model's code at [^\n]*: assert ", where):
        # an assert on a tensor's value (torchtune's KVCache.update), not a branch to write with torch.where
        advice = ("an assert reads a tensor's value into Python, which export cannot capture: write it as "
                  "torch._check(condition.item()), which harmony_fx captures and drops (the check is then not made "
                  "while it runs), or move it out of forward.")
    else:
        advice = _what_to_try(model, export_error, trace_error)
    return (
        f"harmony_fx could not capture {type(model).__name__} as a graph.\n"
        f"  torch.export (non-strict) failed with   {first_line(export_error)}\n"
        f"  torch.fx.symbolic_trace failed with     {first_line(trace_error)}\n"
        f"What to try: {advice}{where}"
    )


def _random_branch(error: BaseException | None) -> RandomBranchError | None:
    while error is not None and not isinstance(error, RandomBranchError):
        error = error.__cause__ or error.__context__
    return error


def _random_layer_drop(model: nn.Module, export_error: Exception) -> str:
    """A branch on a random draw whose outcome changes from call to call (layer drop: a layer
    skipped with a probability): what to set to 0, named where a config or module attribute holds
    that probability (``config.layerdrop``)."""
    branch = _random_branch(export_error)
    if branch is None:
        return ""
    owners: dict[int, tuple[str, object]] = {}  # a config shared by many modules: named once, by the first
    for module_name, module in model.named_modules():
        prefix, config = module_name or "model", module.__dict__.get("config")
        if config is not None:
            owners.setdefault(id(config), (f"{prefix}.config.", config))
        owners[id(module)] = (f"{prefix}.", module)
    holders = [f"{prefix}{name}" for prefix, owner in owners.values()
               for name, value in getattr(owner, "__dict__", {}).items()
               if not name.startswith("_") and isinstance(value, float) and value == branch.probability]
    # the attributes holding that number, those named for layer drop first (a config holds other 0.1s)
    for words in (("layerdrop", "layer_drop"), ("drop",), ("",)):
        named = [holder for holder in dict.fromkeys(holders) if any(w in holder.rsplit(".", 1)[-1] for w in words)]
        if named:
            break
    held = f" ({' or '.join(named[:3])}, now {branch.probability!r})" if holders else ""
    return (f"{branch}: a graph has the same layers every step, so it cannot skip one at random (layer drop). "
            f"Set that probability to 0{held}; randomness computed with tensors (dropout, torch.where on a "
            "draw) stays in the graph.")


def _what_to_try(model: nn.Module, export_error: Exception, trace_error: Exception | None = None) -> str:
    return (_cumulative_batch_norm(model) or _unfused_fake_quantize(model) or _random_layer_drop(model, export_error)
            or _packed_sequence(export_error) or _function_under_vmap(export_error) or _advice(export_error, trace_error))


def _function_under_vmap(export_error: Exception) -> str:
    """A model's own autograd Function applied inside ``torch.vmap``: what to do instead."""
    error: BaseException | None = export_error
    while error is not None and not isinstance(error, FunctionUnderVmap):
        error = error.__cause__ or error.__context__
    return "" if error is None else error.advice


def _packed_sequence(export_error: Exception) -> str:
    """Where export stopped inside torch's RNN code (``nn.LSTM`` given a ``PackedSequence`` sizes
    its work by the lengths' values): what to do instead, as no graph can hold those sizes."""
    error: BaseException | None = export_error
    while error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        if any(pathlib.PurePath(frame.filename).match("torch/nn/*/rnn.py") for frame in frames):
            return ("export stopped in torch's RNN code: an nn.LSTM/GRU/RNN given a PackedSequence "
                    "(pack_padded_sequence) sizes its work by the lengths' values, which no graph can hold. Run it on "
                    "the padded batch and mask the padding (in the loss), or use torch.compile(model, "
                    "backend='harmony') with torch._dynamo.config.allow_rnn = True, where Dynamo runs the packing "
                    "between its graphs.")
        error = error.__cause__ or error.__context__
    return ""


def _cumulative_batch_norm(model: nn.Module) -> str:
    """A BatchNorm with ``momentum=None`` in training divides by ``float(num_batches_tracked)``, a
    value read by Python, which no capture can keep in a graph."""
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None and module.training]
    if not found:
        return ""
    name, module = found[0]
    return (f"module {name or '(the model)'} (a {type(module).__name__}) has momentum=None, a cumulative average: "
            "torch reads float(num_batches_tracked) in Python, which no graph can hold; give it a number "
            "(momentum=0.1, torch's default), or use torch.compile(model, backend='harmony'), whose Dynamo "
            "graphs take that value as an input. torch.optim.swa_utils.update_bn sets it on every BatchNorm (and, "
            "stopped here, leaves it None: set each BatchNorm's momentum back, e.g. to 0.1): give update_bn the "
            "plain model (hm.model, or an AveragedModel's .module.model), which it runs eagerly; for a parent module "
            "holding a compiled part, put that part's .model in its place for the call (parent.encoder = "
            "parent.encoder.model; update_bn(loader, parent); then the compiled part back).")


def _unfused_fake_quantize(model: nn.Module) -> str:
    """Quantization-aware training with torch.ao's version-0 qconfig: each ``FakeQuantize`` branches
    in Python on its ``observer_enabled``/``fake_quant_enabled`` buffers, which no capture can keep
    in a graph; version 1's fused ``FusedMovingAvgObsFakeQuantize`` computes the same in one op."""
    from torch.ao.quantization import FakeQuantize

    found = [name for name, module in model.named_modules() if type(module) is FakeQuantize and module.training]
    if not found:
        return ""
    return (f"module {found[0]} is a torch.ao.quantization.FakeQuantize (the version-0 QAT qconfig), which branches "
            "in Python on its observer_enabled and fake_quant_enabled buffers: prepare the model with "
            "get_default_qat_qconfig(backend) (version 1: FusedMovingAvgObsFakeQuantize, one op harmony_fx captures), "
            "or use torch.compile(model, backend='harmony'), whose Dynamo graphs split at those branches.")


def _is_in(path: str, folder: pathlib.Path) -> bool:
    return pathlib.Path(path).resolve().is_relative_to(folder)


def _where_and_labels(export_error: Exception, kwargs: dict) -> str:
    """The model's line export stopped at, where it says; and, for a call with ``labels`` (a
    Hugging Face head, whose loss code is often what export cannot trace: DeBERTa's checks
    ``if label_index.size(0) > 0``), how to keep the loss out of the graph."""
    # a frame inside torch (export's own __torch_function__) says nothing about the model
    torch_dir = pathlib.Path(torch.__file__).parent
    message = str(export_error)
    # nor does one of harmony_fx's own (the recorder an autograd Function's forward runs under)
    ours = pathlib.Path(__file__).resolve().parent.parent
    where = [f"{path}:{line} in {function}: {code.strip()}" for path, line, function, code in _RAISED_BY.findall(message)
             if not pathlib.Path(path).is_relative_to(torch_dir) and not _is_in(path, ours)]
    caused_by = _CAUSED_BY.findall(message)
    inside = [frame for frame in caused_by if (torch_dir / frame.split(":")[0]).exists()]
    where += [full for full in map(_full_path, [frame for frame in caused_by if frame not in inside])
              if not _is_in(full.split(":")[0], ours)]
    # torch's tracing machinery (export's own __torch_function__, fx, Dynamo) is where every such
    # stop is seen from, not a function of torch's the model called
    inside = [frame for frame in inside if not frame.startswith(_TRACING_MACHINERY)]
    # a guard raised in export's own machinery (LLaVA-NeXT's min()/max() of sizes read from image_sizes)
    # names no frame of the model: the innermost the error passed through does
    where = where or _innermost_model_frame(export_error, torch_dir, ours)
    text = f" The model's code at {where[0]}." if where else ""
    if inside:
        text += (f" Export stopped inside torch's own code (torch/{inside[0]}: a check of its inputs' values, as "
                 "gaussian_nll_loss makes of its variance), which no option changes: call that function outside "
                 "the model, on the outputs of the compiled module.")
    if "labels" in kwargs and _random_branch(export_error) is None:
        text += (" If that is the loss computed from labels, call the model without labels and compute the loss "
                 "from its logits outside (harmony_fx.Trainer's loss_fn(output, target)).")
    return text


def _innermost_model_frame(error: BaseException | None, torch_dir: pathlib.Path, ours: pathlib.Path) -> list[str]:
    """``path:line in function: code`` of the innermost frame ``error`` (or what caused it) passed
    through outside torch, harmony_fx and generated code; none where there is none."""
    while error is not None:
        frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                  if not frame.filename.startswith("<") and not pathlib.Path(frame.filename).is_relative_to(torch_dir)
                  and not _is_in(frame.filename, ours)]
        if frames:
            frame = frames[-1]
            return [f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"]
        error = error.__cause__ or error.__context__
    return []


_TRACING_MACHINERY = ("_export/", "export/", "fx/", "_dynamo/", "_subclasses/", "utils/_python_dispatch",
                      "_functorch/", "_higher_order_ops/", "_library/")


def _full_path(frame: str) -> str:
    """``path:line in function`` with the path whole: export shortens it (``mp/model.py`` for
    ``/tmp/model.py``); the loaded module or script whose file ends with it, where one does."""
    path, rest = frame.split(":", 1)
    if pathlib.Path(path).exists():
        return frame
    files = [getattr(module, "__file__", None) for module in list(sys.modules.values())] + [sys.argv[0]]
    found = next((f for f in files if isinstance(f, str) and f.endswith(path)), None)
    return f"{found}:{rest}" if found else frame


def _advice(export_error: Exception, trace_error: Exception | None = None) -> str:
    """The construct export stopped at, and the option that avoids it, where the error says which
    (or where tracing stopped: torch 2.11's export fails on a derivative before the model runs)."""
    text = str(export_error)
    derivative = f"_functorch{os.sep}eager_transforms.py"  # torch.func.grad, vjp, jvp, jacrev, hessian
    derivative_advice = (
        "the model computes a derivative inside its forward (torch.autograd.grad, torch.func.grad, jacrev, vjp, jvp), "
        "or maps with torch.vmap(out_dims=...) other than 0, which torch.export cannot trace: compute the derivative "
        "outside the compiled model (on its outputs, or as a second model), and for vmap map with out_dims=0 and move "
        "the dim afterwards (.movedim(0, d)).")
    if _raised_in(export_error, derivative) or _raised_in(trace_error, derivative) \
            or isinstance(trace_error, _DerivativeInForward):
        return derivative_advice
    if _FAKE_CONSTANT in text:  # export's symptom of both
        return (f"{derivative_advice} Or the forward writes a tensor it holds in place once (a data-dependent "
                "initialisation, as ActNorm's param.data.copy_(...) on the first batch): call the model once eagerly "
                "before compiling, so that the write is done.")
    if match := _CACHE_IN_OUTPUT.search(text):
        return (f"the model returns a key/value cache ({match.group(1)}), which is inference state, not a "
                "tensor: pass use_cache=False in the call, or leave use_cache out (harmony_fx then captures "
                "the model with its cache off). Where the cache was passed in (past_key_values: PEFT's prefix "
                "tuning passes its prompts so, a decode step the previous step's), the model returns it whatever "
                "use_cache says: train with LoRA or prompt tuning, and decode with the model itself.")
    if match := _CACHE_IN_INPUT.search(text):
        return (f"the call passes a key/value cache ({match.group(1)}), which is inference state, not a tensor: "
                "decode with the model itself (model.generate, or model(...) step by step) or through "
                "torch.compile(model, backend='harmony'), or recompute without a cache (the whole sequence each "
                "step, use_cache=False).")
    if match := _UNKNOWN_OUTPUT.search(text):
        return (f"the model returns a {match.group(1)}, which harmony_fx cannot take apart into tensors; return "
                "tensors, tuples, lists, dicts or dataclasses, or register the type with "
                "torch.utils._pytree.register_pytree_node.")
    if any(words in text for words in _GENERATOR):
        return ("the forward uses a torch.Generator (a generator=... argument, or one it makes: diffusers' "
                "latent_dist.sample(generator=g), AutoencoderKL(x, sample_posterior=True, generator=g)), which "
                "export keeps as an object no graph can run. Draw without it (harmony_fx replays the default "
                "generator's draws in the recompute: seed with torch.manual_seed before the call), or draw the "
                "noise outside the model and pass it in as a tensor (z = mean + std * noise).")
    if isinstance(export_error, DynamicOutputShapeException):
        return (f"{text.strip()} makes a tensor whose size depends on its inputs' values (ctc_loss's, on the "
                "target lengths), which export cannot capture: compute it outside the model, on the outputs of "
                "the compiled module (harmony_fx.Trainer: in loss_fn).")
    if _SIZED_BY_VALUE in text:
        return ("the forward turns a tensor's value into a Python number (int(t.max()), t.item(), t.tolist()) that "
                "sizes a tensor or picks a slice, which no graph of fixed sizes can hold: pass that number in as an "
                "argument, or fix it (a pooling over a batch vector, as torch_geometric's global_mean_pool(x, batch, "
                "size=num_graphs), takes the count of graphs), or compute that part outside the compiled model.")
    if any(marker in text for marker in _DATA_DEPENDENT):
        return ("Python control flow depends on a tensor's values (if x.sum() > 0: ...); compute both branches "
                "and pick with torch.where, or move the choice out of forward.")
    return (
        "remove Python control flow that depends on tensor values (if x.sum() > 0: ...) or express it with "
        "torch.where; turn off caches and other stateful options (e.g. use_cache=False for Hugging "
        "Face models); pass every tensor the forward needs as an input instead of creating it from data inside "
        "forward."
    )


# --------------------------------------------------------------------------- torch.export path


@contextlib.contextmanager
def _stack_traces(wanted: bool):
    """Export records each node's stack trace unless torch's flag says not to (torch 2.13's flag;
    before it, export always records them). The flag is put back as it was."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = not wanted
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _capture_with_export(model: nn.Module, args: tuple, kwargs: dict, stack_traces: bool,
                         dtype: torch.dtype | None, certain_draws: bool = False) -> Captured:
    from torch.export.graph_signature import InputKind, OutputKind

    traced = None if dtype is None else in_compute_dtype(model, args, kwargs, dtype)
    # export recompiles its graph's Python code after each of its passes (7 times, 0.1 s each for a
    # 59-block GPT-2), and nothing here runs that code: generated once, when first asked for
    with warnings.catch_warnings(), decomposition_fixes(), _stack_traces(stack_traces), custom_backwards(), \
            _use_lazy_graph_module(True), causal_masks_applied(), checkpoints_as_plain_calls():
        # nn.RNN/LSTM/GRU re-assign their own _flat_weights on every call: torch's advice to register
        # them as buffers is about torch's code, not the user's
        warnings.filterwarnings("ignore", message=r"The tensor attributes (\S+\._flat_weights\[\d+\](, )?)+ were")
        module, call = (model, (args, kwargs)) if traced is None else (traced.module, (traced.args, traced.kwargs))
        with certain_random_branches(module) if certain_draws else contextlib.nullcontext(), \
                new_tensors_taken_back(module):
            exported = torch.export.export(module, *call, strict=False)
    signature = exported.graph_signature
    unsupported = [spec for spec in signature.output_specs if spec.kind != OutputKind.USER_OUTPUT]
    if unsupported:
        raise NotImplementedError(f"exported graph has non-user outputs {unsupported}")
    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    gm = _return_written_state(inline_vmap_regions(exported.graph_module), exported.graph_signature)
    placeholders = {node.name: node for node in gm.graph.find_nodes(op="placeholder")}
    params, buffers, inputs = {}, {}, []
    for spec in signature.input_specs:
        node = placeholders.get(getattr(spec.arg, "name", None))
        if spec.kind == InputKind.PARAMETER:
            params[node.name] = named_params[spec.target]
            node.meta[meta.ROLE], node.meta[meta.TARGET] = meta.Role.PARAM, spec.target
        elif spec.kind == InputKind.BUFFER:
            buffers[node.name] = named_buffers[spec.target]
            node.meta[meta.ROLE], node.meta[meta.TARGET] = meta.Role.BUFFER, spec.target
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constant = exported.constants[spec.target]
            buffers[node.name] = constant if traced is None else traced.original(constant)
            node.meta[meta.ROLE], node.meta[meta.TARGET] = meta.Role.BUFFER, spec.target
        elif spec.kind == InputKind.USER_INPUT:
            # a non-tensor input (a float, a flag) is baked into the graph; its placeholder is unused
            if node is not None and isinstance(node.meta.get(meta.VAL), torch.Tensor):
                inputs.append(node.name)
                node.meta[meta.ROLE] = meta.Role.INPUT
        else:
            raise NotImplementedError(f"unsupported exported input kind {spec.kind}")
    in_spec, out_spec = exported.call_spec.in_spec, exported.call_spec.out_spec
    num_inputs = len(inputs)
    example_leaves = pytree.tree_leaves((args, kwargs))
    constants = {i: leaf for i, leaf in enumerate(example_leaves) if not isinstance(leaf, torch.Tensor)}

    def flatten_inputs(call_args: tuple, call_kwargs: dict) -> list[Any]:
        leaves, spec = pytree.tree_flatten((call_args, call_kwargs))
        if spec != in_spec:
            leaves, spec = _reorder_kwargs(call_args, call_kwargs, in_spec)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if spec != in_spec or len(tensors) != num_inputs:
            raise ValueError(
                "the inputs do not have the structure of the example the model was compiled with: "
                f"expected {in_spec}, got {spec}. Pass the same positional and keyword inputs."
            )
        for i, value in constants.items():
            if leaves[i] != value:
                raise ValueError(f"a non-tensor input is {leaves[i]!r} but the model was compiled with {value!r}, "
                                 "which the graph has baked in; compile again for the new value.")
        return tensors

    def unflatten_outputs(flat: list[Any]) -> Any:
        return pytree.tree_unflatten(flat, out_spec)

    return Captured(gm, params, buffers, inputs, flatten_inputs, unflatten_outputs, "torch.export")


def _return_written_state(gm: fx.GraphModule, signature) -> fx.GraphModule:
    """An output that is an in-place update of a parameter or buffer (``self.calls += 1`` whose
    result Dynamo returns to set the attribute again) is that tensor itself: returned as the
    placeholder, the caller gets the model's own buffer back, as eager does (not a value each
    microbatch would compute)."""
    from torch.export.graph_signature import InputKind

    state = {spec.arg.name for spec in signature.input_specs
             if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and hasattr(spec.arg, "name")}
    output = gm.graph.find_nodes(op="output")[0]

    def itself(value):
        while (isinstance(value, fx.Node) and isinstance(value.target, torch._ops.OpOverload) and value.args
               and isinstance(value.args[0], fx.Node) and _returns_its_first_argument(value.target)):
            value = value.args[0]
        return value if isinstance(value, fx.Node) and value.op == "placeholder" and value.name in state else None

    returned = tuple(itself(arg) or arg for arg in output.args[0])
    if returned != tuple(output.args[0]):
        output.args = (type(output.args[0])(returned),)
        gm.recompile()
    return gm


def _returns_its_first_argument(op: torch._ops.OpOverload) -> bool:
    """An in-place op (``add_``): its result is its first argument, written (the schema's ``a!``)."""
    arguments, returns = op._schema.arguments, op._schema.returns
    return (len(returns) == 1 and bool(arguments) and returns[0].alias_info is not None
            and arguments[0].alias_info is not None and returns[0].alias_info.is_write
            and returns[0].alias_info.before_set == arguments[0].alias_info.before_set)


def _reorder_kwargs(args: tuple, kwargs: dict, in_spec: pytree.TreeSpec):
    """Keyword inputs given in another order than the example's still match."""
    example_kwargs_spec = in_spec.children()[1]
    keys = example_kwargs_spec.context if example_kwargs_spec.type is dict else None
    if keys is not None and set(keys) == set(kwargs):
        kwargs = {key: kwargs[key] for key in keys}
    return pytree.tree_flatten((args, kwargs))


# ------------------------------------------------------------------- torch.fx.symbolic_trace path


class _EnterEveryModuleTracer(fx.Tracer):
    """Traces down to torch functions so parameters show up as ``get_attr`` nodes we can lift. A
    trace runs the forward's ``with torch.no_grad():`` and ``torch.autocast`` at trace time and
    records neither: the graph would differentiate a frozen teacher's branch, or compute in another
    dtype. Refused where the forward changes either (export, which records them, failed first)."""

    def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
        return False

    def create_node(self, *args, **kwargs) -> fx.Node:
        state = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))
        if not hasattr(self, "_state"):
            self._state = state
        elif state != self._state:
            raise TypeError("the forward changes grad mode or autocast inside (with torch.no_grad(): ..., "
                            "torch.autocast), which symbolic tracing cannot record")
        return super().create_node(*args, **kwargs)


class _NoDrawsAtTrace(TorchDispatchMode):
    """Symbolic tracing runs what reads no input (``torch.rand([])``) on real tensors, once: a random
    draw there would be one number baked into the graph, and a branch on it the branch of one call.
    Refused instead (a TypeError the capture reports as this tracer's)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise TypeError(f"the model draws random numbers ({func}) from none of its inputs, which symbolic "
                            "tracing would draw once and bake into the graph")
        return func(*args, **(kwargs or {}))


def _capture_with_symbolic_trace(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype | None) -> Captured:
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {
        name: value for name, value in bound.arguments.items() if not isinstance(value, torch.Tensor)
    }
    with _NoDrawsAtTrace():
        graph = _EnterEveryModuleTracer().trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(model, graph)
    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    params, buffers, inputs = {}, {}, []
    tensor_arg_names = [name for name in bound.arguments if name not in concrete]
    lifted_by_target: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            if node.name in tensor_arg_names or node.target in tensor_arg_names:
                inputs.append(node.name)
                node.meta[meta.ROLE] = meta.Role.INPUT
        elif node.op == "get_attr":
            target = node.target
            lifted = lifted_by_target.get(target)
            if lifted is None:
                first_non_placeholder = next(n for n in gm.graph.nodes if n.op != "placeholder")
                with gm.graph.inserting_before(first_non_placeholder):
                    lifted = lifted_by_target[target] = gm.graph.placeholder(target.replace(".", "_"))
                if target in named_params:
                    params[lifted.name] = named_params[target]
                    lifted.meta[meta.ROLE] = meta.Role.PARAM
                elif target in named_buffers:
                    buffers[lifted.name] = named_buffers[target]
                    lifted.meta[meta.ROLE] = meta.Role.BUFFER
                else:
                    raise NotImplementedError(f"get_attr of {target!r}, which is neither a parameter nor a buffer")
                lifted.meta[meta.TARGET] = target
            node.replace_all_uses_with(lifted)
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    # Order of placeholders: user inputs first (as traced), then lifted state.
    placeholder_order = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    example = {**{n: bound.arguments[_arg_name(n, tensor_arg_names)] for n in inputs},
               **params, **buffers}
    fake_mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    values = [example[name] for name in placeholder_order]
    if dtype is not None:  # the values the devices compute with (see frontend.compute_dtype)
        values = [fake_in(fake_mode, value, dtype) for value in values]
    FakeTensorProp(gm, fake_mode).propagate(*values)
    out_structure: dict[str, Any] = {}

    def flatten_inputs(call_args: tuple, call_kwargs: dict) -> list[Any]:
        try:
            call_bound = signature.bind(*call_args, **call_kwargs)
        except TypeError as err:
            raise ValueError(f"the inputs do not match {type(model).__name__}.forward: {err}") from err
        call_bound.apply_defaults()
        return [call_bound.arguments[_arg_name(n, tensor_arg_names)] for n in inputs]

    output_node = gm.graph.find_nodes(op="output")[0]
    flat_out, out_spec = pytree.tree_flatten(output_node.args[0])
    output_node.args = (tuple(flat_out),)
    gm.recompile()
    out_structure["spec"] = out_spec

    def unflatten_outputs(flat: list[Any]) -> Any:
        return pytree.tree_unflatten(flat, out_structure["spec"])

    return Captured(gm, params, buffers, inputs, flatten_inputs, unflatten_outputs, "torch.fx.symbolic_trace")


def _arg_name(placeholder_name: str, arg_names: list[str]) -> str:
    for name in arg_names:
        if placeholder_name == name or placeholder_name.rstrip("_0123456789") == name:
            return name
    raise AssertionError(f"placeholder {placeholder_name} matches no forward argument")
