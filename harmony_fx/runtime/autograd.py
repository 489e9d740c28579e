"""The compiled model as one autograd function: ``loss.backward()`` runs the harmony backward.

Forward runs the forward programs; autograd's backward runs the backward programs and hands the
host gradients to autograd, which accumulates them into ``param.grad`` (and the inputs' ``.grad``)
as usual.
"""
from __future__ import annotations

import torch

__all__ = ["HarmonyFunction"]


class HarmonyFunction(torch.autograd.Function):
    """``apply(session, calls, per_mb, *flat_inputs, *trainable_params)``; the tensors are
    arguments only so that autograd connects the outputs to them."""

    @staticmethod
    def forward(ctx, session, calls, per_mb, *inputs_and_params):
        # an output the caller's loss does not reach gets ``None``, not zeros: what it alone feeds
        # (a pooler the loss ignores) keeps ``.grad`` None, as in eager, and the optimizer skips it
        ctx.set_materialize_grads(False)
        iteration = session.start(per_mb)
        ctx.session, ctx.calls, ctx.iteration = session, calls, iteration
        ctx.params = inputs_and_params[len(calls.inputs):]  # the trainable parameters, as the caller found them
        outputs = calls.merge_outputs(iteration)
        session.finish_stats()
        differentiable = session.compiled.signature.differentiable
        ctx.mark_non_differentiable(*[o for o, name in zip(outputs, calls.outputs) if name not in differentiable])
        return outputs

    @staticmethod
    # autograd runs loss.backward() of a compiled training step (forward, backward and
    # optimizer.step under one torch.compile) at a graph break, with Dynamo's frame callback on:
    # it would trace harmony's runtime, frame by frame, and hand its pieces to the backend
    @torch.compiler.disable(reason="harmony_fx's backward runs its own compiled programs")
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # autograd runs a backward with grad mode on only for create_graph=True
            raise RuntimeError(
                "harmony_fx: a gradient of a gradient (create_graph=True: a gradient penalty, double backward) "
                "through a compiled model: harmony_fx computes first-order gradients pack by pack, on the "
                "devices, and hands autograd their values, with no graph of how they were made. Compute such a "
                "term with the eager model, or with torch.func on it.")
        return _first_order_backward(ctx, *grad_outputs)


@torch.autograd.function.once_differentiable
def _first_order_backward(ctx, *grad_outputs):
    session, calls, iteration = ctx.session, ctx.calls, ctx.iteration
    if iteration is None:
        # the backward programs used up what the forward left (the stash, the kept graphs)
        raise RuntimeError(
            "harmony_fx: backward through the same call of a compiled model a second time "
            "(retain_graph=True): harmony_fx runs a call's backward once, freeing what its forward "
            "stashed. Sum the losses and call backward once, or call the model again.")
    ctx.iteration = None
    calls.put_output_grads(iteration, grad_outputs)
    session.finish(iteration)
    input_grads = calls.input_grads(iteration)
    param_grads = iteration.host_grads.get_all([id(param) for param in ctx.params])
    return (None, None, None, *input_grads, *param_grads)
