"""annotate_requires_grad: every value requires grad exactly where eager's does, leaf by leaf."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harmony_fx.analysis.requires_grad import annotate_requires_grad, requires_grad_of
from harmony_fx.frontend.capture import capture


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x, target):
        hidden = self.linear(x)
        out, (h, c) = self.lstm(hidden)
        with torch.no_grad():
            scaled = hidden * 2
        frozen = self.frozen(target)
        return F.soft_margin_loss(out, target) + scaled.sum() + h.detach().sum() + frozen.sum() + out.argmax()


def _flags(x_requires_grad: bool) -> dict[str, tuple[bool, ...]]:
    torch.manual_seed(0)
    model = _Mixed()
    x, target = torch.randn(2, 3, 4, requires_grad=x_requires_grad), torch.randn(2, 3, 4).sign()
    captured = capture(model, (x, target))
    flags = {name: p.requires_grad for name, p in captured.params.items()}
    flags.update(zip(captured.inputs, (x.requires_grad, target.requires_grad)))
    annotate_requires_grad(captured.gm, flags)
    by_target = {}
    for node in captured.gm.graph.nodes:
        key = node.target.__name__ if callable(node.target) and hasattr(node.target, "__name__") else str(node.target)
        by_target.setdefault(key, requires_grad_of(node))
    return by_target


def test_flags_follow_autograd_as_eager_does():
    flags = _flags(x_requires_grad=False)
    assert flags["x"] == (False,) and flags["target"] == (False,)
    assert flags["linear.default"] == (True,)                 # reads a trainable weight
    assert flags["lstm.input"] == (True, True, True)          # one flag per leaf of (out, h, c)
    assert flags["wrap_with_set_grad_enabled"] == (False,)    # computed under no_grad
    assert flags["detach.default"] == (False,)
    assert flags["argmax.default"] == (False,)                # an integer result
    assert flags["soft_margin_loss.default"] == (True,)


def test_a_frozen_layer_on_an_input_without_grad_requires_none():
    flags = _flags(x_requires_grad=False)
    frozen_linears = [name for name in flags if name.startswith("linear")]
    assert frozen_linears  # the frozen layer reads target only: it shares the op name, so check the input side
    assert _flags(x_requires_grad=True)["x"] == (True,)


class _WritesIntoAValue(nn.Module):
    """A value made without grad, then written with one that requires grad: it requires grad from
    then on, as in eager, though a call alike before the write (``kept * 2``) did not."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        hidden = self.linear(x)
        written, kept = torch.zeros_like(x), torch.zeros_like(x)
        before = kept * 2
        written[:, :2] = hidden[:, :2]
        return (written * 2).sum() + before.sum()


def _all_flags(model: nn.Module, args: tuple, kwargs: dict | None = None) -> list[list[tuple[str, tuple[bool, ...]]]]:
    """Every node's (op, flags) with calls alike reusing the first's, and with every node run."""
    results = []
    for reuse in (True, False):
        captured = capture(model, args, kwargs)
        flags = {name: x.requires_grad for name, x in zip(captured.inputs, captured.flatten_inputs(args, kwargs or {}))}
        flags.update({name: p.requires_grad for name, p in captured.params.items()})
        annotate_requires_grad(captured.gm, flags, reuse=reuse)
        results.append([(str(node.target), requires_grad_of(node)) for node in captured.gm.graph.nodes])
    return results


def test_a_write_makes_a_value_require_grad_whatever_an_alike_call_gave_before():
    torch.manual_seed(0)
    reused, ran = _all_flags(_WritesIntoAValue(), (torch.randn(3, 4),))
    assert "aten.copy_.default" in dict(ran)  # the write is in the graph
    assert [flags for op, flags in ran if op == "aten.mul.Tensor"] == [(False,), (True,)]  # before, after it
    assert reused == ran


def test_a_value_written_with_grad_is_flagged_as_the_graph_leaves_it():
    """``torch.zeros`` made without grad, then a slice of it written from a layer: a later pack
    reading it (or a view of it) must take it as requiring grad, or the layer gets no gradient."""
    torch.manual_seed(0)
    for reuse, flags in zip((True, False), _all_flags(_WritesIntoAValue(), (torch.randn(3, 4),))):
        by_op = {}
        for op, flag in flags:
            by_op.setdefault(op, []).append(flag)
        assert by_op["aten.zeros_like.default"] == [(True,), (False,)], reuse  # written, kept


def _cases(kind: str) -> list:
    if kind == "zoo":
        from harmony_fx.testing.models import zoo

        cases = [(name, *entry.build(0)[:2], {}) for name, entry in zoo(batch=4).items()]
        torch.manual_seed(0)
        return cases + [("mixed", _Mixed(), (torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 3, 4).sign()), {})]
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    return [(name, build_hf_model(name), (), hf_batch(name, batch=2, seq=16))
            for name in ("gpt2", "bert", "llama", "t5", "mixtral", "gemma2")]


@pytest.mark.parametrize("kind", ["zoo", "hugging face"])
def test_calls_alike_take_the_flags_every_node_run_gives(kind):
    """Reusing the flags of calls alike changes no node's flags: the zoo, the mixed model above
    (an LSTM's tuple, no_grad, detach, a frozen layer, an integer result) and Hugging Face's
    GPT-2, BERT, Llama, T5 (which writes the shifted labels in place), Mixtral and Gemma 2."""
    for name, model, args, kwargs in _cases(kind):
        reused, ran = _all_flags(model, args, kwargs)
        assert reused == ran, name


class _InverseSTFT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("window", torch.hann_window(16), persistent=False)

    def forward(self, x):
        spectrum = torch.stft(self.linear(x), n_fft=16, hop_length=4, window=self.window, return_complex=True)
        return torch.istft(spectrum, n_fft=16, hop_length=4, window=self.window, length=64)


def test_an_op_that_reads_values_on_fake_tensors_is_refused_saying_so():
    """``istft`` checks its window's values, which a FakeTensor does not have: torch's own
    DataDependentOutputException came out of the compile, naming nothing of the model."""
    import harmony_fx

    with pytest.raises(ValueError, match=r"istft.*reads its input's values.*outside the model"):
        harmony_fx.compile(_InverseSTFT(), (torch.randn(4, 64),), devices=["host:0"])
