"""``frontend.backward_hooks``: hooks on the backward that a captured graph would drop are refused
at compile, naming the module or the model's line; the hooks harmony_fx does run (on parameters,
inputs and outputs) give eager's gradients."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import harmony_fx
from tests.helpers import assert_grads_equal


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _compile(model: nn.Module, x: torch.Tensor):
    return harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=1, pack_boundaries=(0, 2))


@pytest.mark.parametrize("register", ["register_full_backward_hook", "register_full_backward_pre_hook"])
def test_a_module_backward_hook_is_refused_naming_the_module(register):
    model = _model()
    getattr(model[2], register)(lambda *args: None)
    with pytest.raises(ValueError, match=r"the module '2' \(Linear\) has a backward hook.*param.register_hook"):
        _compile(model, torch.randn(4, 8))


def test_a_global_module_backward_hook_is_refused():
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda *args: None)
    try:
        with pytest.raises(ValueError, match="register_module_full_backward_hook"):
            _compile(_model(), torch.randn(4, 8))
    finally:
        handle.remove()


class _ClipsInForward(nn.Module):
    """Scales its hidden state's gradient with a hook registered in forward: export drops it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: grad * 3)
        return self.second(hidden)


def test_a_hook_registered_in_forward_is_refused_naming_the_line():
    with pytest.raises(ValueError, match=r"registers a hook on a tensor it makes, at \S+test_backward_hooks.py:\d+ in "
                                         r"forward: hidden.register_hook"):
        _compile(_ClipsInForward(), torch.randn(4, 8))
    assert torch.Tensor.register_hook is torch.Tensor.__dict__["register_hook"]  # put back
    probe = torch.zeros(1, requires_grad=True)
    probe.register_hook(lambda grad: grad)  # and works as before


def test_hooks_on_parameters_inputs_and_outputs_run_as_in_eager():
    model = _model()
    reference = copy.deepcopy(model)
    seen: list[str] = []
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    for m, where in ((model, "harmony"), (reference, "eager")):
        m[0].weight.register_hook(lambda grad, where=where: seen.append(f"{where} weight") or grad * 2)
        m[2].bias.register_post_accumulate_grad_hook(lambda param, where=where: seen.append(f"{where} bias"))
    for inp, where in ((x, "harmony"), (x_ref, "eager")):
        inp.register_hook(lambda grad, where=where: seen.append(f"{where} input") or grad)
    hm = _compile(model, x.detach())
    out = hm(x)
    out.register_hook(lambda grad: seen.append("harmony output") or grad * 0.5)
    ref_out = reference(x_ref)
    ref_out.register_hook(lambda grad: seen.append("eager output") or grad * 0.5)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    assert sorted(seen) == sorted(f"{where} {what}" for where in ("harmony", "eager")
                                  for what in ("weight", "bias", "input", "output"))
    assert_grads_equal(model, reference, inputs=[x], ref_inputs=[x_ref])


def test_through_torch_compile_a_hook_is_never_silently_dropped():
    """Dynamo keeps a hook registered in forward as ``torch.ops.higher_order.register_hook`` (torch
    2.13), which export traced through on fakes: the gradient was silently eager's without the hook.
    Either refused, or eager's gradients (where Dynamo leaves the hook outside the graph)."""
    torch.manual_seed(0)
    model = _ClipsInForward()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    compiled = torch.compile(model, backend="harmony", options={"devices": ["host:0"]})
    try:
        compiled(x).sum().backward()
    except ValueError as error:
        assert "registers a hook on a tensor it makes" in str(error)
        return
    reference(x).sum().backward()
    assert_grads_equal(model, reference)


def test_through_torch_compile_a_module_backward_hook_runs_as_in_eager():
    """Dynamo calls a module's backward hooks around its graph, not in it."""
    model = _model()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[2].register_full_backward_hook(lambda module, grad_input, grad_output: (grad_input[0] * 3,))
    x = torch.randn(4, 8)
    torch.compile(model, backend="harmony", options={"devices": ["host:0"]})(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(model, reference)
