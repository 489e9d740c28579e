"""What lowering needs to know about the model beyond its packs: its inputs and outputs, which
values are differentiable, which inputs want gradients (``ProgramSignature``)."""
from __future__ import annotations

from typing import Sequence

from torch import fx

from harmony_fx.analysis.requires_grad import any_requires_grad
from harmony_fx.frontend.capture import Captured
from harmony_fx.ir import meta
from harmony_fx.lowering.tasks import ProgramSignature

__all__ = ["program_signature"]


def program_signature(captured: Captured, requires_grad: Sequence[bool], num_microbatches: int, grouping: bool,
                      trainer: bool, forward_only: bool = False) -> ProgramSignature:
    """``requires_grad``: per captured input, whether the caller's tensor requires grad;
    ``trainer``: the loss is in the graph and the last pack runs forward and backward fused;
    ``forward_only``: no backward follows (nothing is differentiable, nothing is stashed)."""
    nodes = captured.gm.graph.nodes
    differentiable = [n.name for n in nodes
                      if any_requires_grad(n) and meta.role_of(n) not in (meta.Role.PARAM, meta.Role.BUFFER)]
    output_args = captured.gm.graph.find_nodes(op="output")[0].args[0]
    # an input, parameter or buffer returned unchanged is handed back as the caller's own tensor,
    # as eager returns it (``frontend.calls``): only what the model computes is the program's output
    outputs = [arg.name for arg in output_args if isinstance(arg, fx.Node) and arg.op != "placeholder"]
    if not outputs:
        raise ValueError("the model computes nothing it returns (every output is an input, parameter or buffer "
                         "unchanged): there is nothing for harmony_fx to run; call the model eagerly.")
    inputs_requiring_grad = [name for name, flag in zip(captured.inputs, requires_grad) if flag]
    if forward_only:
        differentiable, inputs_requiring_grad = [], []
    return ProgramSignature(tuple(captured.inputs), tuple(dict.fromkeys(outputs)), frozenset(inputs_requiring_grad),
                            frozenset(differentiable), tuple(range(num_microbatches)), grouping=grouping,
                            fuse_last=trainer, forward_only=forward_only)
