"""``torch.vmap`` inside a model's forward, as plain ATen ops.

Export keeps a vmap as the calls that run it: ``_vmap_increment_nesting`` (a global functorch
level pushed), ``_add_batch_dim`` on each input, the per-sample ops on values whose ``meta["val"]``
are one sample's, ``_remove_batch_dim``, ``_vmap_decrement_nesting``. Nothing after capture may run
such a graph node by node: the sizes are a sample's, a pack cut inside the region would run half a
transform, and an error between the two calls would leave the level pushed for the rest of the
process. ``inline_vmap_regions`` traces each region again (``make_fx`` over the region's own calls,
on the captured FakeTensors), where functorch's batching rules turn it into the batched ops it
computes (``bmm`` for a per-sample ``matmul``), and puts those in its place.

The other functorch transforms export keeps this way (``torch.func.jvp``, forward-mode dual
numbers) are refused: their ops compute derivatives inside the forward, which the packs' backward
does not replay.
"""
from __future__ import annotations

import contextlib

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._functorch import predispatch

from harmony_fx.ir import meta

__all__ = ["inline_vmap_regions", "functorch_call"]

_ENTER, _EXIT = predispatch._vmap_increment_nesting, predispatch._vmap_decrement_nesting
_NO_OP = predispatch.lazy_load_decompositions
# what a region traced again keeps of the region's own nodes: where in the model it came from
_PLACE_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack")


def functorch_call(node: fx.Node) -> bool:
    """Whether ``node`` is one of the calls export keeps a functorch transform as."""
    return node.op == "call_function" and getattr(node.target, "__module__", None) == predispatch.__name__


def inline_vmap_regions(gm: fx.GraphModule) -> fx.GraphModule:
    if not gm.graph.find_nodes(op="call_function", target=_ENTER):
        return gm  # nearly every model: the graph as export left it (its code not made again)
    for node in list(gm.graph.find_nodes(op="call_function", target=_NO_OP)):
        if not node.users:
            gm.graph.erase_node(node)
    while (region := _first_region(gm.graph)) is not None:
        _inline(gm, region)
    gm.graph.lint()
    gm.recompile()
    return gm


def _first_region(graph: fx.Graph) -> list[fx.Node] | None:
    """The nodes from the first outermost ``_vmap_increment_nesting`` to its own decrement."""
    region: list[fx.Node] = []
    depth = 0
    for node in graph.nodes:
        entering = node.op == "call_function" and node.target is _ENTER
        if entering or depth:
            region.append(node)
        if entering:
            depth += 1
        elif depth and node.op == "call_function" and node.target is _EXIT:
            depth -= 1
            if not depth:
                return region
    return None


def _inline(gm: fx.GraphModule, region: list[fx.Node]) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    inside = set(region)
    inputs = list(dict.fromkeys(arg for node in region for arg in node.all_input_nodes if arg not in inside))
    outputs = [node for node in region if any(user not in inside for user in node.users)]

    def run(*values):
        env = dict(zip(inputs, values))
        for node in region:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = node.target(*args, **kwargs)
        return [env[node] for node in outputs]

    examples = [node.meta[meta.VAL] for node in inputs]
    level = torch._C._functorch.maybe_current_level()
    try:
        with detect_fake_mode(examples) or contextlib.nullcontext():
            traced = make_fx(run, tracing_mode="real")(*examples)
    finally:  # a region that raised half way leaves its level pushed: the process's, popped here
        while (torch._C._functorch.maybe_current_level() or 0) > (level or 0):
            torch._C._functorch._vmap_decrement_nesting()
    if traced.graph.find_nodes(op="get_attr"):
        raise ValueError(f"a torch.vmap region at node {region[0].name} makes a constant tensor inside the function "
                         "it maps, which harmony_fx cannot lift out of it: make that tensor outside torch.vmap and "
                         "pass it in (or apply vmap outside the compiled model).")
    place = {key: region[0].meta[key] for key in _PLACE_KEYS if key in region[0].meta}
    mapping = dict(zip(traced.graph.find_nodes(op="placeholder"), inputs))
    with gm.graph.inserting_before(region[0]):
        for node in traced.graph.nodes:
            if node.op == "output":
                replacements = fx.map_arg(node.args[0], mapping.__getitem__)
            elif node.op != "placeholder":
                copied = gm.graph.node_copy(node, mapping.__getitem__)
                copied.meta = {**place, meta.VAL: node.meta.get(meta.VAL)}
                mapping[node] = copied
    for old, new in zip(outputs, replacements):
        old.replace_all_uses_with(new)
    for node in reversed(region):
        gm.graph.erase_node(node)
