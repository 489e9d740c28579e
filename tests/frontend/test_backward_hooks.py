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


def test_a_hook_registered_in_forward_is_moot_in_a_call_under_no_grad():
    """A compile for calls under ``no_grad`` (an eval loop) captures with grad on, so a forward that
    registers a hook where its tensor requires grad did so in the capture only: it was refused,
    though no backward follows. It runs as eager; a call with a backward after it is still refused,
    also where it would take the capture the ``no_grad`` call kept."""
    torch.manual_seed(0)
    model = _ClipsInForward()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"], microbatches=1)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(hm(x), reference(x))
    with pytest.raises(ValueError, match=r"registers a hook on a tensor it makes, at \S+test_backward_hooks.py:\d+ in "
                                         r"forward: hidden.register_hook"):
        hm(x)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
def test_flop_counter_mode_around_a_compiled_module_gives_eagers_numbers(grad):
    """``FlopCounterMode`` (Lightning's model summary runs the example input under it, under
    ``no_grad``) tracks modules with global forward hooks that register a hook on each module's
    output, only noting which module the backward is in: they were refused as the model's own,
    naming the caller's line. They are dropped; outputs and gradients are eager's."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _model()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"], microbatches=1, pack_boundaries=(0, 2))
    x = torch.randn(4, 8)
    for module in (hm, reference):
        with FlopCounterMode(display=False), torch.set_grad_enabled(grad):
            out = module(x)
            if grad:
                out.square().sum().backward()
        if module is hm:
            result = out
    torch.testing.assert_close(result, out)
    if grad:
        assert_grads_equal(model, reference)


class _GradCam:
    """Keeps a layer's output as an attribute (Grad-CAM's activations)."""

    def __init__(self, layer: nn.Module) -> None:
        self.activations = None
        layer.register_forward_hook(self.keep)

    def keep(self, module, args, output) -> None:
        self.activations = output


@pytest.mark.parametrize("keeper", ["dict in a closure", "object's attribute"])
def test_a_forward_hook_that_keeps_a_modules_output_is_refused(keeper):
    """A hook's Python runs once, at capture, on FakeTensors: ``features['relu'] = out`` (feature
    extraction, Grad-CAM, a perceptual loss) left a FakeTensor in the caller's dict, never the
    call's activation, and a loss computed from it was a FakeTensor: refused, saying what to do.
    A hook that returns a new output (the graph keeps its ops) still runs as eager."""
    model = _model()
    if keeper == "dict in a closure":
        features: dict = {}
        model[1].register_forward_hook(lambda module, args, out: features.__setitem__("relu", out))
    else:
        _GradCam(model[1])
    with pytest.raises(ValueError, match=r"a forward hook on the module '1' \(ReLU\), .*keeps a tensor of the forward.*"
                                         r"create_feature_extractor"):
        _compile(model, torch.randn(4, 8))
    model, x = _model(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[1].register_forward_hook(lambda module, args, out: out * 2)
    torch.testing.assert_close(_compile(model, x)(x), reference(x))
