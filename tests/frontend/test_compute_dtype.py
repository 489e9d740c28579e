"""frontend.compute_dtype: under precision="bf16" the model is captured as the devices run it, on
bf16 tensors, with every placeholder still mapped to the model's own fp32 tensor."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harmony_fx.frontend.capture import capture
from harmony_fx.ir import meta

BF16 = torch.bfloat16


class Mixed(nn.Module):
    """A tied weight, a plain tensor attribute (a constant to export), a float and an integer
    buffer, and casts that follow the input's dtype around an fp32 computation."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.proj.weight
        self.scale = torch.linspace(0.5, 1.5, 8)
        self.register_buffer("shift", torch.ones(8))
        self.register_buffer("offsets", torch.arange(8))

    def forward(self, x, ids):
        h = self.proj(x) * self.scale + self.shift
        weights = torch.softmax(h, dim=-1, dtype=torch.float32).to(x.dtype)
        return self.head(weights) + self.offsets[ids].unsqueeze(-1).to(x.dtype)


def _example():
    torch.manual_seed(0)
    return Mixed(), (torch.randn(4, 8), torch.randint(0, 8, (4,)))


def _placeholders(captured):
    return {node.name: node for node in captured.gm.graph.find_nodes(op="placeholder")}


def test_floating_placeholders_are_bf16_and_map_to_the_models_own_tensors():
    model, inputs = _example()
    captured = capture(model, inputs, dtype=BF16)
    assert captured.method == "torch.export"
    nodes = _placeholders(captured)
    # every placeholder is the model's own Parameter object (the tied one under either name)
    assert {id(p) for p in captured.params.values()} == {id(p) for p in model.parameters()}
    own = {id(model.shift), id(model.offsets), id(model.scale)}
    assert {id(t) for t in captured.buffers.values()} == own
    for name, tensor in {**captured.params, **captured.buffers}.items():
        expected = BF16 if tensor.is_floating_point() else tensor.dtype
        assert nodes[name].meta[meta.VAL].dtype == expected, name
        assert tensor.dtype in (torch.float32, torch.int64)  # the model's own, not the twin's
    x, ids = (nodes[name].meta[meta.VAL] for name in captured.inputs)
    assert (x.dtype, ids.dtype) == (BF16, torch.int64)


def test_a_cast_to_the_inputs_dtype_is_a_cast_to_bf16():
    """``.to(x.dtype)`` after an fp32 softmax: captured from bf16 tensors it casts back to bf16 (the
    fp32 capture bakes a cast to fp32, which then meets bf16 weights)."""
    model, inputs = _example()

    def cast_after_softmax(captured):
        softmax = next(node for node in captured.gm.graph.nodes if node.target is torch.ops.aten.softmax.int)
        return next(user.args[1] for user in softmax.users if user.target is torch.ops.aten.to.dtype)

    in_bf16, in_fp32 = capture(model, inputs, dtype=BF16), capture(model, inputs)
    assert (cast_after_softmax(in_bf16), cast_after_softmax(in_fp32)) == (BF16, torch.float32)
    output = in_bf16.gm.graph.find_nodes(op="output")[0].args[0][0]
    assert output.meta[meta.VAL].dtype == BF16


def test_the_graph_computes_what_the_model_in_bf16_computes():
    model, (x, ids) = _example()
    captured = capture(model, (x, ids), dtype=BF16)
    reference = Mixed()
    reference.load_state_dict(model.state_dict())
    reference.scale = model.scale.to(BF16)
    reference.to(BF16)
    values = {**{name: t.to(BF16) if t.is_floating_point() else t
                 for name, t in {**captured.params, **captured.buffers}.items()},
              **dict(zip(captured.inputs, (x.to(BF16), ids)))}
    order = [node.name for node in captured.gm.graph.find_nodes(op="placeholder")]
    out = captured.gm(*[values[name] for name in order])[0]
    assert out.dtype == BF16
    assert torch.equal(out, reference(x.to(BF16), ids))


def test_the_model_is_left_as_it_was():
    model, inputs = _example()
    before = {name: (t.dtype, t.data_ptr(), t.clone()) for name, t in model.state_dict(keep_vars=True).items()}
    scale = model.scale
    capture(model, inputs, dtype=BF16)
    for name, t in model.state_dict(keep_vars=True).items():
        dtype, pointer, values = before[name]
        assert (t.dtype, t.data_ptr()) == (dtype, pointer) and torch.equal(t, values), name
    assert model.scale is scale and all(p.grad is None for p in model.parameters())
    assert inputs[0].dtype == torch.float32


def test_lstm_flat_weights_are_captured_in_bf16():
    """nn.LSTM runs from a list of its parameters (``_flat_weights``), which export sets as it puts
    its fakes in place: the twin's weights are captured, and the model's list is left as it was."""
    lstm = nn.LSTM(8, 16, batch_first=True)
    x = torch.randn(2, 5, 8)
    expected = lstm(x)[0]
    captured = capture(lstm, (x,), dtype=BF16)
    nodes = _placeholders(captured)
    assert {id(p) for p in captured.params.values()} == {id(p) for p in lstm.parameters()}
    assert all(nodes[name].meta[meta.VAL].dtype == BF16 for name in captured.params)
    assert [id(w) for w in lstm._flat_weights] == [id(p) for p in lstm.parameters()]
    assert torch.equal(lstm(x)[0], expected)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_the_symbolic_trace_fallback_propagates_bf16(monkeypatch):
    def export_fails(*args, **kwargs):
        raise RuntimeError("torch.export is switched off for this test")

    monkeypatch.setattr(torch.export, "export", export_fails)
    model = TwoLayers()
    captured = capture(model, (torch.randn(4, 8),), dtype=BF16)
    assert captured.method == "torch.fx.symbolic_trace"
    floating = [node.meta[meta.VAL].dtype for node in captured.gm.graph.nodes
                if isinstance(node.meta.get(meta.VAL), torch.Tensor)]
    assert floating and set(floating) == {BF16}


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_without_a_compute_dtype_the_graph_keeps_the_models_dtypes(dtype):
    model, inputs = _example()
    captured = capture(model, inputs, dtype=dtype)
    assert not any(getattr(node.meta.get(meta.VAL), "dtype", None) == BF16 for node in captured.gm.graph.nodes)


def test_a_parametrized_module_is_twinned_and_computes_as_in_bf16():
    """weight_norm's parametrization (Wav2Vec2's positional convolution) refuses copy.copy; the
    twin copies it all the same, and its placeholders are the model's ``original0``/``original1``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)), nn.Tanh())
    x = torch.randn(4, 8)
    captured = capture(model, (x,), dtype=BF16)
    params = {meta_target for meta_target in (node.meta.get(meta.TARGET) for node in
                                              captured.gm.graph.find_nodes(op="placeholder")) if meta_target}
    assert {"0.parametrizations.weight.original0", "0.parametrizations.weight.original1"} <= params
    expected = copy.deepcopy(model).to(BF16)(x.to(BF16))
    names = [node.name for node in captured.gm.graph.find_nodes(op="placeholder")]
    values = {**{n: p.to(BF16) for n, p in captured.params.items()}, **{n: b for n, b in captured.buffers.items()}}
    result = captured.gm(*[values[n] if n in values else x.to(BF16) for n in names])
    torch.testing.assert_close(result[0], expected, rtol=0, atol=0)
