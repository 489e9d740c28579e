"""Give every size that depends on the values its largest value.

``x[mask]``, ``nonzero``, ``masked_select``, ``unique``: export records the size of such a result
as a symbol it knows only the range of (``u0`` in [0, 16] rows for a mask over 16). Packs, stash
and budget are planned from sizes, so each value carrying such a symbol gets, in ``meta["val"]``,
the tensor its largest size makes: every symbol at the top of its range. A plan for the largest
fits whatever the data selects (the runtime runs the real sizes, never more). A symbol without a
finite top (``repeat_interleave`` by a tensor of repeats) is left as it is: ``frontend.refusals``
then refuses the model. ``meta[BOUNDED]`` marks the nodes whose value is such a bound.
"""
from __future__ import annotations

import sympy
import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from harmony_fx.ir import meta
from harmony_fx.ir.values import leaves

__all__ = ["bound_sizes", "unbacked_symbols", "PASS_NAME"]

PASS_NAME = "bound_sizes"
_NO_BOUND = 2**62  # a bound at least this large is a default, not one the graph's values give


def bound_sizes(gm: fx.GraphModule) -> fx.GraphModule:
    symbols = {node: unbacked_symbols(node.meta.get(meta.VAL)) for node in gm.graph.nodes}
    if not any(symbols.values()):
        return gm
    fake_mode = detect_fake_mode([leaf for node in gm.graph.nodes for leaf in leaves(node.meta.get(meta.VAL))
                                  if isinstance(leaf, torch.Tensor)])
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        return gm
    tops: dict[sympy.Symbol, int] = {}
    for symbol in set().union(*symbols.values()):
        top = shape_env.bound_sympy(symbol).upper
        # not torch's int_oo (a sympy.Number), nor the bound every size-like symbol gets (2**63 - 2)
        if isinstance(top, sympy.Integer) and int(top) < _NO_BOUND:
            tops[symbol] = int(top)
    with fake_mode:
        for node, found in symbols.items():
            if found and found <= tops.keys():
                node.meta[meta.VAL] = _at_top(node.meta[meta.VAL], tops)
                node.meta[meta.BOUNDED] = True
    return gm


def unbacked_symbols(value) -> set:
    """The symbols of sizes that depend on the values in ``value`` (a node's ``meta["val"]``)."""
    # a tensor whose sizes and strides are all ints (nearly every node) has none: the flag is C's, the walk is not
    return {symbol for leaf in leaves(value) if isinstance(leaf, (torch.SymInt, torch.SymBool))
            or isinstance(leaf, torch.Tensor) and leaf._has_symbolic_sizes_strides
            for symbol in free_unbacked_symbols(leaf)}


def _at_top(value, tops: dict):
    def number(x):
        if isinstance(x, (torch.SymInt, torch.SymBool)):
            result = x.node.expr.xreplace(tops)
            return bool(result) if isinstance(x, torch.SymBool) else int(result)
        return x

    def tensor(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided([number(s) for s in t.shape], [number(s) for s in t.stride()], dtype=t.dtype,
                                   device=t.device)

    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_at_top(item, tops) for item in value)
    return number(value)
