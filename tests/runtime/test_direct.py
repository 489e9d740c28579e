"""Uncompiled packs run with each ATen op called through its C++ binding (``runtime.direct``)."""
from __future__ import annotations

import copy
import traceback

import pytest
import torch

import harmony_fx
from harmony_fx.models import GPTConfig, TinyGPT
from harmony_fx.runtime.direct import direct_forward


def _gpt():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1))
    return model, torch.randint(0, 32, (2, 8))


def test_a_pack_runs_no_op_through_the_python_layer_and_trains_like_eager(monkeypatch):
    model, idx = _gpt()
    reference = copy.deepcopy(model)
    # untracked: the memory account's dispatch mode calls every op again through the Python layer
    # three packs (the blocks' recomputed), one microbatch: dropout draws eager's masks
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], microbatches=1, track_memory=False,
                            pack_boundaries=(0, 5, 6))
    assert len(hm.packs) == 3
    calls = []
    python_layer = torch._ops.OpOverload.__call__
    monkeypatch.setattr(torch._ops.OpOverload, "__call__", lambda op, *a, **k: calls.append(op) or python_layer(op, *a, **k))
    torch.manual_seed(1)
    hm(idx).square().mean().backward()
    ops_in_packs = {node.target for pack in hm.packs for node in pack.gm.graph.nodes if node.op == "call_function"}
    assert not ops_in_packs & set(calls)  # every op of every pack went straight to its binding
    monkeypatch.setattr(torch._ops.OpOverload, "__call__", python_layer)
    torch.manual_seed(1)
    reference(idx).square().mean().backward()  # dropout: the same masks, drawn in the same order
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_direct_function_computes_what_the_graph_module_does():
    model, idx = _gpt()
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], microbatches=1)
    (pack,) = hm.packs
    args = [idx, *[hm.compiled.masters[name] for name in pack.params + pack.buffers]]
    args = [args[0], *[args[1:][slot] for slot in pack.state_slot]]
    torch.manual_seed(2)
    expected = pack.gm(*args)
    torch.manual_seed(2)
    got = direct_forward(pack.gm)(pack.gm, *args)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert "torch.ops.aten." not in direct_source(pack.gm)


def direct_source(gm) -> str:
    import linecache

    forward = direct_forward(gm)
    return "".join(linecache.getlines(forward.__code__.co_filename))


def test_a_recompiled_graph_gets_a_new_function_and_errors_point_at_the_generated_line():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
    gm = torch.fx.experimental.proxy_tensor.make_fx(gm)(torch.randn(2, 3))
    first = direct_forward(gm)
    assert direct_forward(gm) is first  # made once
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.relu.default:
            node.target = torch.ops.aten.sigmoid.default
    gm.recompile()
    second = direct_forward(gm)
    assert second is not first
    x = torch.randn(2, 3)
    torch.testing.assert_close(second(gm, x), gm(x))
    with pytest.raises(RuntimeError) as raised:
        second(gm, torch.randn(2, 4))  # the wrong width: mm refuses it
    lines = traceback.format_tb(raised.value.__traceback__)
    assert any("harmony_fx direct" in line and "torch.ops" not in line and "(" in line for line in lines)


def _dropout_graph(p: float, train: bool) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    dropped = graph.call_function(torch.ops.aten.dropout.default, (x, p, train))
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (dropped, 2.0)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(("p", "train", "called"), [(0.0, True, False), (0.5, False, False), (0.5, True, True)])
def test_a_dropout_aten_returns_its_input_from_is_not_called(p, train, called):
    gm = _dropout_graph(p, train)
    assert ("dropout" in direct_source(gm)) == called
    x = torch.randn(64)
    torch.manual_seed(3)
    expected = gm(x)
    torch.manual_seed(3)
    assert torch.equal(direct_forward(gm)(gm, x), expected)
    assert "dropout" in gm.code  # the graph module itself keeps it
