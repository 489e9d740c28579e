"""``bound_sizes``: a size that depends on the values (``x[mask]``, ``nonzero``, ``masked_select``,
``unique``) is planned at its largest; the model then trains as eager does, at the smallest budget the
refusal names, the device never holding more than it."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.frontend.capture import capture
from harmony_fx.ir import meta


class _SelectedLoss(nn.Module):
    """A loss over the labelled rows only, selected with a mask (as scripts write it)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, x, labels):
        logits = self.head(torch.relu(self.hidden(x)))
        kept = labels != -100
        return F.cross_entropy(logits[kept], labels[kept])


class _SelectedRows(nn.Module):
    """Rows chosen by their values in the middle of the model, through layers of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.last = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.first(x))
        chosen = h[h.sum(-1) > 0]
        return self.last(torch.relu(self.second(chosen))).sum() + h.sum()


class _NonzeroAndMaskedSelect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        rows = torch.nonzero(h[:, 0] > 0).squeeze(1)
        return self.second(h.index_select(0, rows)).square().sum() + torch.masked_select(h, h > 0.5).sum()


class _Unique(nn.Module):
    """Distinct values and how often each occurs, fed on through a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(8, 64), nn.Linear(1, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = self.first(x)
        values, counts = torch.unique((h > 0).sum(-1), return_counts=True)
        return self.third(self.second((values * counts).unsqueeze(-1).float())).square().sum() + h.sum()


def _inputs():
    torch.manual_seed(0)
    x, labels = torch.randn(16, 8), torch.randint(0, 5, (16,))
    labels[::3] = -100
    return x, labels


def test_a_selected_value_is_planned_at_its_largest():
    x, labels = _inputs()
    captured = capture(_SelectedLoss(), (x, labels))
    selected = [node for node in captured.gm.graph.nodes if node.meta.get(meta.BOUNDED)]
    shapes = {tuple(node.meta[meta.VAL].shape) for node in selected if isinstance(node.meta[meta.VAL], torch.Tensor)}
    assert {(16, 5), (16,)} <= shapes  # every one of the 16 rows, the largest the mask can select


# None: the planner's choice, the whole batch (cut, these would mix samples: ``x[mask]`` along the batch)
@pytest.mark.parametrize("microbatches", [1, None])
@pytest.mark.parametrize("model", [_SelectedLoss, _SelectedRows, _NonzeroAndMaskedSelect, _Unique],
                         ids=["selected-loss", "selected-rows", "nonzero-masked-select", "unique"])
def test_values_of_data_dependent_size_train_like_eager_within_the_budget(model, microbatches, memory_witness):
    x, labels = _inputs()
    inputs = (x, labels) if model is _SelectedLoss else (x,)
    torch.manual_seed(0)
    module = model()
    reference = copy.deepcopy(module)
    options = dict(devices=["host:0"], microbatches=microbatches)
    if model is _Unique:  # its fewest packs fit its smallest budget: cut it, so the values cross packs
        options["pack_boundaries"] = (0, 7, 14)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        harmony_fx.compile(module, inputs, memory_budget=1, **options)
    budget = refused.value.smallest_budget
    hm = harmony_fx.compile(module, inputs, memory_budget=budget, **options)
    assert len(hm.packs) > 1
    for _ in range(2):
        loss, expected = hm(*inputs), reference(*inputs)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for param, eager in zip(module.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, eager.grad)
        assert memory_witness.peak_of(hm.devices[0]) == hm.stats.peak_bytes[hm.devices[0].name] <= budget


class _Combinations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale, self.linear = nn.Parameter(torch.tensor(1.5)), nn.Linear(1, 1)

    def forward(self, x):
        return self.linear(torch.combinations(x * self.scale, r=1))  # masked_select inside: no bound but 2**63 - 2


def test_a_size_whose_only_bound_is_torchs_default_for_sizes_is_refused_in_words():
    """It was planned at 2**63 - 2 rows: a raw autograd shape mismatch inside planning."""
    with pytest.raises(ValueError, match=r"makes a tensor whose size depends on its values \(combinations\), with no "
                                         r"largest size"):
        harmony_fx.compile(_Combinations(), (torch.randn(2).requires_grad_(),), devices=["host:0"])
