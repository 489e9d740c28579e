"""``frontend.refusals``: constructs harmony_fx cannot run as eager would are refused at compile,
naming the model's line and saying what to do (they failed deep in planning before: a
``DynamicOutputShapeException``, a dispatch mode without rules for ``cond``, a sparse tensor's
missing storage)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx


class _SelectedLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, x, labels):
        logits = self.linear(x)
        kept = labels != -100
        return F.cross_entropy(logits[kept], labels[kept])


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        return torch.cond(h.sum() > 0, lambda t: t.relu(), lambda t: t.tanh(), (h,))


class _SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8, sparse=True)
        self.linear = nn.Linear(8, 2)

    def forward(self, ids):
        return self.linear(self.embedding(ids))


def _labels() -> torch.Tensor:
    labels = torch.randint(0, 5, (16,))
    labels[::3] = -100
    return labels


@pytest.mark.parametrize("model,inputs,says,line", [
    (_SelectedLoss, lambda: (torch.randn(16, 8), _labels()), r"size depends on its values.*ignore_index=-100",
     "F.cross_entropy(logits[kept], labels[kept])"),
    (_Branches, lambda: (torch.randn(4, 8),), r"runs torch\.cond.*torch\.where", "return torch.cond("),
    (_SparseEmbedding, lambda: (torch.randint(0, 20, (4, 5)),), r"sparse gradients.*sparse=False",
     "self.linear(self.embedding(ids))"),
], ids=["data-dependent size", "torch.cond", "sparse gradients"])
def test_a_construct_harmony_cannot_run_is_refused_naming_the_line(model, inputs, says, line):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=says) as refused:
        harmony_fx.compile(model(), inputs(), devices=["host:0"], microbatches=1)
    assert line in str(refused.value)


def test_the_same_loss_with_ignore_index_trains_like_eager():
    """What the refusal of the selected loss says to do."""
    import copy

    torch.manual_seed(0)
    model, x, labels = _SelectedLoss(), torch.randn(16, 8), _labels()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model.linear, (x,), devices=["host:0"], microbatches=2)
    F.cross_entropy(hm(x), labels, ignore_index=-100).backward()
    reference(x, labels).backward()
    torch.testing.assert_close(model.linear.weight.grad, reference.linear.weight.grad)
