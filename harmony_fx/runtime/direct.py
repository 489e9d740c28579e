"""Uncompiled packs, run with each ATen op called through its C++ binding.

fx's generated code calls every op as ``torch.ops.aten.mm.default(...)``: four attribute loads and
a Python frame (``OpOverload.__call__``, which does nothing but call the op's binding ``_op``) around
each op, about 0.4 µs of a small op's 2-3 µs, and a block of a transformer has dozens of ops.
``direct_forward(gm)`` is the same generated code with each ``OpOverload`` bound to its ``_op``:
the same dispatcher call, so the same kernels, autograd, dispatch modes (the HostDevice's memory
account, FakeTensors) and errors. A dropout that ATen returns its input from for the graph's
constant arguments (``p=0``, or not training: a model's ``Dropout(0.0)``) is not called at all.
The pack's own ``GraphModule``, the one users print, is unchanged.
"""
from __future__ import annotations

import linecache
import re
import weakref
from typing import Callable

import torch
from torch import fx

__all__ = ["direct_forward"]

# gm -> (the code it was made from, the function): a graph recompiled since gets a new function
_MADE: "weakref.WeakKeyDictionary[fx.GraphModule, tuple[str, Callable]]" = weakref.WeakKeyDictionary()


def direct_forward(gm: fx.GraphModule) -> Callable:
    """``gm``'s forward as a function of ``(gm, *inputs)``, its ops called directly (made once per code)."""
    made = _MADE.get(gm)
    if made is not None and made[0] is gm.code:
        return made[1]
    code = _without_identities(gm.graph).python_code(root_module="self")
    source, bindings = code.src, dict(code.globals)
    for number, op in enumerate(_overloads(gm.graph)):
        name = f"_op{number}_{op._opname}"
        source, replaced = re.subn(rf"(?<![\w.]){re.escape(_spelled(op))}\(", f"{name}(", source)
        if replaced:
            bindings[name] = op._op
    filename = f"<harmony_fx direct {id(gm):x}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)  # tracebacks show the line
    exec(compile(source, filename, "exec"), bindings)  # noqa: S102 - fx's own generated code
    forward = bindings["forward"]
    _MADE[gm] = (gm.code, forward)
    return forward


# ATen returns the input itself from these for p == 0 or train == False (``_dropout_impl``)
_DROPOUTS = frozenset([torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
                       torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default])


def _without_identities(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` in which each call that returns its input unchanged is its input."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    copy._codegen = graph._codegen  # how inputs and outputs are spelled
    for node in list(copy.nodes):
        if node.op == "call_function" and node.target in _DROPOUTS and len(node.args) == 3:
            source, p, train = node.args
            if isinstance(p, (int, float)) and isinstance(train, bool) and (p == 0 or not train):
                node.replace_all_uses_with(source)
                copy.erase_node(node)
    return copy


def _overloads(graph: fx.Graph) -> list[torch._ops.OpOverload]:
    """The graph's ops whose call is only the forward to ``_op`` (a subclass may do more: left as is)."""
    ops = {node.target for node in graph.nodes if node.op == "call_function" and type(node.target) is torch._ops.OpOverload}
    return sorted(ops, key=_spelled)


def _spelled(op: torch._ops.OpOverload) -> str:
    """How fx's generated code names ``op``."""
    return f"torch.ops.{op.namespace}.{op._opname}.{op._overloadname}"
