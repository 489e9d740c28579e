"""Captures kept for the next compile of the same model in the same state.

``torch.export`` is most of a compile's time (2.6 s of a 59-block GPT-2's 3.2 s refusal on 2
cores), and users compile the same model again: with the budget a refusal named, with other
microbatches, the planner trying a schedule at a size another compile captured. As Dynamo keeps its
graphs on the code it compiled, guarded, harmony_fx keeps each capture on the model (weakly: it goes
with the model), under a key of everything the graph bakes in: the microbatch size and target
device, the compute dtype, ``CallKey`` (grad, inference and autocast modes, each module's training
flag, each parameter's and buffer's identity, dtype, shape and ``requires_grad``, the modules'
hooks, the inputs' structure, shapes and dtypes, every non-tensor input) and ``attribute_facts``
(each module's class, its plain attributes and the objects it holds, such as a Hugging Face config).

``attribute_facts`` follows instance attributes only, a few levels deep; a value the capture read
further off (a class-level default read through an instance, a setting five objects down) is
checked on a hit: the capture's own reads (``frontend.attribute_reads``) must give the values they
gave when it was captured, else it is captured again, as ``CallKey``, which keys every call on
those reads, compiles again.

What no key sees: the code of a function the forward calls, changed in place (a module-level
function patched). ``harmony_fx.reset()`` forgets every capture kept.

A capture is kept without the model's parameters and buffers, which a hit finds again by name
(the key holds their identities): kept with them, it would keep alive every parameter the model
replaced since (``load_state_dict(assign=True)``: a copy of the weights each time).

A capture handed out is a copy (``copy.deepcopy`` of an fx graph copies the nodes and each node's
meta dict, not the values in it, FakeTensors included): later passes annotate the graph of their
compile (packs, liveness) and two compiles' annotations must not meet.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import weakref

import torch
from torch import nn
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from harmony_fx.compiler.variants import Variant, capture_variant
from harmony_fx.frontend.backward_hooks import refuse_tensor_hooks
from harmony_fx.frontend.guards import CallKey, attribute_facts
from harmony_fx.ir import meta

__all__ = ["cached_capture", "reset"]

_KEPT_PER_MODEL = 8   # a model's captures beyond these go, the least recently used first

_captures: "weakref.WeakKeyDictionary[nn.Module, collections.OrderedDict]" = weakref.WeakKeyDictionary()


def cached_capture(model: nn.Module, size: int | None, args: tuple, kwargs: dict, target: torch.device,
                   dtype: torch.dtype | None = None) -> Variant:
    """``capture_variant``'s variant (same arguments), or a copy of the one kept for the same key
    (then its ``reused`` is true)."""
    key = (size, target, dtype, CallKey.of(model, args, kwargs), attribute_facts(model))
    kept = _captures.setdefault(model, collections.OrderedDict())
    # each kept with the values its reads gave when captured: a value the key does not reach, read again
    held, values = kept.get(key, (None, None))
    if held is not None and values == held.captured.attribute_reads.values():
        # kept by a compile with no backward, where a hook the forward registers is moot
        refuse_tensor_hooks(held.captured.tensor_hooks)
        kept.move_to_end(key)
        return dataclasses.replace(_with_masters(_copy(held), model), reused=True)
    variant = capture_variant(model, size, args, kwargs, target, dtype)
    # read again: capturing runs the forward, which materializes a lazy module's parameters
    kept[(size, target, dtype, CallKey.of(model, args, kwargs), attribute_facts(model))] = (
        _without_masters(_copy(variant), model), variant.captured.attribute_reads.values())
    while len(kept) > _KEPT_PER_MODEL:
        kept.popitem(last=False)
    return variant


def reset() -> None:
    """Forget every capture kept: the next compile of each model captures it again."""
    _captures.clear()


def _without_masters(variant: Variant, model: nn.Module) -> Variant:
    """The variant to keep: without the model's own parameters and buffers, found again by name
    on a hit (the key holds their identities), so that a capture kept never keeps a parameter
    alive that the model let go (``load_state_dict(assign=True)``: a copy of the weights each)."""
    held = dict(model.named_buffers(remove_duplicate=False))
    constants = {name: tensor for name, tensor in variant.captured.buffers.items()
                 if variant.nodes[name].meta[meta.TARGET] not in held}  # export's own, or tensor attributes
    return dataclasses.replace(variant, captured=dataclasses.replace(variant.captured, params={}, buffers=constants))


def _with_masters(variant: Variant, model: nn.Module) -> Variant:
    """The kept variant with the model's parameters and buffers, in placeholder order, as captured."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    captured = variant.captured
    found_params, found_buffers = {}, {}
    for node in captured.gm.graph.find_nodes(op="placeholder"):
        if meta.role_of(node) == meta.Role.PARAM:
            found_params[node.name] = params[node.meta[meta.TARGET]]
        elif meta.role_of(node) == meta.Role.BUFFER:  # a constant was kept; the model's own are found again
            kept = captured.buffers.get(node.name)
            found_buffers[node.name] = buffers[node.meta[meta.TARGET]] if kept is None else kept
    return dataclasses.replace(variant, captured=dataclasses.replace(captured, params=found_params,
                                                                     buffers=found_buffers))


def _copy(variant: Variant) -> Variant:
    gm = variant.captured.gm
    graph = copy.deepcopy(gm.graph)
    for original, node in zip(gm.graph.nodes, graph.nodes):
        node.name = original.name  # export names nodes as fx would not (a placeholder ``input``)
    with _use_lazy_graph_module(True):  # its code generated when first asked for, if ever
        graph_module = _make_graph_module(gm, graph, class_name=type(gm).__name__)
    graph_module.meta.update(gm.meta)
    captured = dataclasses.replace(variant.captured, gm=graph_module)
    return dataclasses.replace(variant, captured=captured,
                               nodes={node.name: node for node in graph_module.graph.nodes})
