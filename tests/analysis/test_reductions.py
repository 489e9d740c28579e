"""``analysis.reductions.scalar_reduction``: how a scalar output reduces the batch, read from the
captured graph (the weights a microbatched run puts it back together with are tested end to end in
tests/frontend/test_microbatch.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from harmony_fx.analysis.reductions import Combine, scalar_reduction
from harmony_fx.frontend.capture import capture


class Loss(nn.Module):
    """A linear layer, then ``loss(output, target)``."""

    def __init__(self, loss) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(self.linear(x), target)


def _reduction(loss, target: torch.Tensor):
    torch.manual_seed(0)
    captured = capture(Loss(loss), (torch.randn(6, 4), target))
    gm = captured.gm
    (output,) = [n for n in gm.graph.find_nodes(op="output")[0].args[0] if isinstance(n, fx.Node)]
    return scalar_reduction(gm, output), [n.name for n in gm.graph.find_nodes(op="placeholder")]


def test_a_mean_over_every_element_weighs_by_the_element_count() -> None:
    reduction, _ = _reduction(F.mse_loss, torch.randn(6, 3))
    assert reduction.combine == Combine.MEAN and reduction.count({}) == 18


def test_a_sum_adds_and_a_sum_over_the_batch_size_is_a_mean_over_samples() -> None:
    summed, _ = _reduction(lambda out, target: (out - target).pow(2).sum(), torch.randn(6, 3))
    assert summed.combine == Combine.SUM and summed.divisor is None
    per_sample, _ = _reduction(lambda out, target: (out - target).pow(2).sum() / out.shape[0], torch.randn(6, 3))
    assert per_sample.combine == Combine.SUM and per_sample.divisor == 6


def test_a_cross_entropy_counts_the_labels_that_are_not_ignored() -> None:
    labels = torch.tensor([0, 1, -100, 2, -100, 1])
    reduction, placeholders = _reduction(lambda out, target: F.cross_entropy(out, target), labels)
    assert reduction.combine == Combine.MEAN and "target" in placeholders
    assert reduction.count({"target": labels}) == 4  # counted from the microbatch's inputs alone
    assert reduction.count({"target": torch.tensor([-100, 0])}) == 1


class WeighedClasses(nn.Module):
    """A cross entropy whose classes weigh as its buffer says, ignoring the label -100."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 4.0]))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target, weight=self.class_weight, label_smoothing=0.1)


def test_a_cross_entropy_weighing_its_classes_counts_the_weights_of_the_labels_kept() -> None:
    """torch divides by the summed weights of the labels it keeps: a microbatch counts its own,
    read from the buffer as it is when counted (changed in place after the capture, counted anew)."""
    torch.manual_seed(0)
    model, labels = Loss(WeighedClasses()), torch.tensor([0, 1, -100, 2, 2, 1])
    captured = capture(model, (torch.randn(6, 4), labels))
    (output,) = [n for n in captured.gm.graph.find_nodes(op="output")[0].args[0] if isinstance(n, fx.Node)]
    reduction = captured.reductions[output.name]
    assert reduction.combine == Combine.MEAN
    assert reduction.count({"target": labels}) == 1 + 2 + 4 + 4 + 2
    assert reduction.count({"target": torch.tensor([-100, -100])}) == 0
    model.loss.class_weight.mul_(2)
    assert reduction.count({"target": torch.tensor([2, 0])}) == 10


@pytest.mark.parametrize("loss, why", [
    (lambda out, target: (out - target).sum() + (out - target).pow(2).mean(), "weigh differently"),
    (lambda out, target: F.cross_entropy(out, target.argmax(-1), weight=1.0 / (1.0 + target.sum(0))),
     "computed from the batch"),
])
def test_what_cannot_be_put_back_together_says_why(loss, why) -> None:
    reduction, _ = _reduction(loss, torch.randn(6, 3))
    assert reduction.combine is None and why in reduction.why


_ROW = torch.ones(1, 3)  # a constant the loss expands to the batch's size


def _masked_mean(out, target):
    """A mean over a random half of the elements, as ViTMAE's loss: the mask is made inside the
    model at the size of the batch the capture saw."""
    mask = (torch.rand(out.shape[0], 3) > 0.5).float()
    return ((out - target).pow(2) * mask).sum() / mask.sum()


@pytest.mark.parametrize("loss, why", [
    (_masked_mean, "divides by a number computed from rand"),
    (lambda out, target: (out - target).pow(2).mean() + 0.1 * torch.rand(out.shape[0]).sum(), "rand"),
    (lambda out, target: (out - target).pow(2).mean() + _ROW.expand(out.shape[0], 3).sum(), "expand"),
])
def test_a_tensor_made_inside_the_model_at_the_batchs_size_is_not_taken_for_a_constant(loss, why) -> None:
    """Made from no input (or from a constant, expanded), it still has the size of the batch the
    capture saw: dividing by it (or adding it) is not a number every microbatch shares."""
    reduction, _ = _reduction(loss, torch.randn(6, 3))
    assert reduction.combine is None and "a tensor made inside the model" in reduction.why and why in reduction.why


def test_a_number_made_without_any_size_stays_a_constant() -> None:
    reduction, _ = _reduction(lambda out, target: (out - target).pow(2).mean() / torch.tensor(2.0)
                              + torch.ones(()) * 0.5, torch.randn(6, 3))
    assert reduction.combine == Combine.LINEAR and reduction.shared


def test_a_sum_begun_at_zero_adds_nothing_shared() -> None:
    """``aux = 0; aux = aux + term`` (a MoE router's loss summed over layers) is the term alone: the 0
    was taken for a constant every microbatch adds, and a cut by hand was refused."""
    reduction, _ = _reduction(lambda out, target: 0 + (out - target).pow(2).mean() - 0, torch.randn(6, 3))
    assert reduction.combine == Combine.MEAN and reduction.count({}) == 18


def test_a_linear_combination_of_means_keeps_its_terms() -> None:
    reduction, _ = _reduction(lambda out, target: (out - target).pow(2).mean() + 0.5 * out.abs().mean(),
                              torch.randn(6, 3))
    assert reduction.combine == Combine.LINEAR
    assert [term.combine for term in reduction.terms] == [Combine.MEAN, Combine.MEAN] and not reduction.shared


def test_a_cross_entropy_against_class_probabilities_is_a_mean_over_samples() -> None:
    """Soft targets (distillation) are no labels to count: the class weights were indexed by them."""
    weight = torch.tensor([1.0, 2.0, 4.0])
    reduction, _ = _reduction(lambda out, target: F.cross_entropy(out, target, weight=weight),
                              torch.randn(6, 3).softmax(-1))
    assert reduction.combine == Combine.MEAN and reduction.labels is None and reduction.count({}) == 18


def test_a_mean_over_labels_beside_another_mean_is_cut_only_by_hand() -> None:
    """The two weigh the microbatches alike only while the ignored labels spread evenly: the
    planner keeps such a batch whole (it cut it, then a later batch raised)."""
    from harmony_fx.analysis.batch_dims import analyze_batch_dims

    torch.manual_seed(0)
    for loss, cut in ((lambda out, target: F.cross_entropy(out, target) + 0.01 * out.pow(2).mean(), False),
                      (lambda out, target: F.cross_entropy(out, target) + 0.5 * F.nll_loss(out, target), True),
                      # each term reshaping the labels itself (a deeply supervised model's heads): the same labels
                      (lambda out, target: F.cross_entropy(out.view(-1, 3), target.view(-1))
                       + 0.5 * F.cross_entropy(out.reshape(-1, 3), target.reshape(-1)), True)):
        captured = capture(Loss(loss), (torch.randn(6, 4), torch.tensor([0, 1, -100, 2, 1, 0])))
        analysis = analyze_batch_dims(captured.gm, dict.fromkeys(captured.inputs, 0), 6, captured.reductions)
        assert analysis.separable == cut, analysis.reason
        if not cut:
            assert "mean over labelled items" in analysis.reason


def test_labels_made_with_a_constant_are_counted_from_the_inputs_and_the_constant() -> None:
    """``target[target < 0] = -100`` reads a constant export lifts to a placeholder: the labels were
    refused as "computed from the model's parameters or buffers ['c_lifted_tensor_0']"."""

    def loss(out, target):
        target = target.clone()
        target[target < 0] = -100
        return F.cross_entropy(out, target)

    torch.manual_seed(0)
    labels = torch.tensor([0, 1, -1, 2, -3, 1])
    captured = capture(Loss(loss), (torch.randn(6, 4), labels))
    (reduction,) = captured.reductions.values()
    assert reduction.combine == Combine.MEAN
    assert reduction.count({"target": labels}) == 4


def test_a_tensor_made_at_the_batchs_size_and_written_with_the_batch_is_a_mean_over_its_elements() -> None:
    """``z = torch.zeros(B, 5); z[:, :3] = out``: the mean read ``z``, whose inputs the write adds;
    it was refused as a number computed from a tensor made inside the model."""

    def loss(out, target):
        padded = torch.zeros(out.shape[0], 5)
        padded[:, :3] = out - target
        return padded.pow(2).mean()

    reduction, _ = _reduction(loss, torch.randn(6, 3))
    assert reduction.combine == Combine.MEAN and reduction.count({}) == 30


def _scaled_in_place(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(out, target)
    loss *= 3  # as transformers' Trainer.compute_loss ends: loss *= num_processes
    return loss


def test_a_mean_scaled_in_place_by_a_number_is_that_mean_scaled() -> None:
    """``mul_`` by a number was not read: the output was 'one number per microbatch' that harmony could not put
    back together, and a Trainer's microbatches were averaged by size (a loss over num_items_in_batch a third
    of eager's, over 3 microbatches)."""
    reduction, _ = _reduction(_scaled_in_place, torch.randn(6, 3))
    assert reduction.combine == Combine.MEAN and reduction.scale == 3 and reduction.count({}) == 18


def _chunked_cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torchtune's ``CEWithChunkedOutputLoss``: sums of cross entropies added with ``+=``, over the
    count of labels that are not ignored."""
    total_elements = (target != -100).sum()
    total = 0.0
    for logits, labels in zip(out.chunk(2, dim=1), target.chunk(2, dim=1)):  # along the sequence
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum")
    return total / total_elements


def test_sums_over_the_count_of_labels_kept_are_a_mean_over_those_labels() -> None:
    """It was 'one number per microbatch' harmony could not put back together: the planner kept the
    batch whole, and a cut by hand weighed microbatches by size (a microbatch with no label: NaN)."""
    labels = torch.tensor([0, 1, -100, 2, -100, 1])
    reduction, _ = _reduction(lambda out, target: _chunked_cross_entropy(out[:, None], target[:, None]), labels)
    assert reduction.combine == Combine.MEAN
    assert reduction.count({"target": labels}) == 4 and reduction.count({"target": torch.tensor([-100, -100])}) == 0


@pytest.mark.filterwarnings("error::harmony_fx.MicrobatchesComputeApart")
def test_sums_over_the_count_of_labels_kept_train_as_eager_in_microbatches() -> None:
    import copy

    import harmony_fx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    eager = copy.deepcopy(model)
    x = torch.randn(4, 2, 4)  # [batch, sequence, features]
    for labels in (torch.tensor([[0, 1], [-100, 2], [-100, -100], [1, 1]]),
                   torch.tensor([[0, 1], [2, -100], [-100, -100], [-100, -100]])):  # a microbatch with no label
        trainer = harmony_fx.Trainer(model, _chunked_cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                                     (x, labels), microbatches=2, devices=["host:0"])
        optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
        loss = trainer.step((x, labels))
        optimizer.zero_grad()
        expected = _chunked_cross_entropy(eager(x), labels)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(torch.as_tensor(float(loss)), expected.detach())
        for ours, theirs in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(ours, theirs)
