"""Which nodes draw random numbers: a pack holding one saves its RNG state in the forward and
replays it in the recompute, and the planner will not cut the batch of a model that has one.

An ATen op draws from a generator exactly when its schema carries ``torch.Tag.nondeterministic_seeded``
(``native_dropout``, SDPA with dropout, ``bernoulli``, ``exponential_`` in ``gumbel_softmax``,
``rrelu_with_noise``, ...). A node that calls something else (``torch.fx.symbolic_trace`` records
``torch.nn.functional.dropout``, a method such as ``bernoulli_``) is recognised by name. A higher-order
op (a ``no_grad`` or autocast region) draws if its subgraph does, and a model's own autograd
Function (``ir.autograd_functions``) if its forward did when export ran it. A dropout whose probability is 0,
or that is not training, draws nothing.
"""
from __future__ import annotations

import inspect

import torch
from torch import fx

from harmony_fx.ir import autograd_functions

__all__ = ["draws_random"]

# what ``torch.fx.symbolic_trace`` records for the random functions and methods
_RANDOM_NAMES = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "native_dropout", "feature_dropout", "alpha_dropout",
    "feature_alpha_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "random_", "multinomial", "rrelu", "rrelu_", "rrelu_with_noise", "gumbel_softmax",
    "scaled_dot_product_attention", "fractional_max_pool2d", "fractional_max_pool3d",
})


def draws_random(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if target is autograd_functions.AUTOGRAD_FUNCTION:  # a model's own Function: as its forward ran
        return autograd_functions.draws_random(node.args[0])
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags and not _switched_off(node)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return any(draws_random(inner) for sub in _subgraphs(node) for inner in sub.graph.nodes)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name in _RANDOM_NAMES and not _switched_off(node)


def _switched_off(node: fx.Node) -> bool:
    """A dropout with probability 0 or not in training: no numbers are drawn (an LSTM's ``dropout``
    between its layers alike)."""
    arguments = _arguments(node)
    for name in ("p", "dropout_p", "dropout"):
        if arguments.get(name) == 0:
            return True
    return arguments.get("train", arguments.get("training", True)) is False


def _arguments(node: fx.Node) -> dict[str, object]:
    """The node's arguments by name, defaults included, where its schema or signature names them."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        named = {argument.name: argument.default_value for argument in schema.arguments
                 if argument.has_default_value()}
        named.update({argument.name: value for argument, value in zip(schema.arguments, node.args)})
        return {**named, **node.kwargs}
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a method name, or a builtin without a signature
        return dict(node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _subgraphs(node: fx.Node) -> list[fx.GraphModule]:
    root = node.graph.owning_module
    found = []
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and root is not None:
            sub = getattr(root, arg.target, None)
            if isinstance(sub, fx.GraphModule):
                found.append(sub)
    return found
