"""A model's own ``torch.autograd.Function``s keep their own backward.

``torch.export`` traces through ``MyFunction.apply``: the graph holds the ops of its ``forward`` and
autograd then differentiates those, silently dropping the ``backward`` the model wrote (a
straight-through estimator, a gradient reversal layer, PhiMoE's sparse mixer, a fused kernel's
hand-written gradient). Under ``custom_backwards()`` (capture only) each such call is recorded as
one node instead::

    autograd_function = torch.ops.harmony_fx.autograd_function.default('GradReverse#0', [linear])
    getitem = autograd_function[0]

whose kernel calls ``GradReverse.apply`` itself. The op is ``CompositeImplicitAutograd``: export
keeps it whole (as it keeps ``aten.linear``), and running it, in a pack's forward or recompute,
calls the Function as eager does, so autograd records the Function's own backward. On FakeTensors
(the planner's shapes and peaks) the Function's forward runs on fakes, as export ran it.

Only Functions defined outside torch are recorded so: torch's own (the collectives' Functions)
trace as before, but for reentrant activation checkpointing (``checkpoint(fn, x,
use_reentrant=True)``, ``CheckpointFunction``), whose function is called plainly: its forward
runs ``fn`` under ``no_grad``, which export would keep, leaving every output without a gradient;
harmony_fx's packs recompute on their own. (Where no input requires grad, ``fn`` runs under
``no_grad`` after all: eager's reentrant checkpoint then gives nothing inside it a gradient.) While recording, the forward's ops are watched once on
fakes: a forward that draws random numbers makes the node count as drawing them
(``analysis.random_ops``), so a recompute replays the same numbers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from harmony_fx.ir.values import differentiable

__all__ = ["custom_backwards", "recording", "record", "AUTOGRAD_FUNCTION", "draws_random", "FunctionUnderVmap"]

_LIBRARY = torch.library.Library("harmony_fx", "FRAGMENT")
_LIBRARY.define("autograd_function(str key, Tensor[] tensors) -> Tensor[]")


@dataclasses.dataclass
class _Call:
    """One recorded call: ``run(*args, **kwargs)`` applies the Function, given its arguments with
    each tensor left out (a ``None`` in ``leaves`` at a tensor's place); what it returned, tensors
    left out likewise, is filled in when it first runs."""

    run: Callable[..., Any]
    leaves: list[Any]
    tensor_at: list[bool]
    spec: pytree.TreeSpec
    out_leaves: list[Any] | None = None
    out_tensor_at: list[bool] | None = None
    out_spec: pytree.TreeSpec | None = None
    random: bool = False


# key (in the graph) -> the call it names; process-wide, as the graphs that name them may be
_CALLS: dict[str, _Call] = {}
_numbers = itertools.count()
_recording = threading.local()
_original_apply = torch.autograd.Function.apply.__func__


def _kernel(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    call = _CALLS[key]
    given = iter(tensors)
    leaves = [next(given) if is_tensor else leaf for leaf, is_tensor in zip(call.leaves, call.tensor_at)]
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    if call.out_spec is None:  # the first run, while export traces it on fakes
        with _RandomWatch() as watch:
            result = call.run(*args, **kwargs)
        call.random = watch.drew
        out_leaves, call.out_spec = pytree.tree_flatten(result)
        call.out_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves]
        call.out_tensor_at = [isinstance(leaf, torch.Tensor) for leaf in out_leaves]
    else:
        result = call.run(*args, **kwargs)
    return [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)]


_LIBRARY.impl("autograd_function", _kernel, "CompositeImplicitAutograd")
AUTOGRAD_FUNCTION = torch.ops.harmony_fx.autograd_function.default


def recording() -> bool:
    """Whether this thread is within ``custom_backwards()``."""
    return getattr(_recording, "on", False)


def record(name: str, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``run(*args, **kwargs)`` (which applies an autograd Function), recorded as one
    ``AUTOGRAD_FUNCTION`` node named after ``name``; returns what ``run`` returns."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    key = f"{name}#{next(_numbers)}"
    _CALLS[key] = _Call(run, [None if t else leaf for leaf, t in zip(leaves, tensor_at)], tensor_at, spec)
    tensors = AUTOGRAD_FUNCTION(key, [leaf for leaf, t in zip(leaves, tensor_at) if t])
    call, given = _CALLS[key], iter(tensors)
    out = [next(given) if is_tensor else leaf for leaf, is_tensor in zip(call.out_leaves, call.out_tensor_at)]
    return pytree.tree_unflatten(out, call.out_spec)


class FunctionUnderVmap(TypeError):
    """A model's own Function applied inside ``torch.vmap`` (its ``vmap`` staticmethod or
    ``generate_vmap_rule``): its node cannot be batched, and export, tracing through it instead,
    would keep its forward's ops and drop its backward (a straight-through estimator's gradient
    silently zero)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"the forward applies its own torch.autograd.Function {name} inside torch.vmap (or another torch.func "
            "transform): harmony_fx keeps a "
            "Function's own backward as one node of the graph, which vmap cannot batch (tracing through it instead "
            f"would differentiate {name}'s forward and silently drop its backward)")
        self.advice = (f"apply {name} to the whole batch outside torch.vmap (its forward and backward then see the "
                       "batch dim).")


def _recorded_apply(cls, *args, **kwargs):
    if recording() and cls is torch.utils.checkpoint.CheckpointFunction:
        run_function, _preserve_rng_state, *inputs = args
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            return run_function(*inputs)
        with torch.no_grad():  # as eager: no input wants a gradient, so nothing inside gets one
            return run_function(*inputs)
    if not recording() or cls.__module__.split(".")[0] == "torch":
        return _original_apply(cls, *args, **kwargs)
    if torch._C._functorch.maybe_current_level() is not None:
        raise FunctionUnderVmap(cls.__qualname__)
    return record(cls.__qualname__, functools.partial(_original_apply, cls), args, kwargs)


@contextlib.contextmanager
def custom_backwards():
    """Within it (on this thread), each ``apply`` of a Function defined outside torch is recorded
    as one ``AUTOGRAD_FUNCTION`` node; ``torch.autograd.Function.apply`` is restored after."""
    before = torch.autograd.Function.__dict__["apply"]
    torch.autograd.Function.apply = classmethod(_recorded_apply)
    _recording.on = True
    try:
        yield
    finally:
        _recording.on = False
        torch.autograd.Function.apply = before


def traced(key: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
           ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule] | None:
    """The recorded Function's forward, and its forward with its own backward, as ATen graphs
    traced on fakes shaped like ``inputs`` and ``outputs`` (the node's): ``forward(*inputs)`` returns
    its tensor outputs; ``joint(*inputs, *grad_outputs)`` returns them and the gradient of each
    floating input (``None`` where the backward gives none). ``None`` where the Function cannot be
    traced so (its forward or backward reads values)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(*tensors):
        return _kernel(key, list(tensors))

    def joint(*tensors_and_grads):
        tensors = [t.detach().requires_grad_(differentiable(t)) for t in tensors_and_grads[:len(inputs)]]
        with torch.enable_grad():
            outputs = _kernel(key, tensors)
            wanted = [t for t in tensors if t.requires_grad]
            flowing = [(out, grad) for out, grad in zip(outputs, tensors_and_grads[len(inputs):]) if out.requires_grad]
            grads = torch.autograd.grad([o for o, _ in flowing], wanted, [g for _, g in flowing], allow_unused=True) \
                if flowing and wanted else [None] * len(wanted)
        given = iter(grads)
        return [*outputs, *[next(given) if t.requires_grad else None for t in tensors]]

    examples = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (*inputs, *outputs)]
    try:
        forward_gm = make_fx(forward, tracing_mode="fake")(*examples[:len(inputs)])
        joint_gm = make_fx(joint, tracing_mode="fake")(*examples)
    except Exception:  # noqa: BLE001 - code that reads values cannot be traced: the caller treats it as opaque
        return None
    return forward_gm, joint_gm


def draws_random(key: str) -> bool:
    """Whether the recorded Function's forward drew random numbers when export ran it."""
    return _CALLS[key].random


class _RandomWatch(TorchDispatchMode):
    """Notes whether any op run under it draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.drew = True
        return func(*args, **(kwargs or {}))
