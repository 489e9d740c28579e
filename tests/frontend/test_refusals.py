"""``frontend.refusals``: constructs harmony_fx cannot run as eager would are refused at compile,
naming the model's line and saying what to do (they failed deep in planning before: a
``DynamicOutputShapeException``, a dispatch mode without rules for ``cond``, a sparse tensor's
missing storage)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony_fx


class _Repeated(nn.Module):
    """Rows repeated as often as a tensor says: no largest size (``passes.bound_sizes`` plans a
    boolean mask's selection at its largest)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, x, repeats):
        return self.linear(torch.repeat_interleave(x, repeats, dim=0)).sum()


class _Counted(nn.Module):
    """``bincount``: as many bins as the largest value says (no largest size planned for)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, ids):
        return self.linear(x).sum() * torch.bincount(ids).sum()


class _CountedPerExpert(nn.Module):
    """``bincount`` with ``minlength``, its size fixed by a later broadcast (a mixture of experts'
    tokens per expert): export knows the size, the planning run on FakeTensors does not (it failed
    there, blaming a custom op)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x, ids):
        logits = self.gate(x)
        counts = torch.bincount(logits.argmax(-1), minlength=4).float()
        return (counts / counts.sum() * logits.softmax(-1).mean(0)).sum()


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        return torch.cond(h.sum() > 0, lambda t: t.relu(), lambda t: t.tanh(), (h,))


class _SparseValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x).to_sparse()


class _SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8, sparse=True)
        self.linear = nn.Linear(8, 2)

    def forward(self, ids):
        return self.linear(self.embedding(ids))


class _RenormedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8, max_norm=1.0)
        self.linear = nn.Linear(8, 2)

    def forward(self, ids):
        return self.linear(self.embedding(ids))


class _CountsInPython(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        hidden = self.linear(x)
        positive = (hidden > 0).sum().tolist()
        return hidden * positive


class _ClipsUnderNoGrad(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.what = what

    def forward(self, x):
        with torch.no_grad():
            (x if self.what == "input" else self.linear.weight).clamp_(-0.5, 0.5)
        return self.linear(x * 2)


@pytest.mark.parametrize("what,says", [("input", r"modifies its input 'x' in place"),
                                       ("parameter", r"modifies its parameter 'linear\.weight' in place")])
def test_a_write_inside_no_grad_is_refused_as_one_outside(what, says):
    """Inside ``torch.no_grad()`` export puts the write in a region of its own, which the refusal did
    not look into: the caller's tensor kept its old values, silently. The refusal names the model's
    line that writes, not the region (RWKV's weights rescaled in eval named no line)."""
    with pytest.raises(ValueError, match=says) as refused:
        harmony_fx.compile(_ClipsUnderNoGrad(what), (torch.randn(4, 8),), devices=["host:0"])
    assert ".clamp_(-0.5, 0.5)" in str(refused.value)


@pytest.mark.parametrize("model,inputs,says,line", [
    (_Repeated, lambda: (torch.randn(4, 8), torch.tensor([1, 3, 0, 2])), r"size depends on its values \(repeat_interleave\), "
     r"with no largest.*torch\.where", "torch.repeat_interleave(x, repeats, dim=0)"),
    (_Counted, lambda: (torch.randn(4, 8), torch.tensor([0, 3, 3])), r"size depends on its values \(bincount\).*one_hot", "torch.bincount(ids)"),
    (_CountedPerExpert, lambda: (torch.randn(4, 8), None), r"depends on its values \(bincount\).*F\.one_hot\(ids, n\)\.sum\(0\)",
     "counts = torch.bincount(logits.argmax(-1), minlength=4).float()"),
    (_Branches, lambda: (torch.randn(4, 8),), r"runs torch\.cond.*torch\.where", "return torch.cond("),
    (_SparseEmbedding, lambda: (torch.randint(0, 20, (4, 5)),), r"sparse gradients.*sparse=False",
     "self.linear(self.embedding(ids))"),
    (_SparseValue, lambda: (torch.randn(4, 8),), r"makes a sparse tensor \(to_sparse\).*dense",
     "self.linear(x).to_sparse()"),
    (_RenormedEmbedding, lambda: (torch.randint(0, 20, (4, 5)),), r"parameter 'embedding\.weight' in place.*"
     r"max_norm.*outside the forward", "self.linear(self.embedding(ids))"),
    (_CountsInPython, lambda: (torch.randn(4, 8),), r"reads a tensor's value into Python.*Keep it a tensor",
     "positive = (hidden > 0).sum().tolist()"),
], ids=["unbounded size", "bincount", "bincount of a fixed size", "torch.cond", "sparse gradients", "a sparse value", "a parameter written", "a value read"])
def test_a_construct_harmony_cannot_run_is_refused_naming_the_line(model, inputs, says, line):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=says) as refused:
        harmony_fx.compile(model(), inputs(), devices=["host:0"], microbatches=1)
    assert line in str(refused.value)


class _PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.lstm, self.last = nn.Linear(8, 12), nn.LSTM(12, 10, batch_first=True), nn.Linear(10, 4)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(torch.tanh(self.first(x)), lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, _ = self.lstm(packed)
        return self.last(nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0])


def test_an_rnn_given_a_packed_sequence_is_refused_saying_what_to_do_instead():
    """Export stops inside torch's LSTM; the advice was about control flow and caches."""
    with pytest.raises(harmony_fx.CaptureError, match=r"PackedSequence .* mask the padding .*allow_rnn = True"):
        harmony_fx.compile(_PackedLSTM(), (torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2])), devices=["host:0"])


class _Float32Head(nn.Module):
    """A bfloat16 body and a head the model casts to float32 itself (sweep ss)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).float())


def test_a_float32_value_meeting_bfloat16_weights_is_refused_at_compile():
    """Under precision="bf16" the head's weight is bfloat16 and its input the model's float32:
    FakeTensors take the linear on shapes, and the first call raised torch's 'mat1 and mat2 must
    have the same dtype' from inside a pack, naming no line. Under autocast the same model runs
    (autocast casts as each pack runs)."""
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"the model's linear at 'return self\.head\(torch\.tanh\(self\.body\(x\)\)"
                                         r"\.float\(\)\)'.*takes torch\.float32 and torch\.bfloat16 tensors.*"
                                         r"torch\.autocast instead of precision='bf16'"):
        harmony_fx.compile(_Float32Head(), (x,), precision="bf16", devices=["host:0"], microbatches=1)
    model = _Float32Head()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = harmony_fx.compile(model, (x,), devices=["host:0"], microbatches=1)(x)
        expected = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class _RegistersItsCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("bias", None, persistent=False)

    def forward(self, x):
        if self.bias is None or self.bias.shape[0] < x.shape[1]:
            self.register_buffer("bias", torch.arange(x.shape[1], dtype=x.dtype), persistent=False)
        return self.linear(x) + self.bias[: x.shape[1]]


def test_a_buffer_the_root_module_registers_in_its_forward_is_named_as_such():
    """torch.export records it as a copy into the model's input: the refusal said the model modifies
    its input 'x' in place, which it does not (sweep rr)."""
    with pytest.raises(ValueError, match=r"the model registers a buffer in its forward, at 'self\.register_buffer"):
        harmony_fx.compile(_RegistersItsCache(), (torch.randn(4, 8),), devices=["host:0"], microbatches=1)
