"""``compiler.variants.check_computes_alike``: a microbatch's graph computes what the whole batch's
does, or the cut is refused (a planner's falls back to the batch whole)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.compiler.variants import capture_variant, check_computes_alike


class _ReadsItsBatchSize(nn.Module):
    """Computes with its batch size: as a branch, or as a value."""

    def __init__(self, as_value: bool) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 4)
        self.as_value = as_value

    def forward(self, x, y):
        h = torch.tanh(self.first(x))
        if self.as_value:
            h = h * x.shape[0]
        elif x.shape[0] > 4:
            h = h * 2
        return F.mse_loss(self.second(h), y)


@pytest.mark.parametrize("as_value", [False, True], ids=["branch", "value"])
def test_a_planner_cut_of_a_model_reading_its_batch_size_falls_back_to_the_batch_whole(as_value):
    """The planner cut the batch into microbatches, each computing with its own size: the loss
    and every gradient were off (0.62 against 0.96), silently."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    model = _ReadsItsBatchSize(as_value)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x, y), devices=["host:0"], memory_budget=4096)
    names = [stage.name for stage in hm.passes]
    assert hm.num_microbatches == 1 and "fall back" in names, names
    loss, expected = hm(x, y), reference(x, y)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)


def test_hugging_face_models_compute_alike_at_every_microbatch_size():
    """Export drops a ``contiguous`` on a size-1 dim (GPT-2, Llama): not a difference in what is computed."""
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    for name in ("gpt2", "llama"):
        model, batch = build_hf_model(name), hf_batch(name, batch=4)
        whole = capture_variant(model, None, (), batch, torch.device("cpu"))
        for size in (1, 2):
            part = capture_variant(model, size, (), {k: v[:size] for k, v in batch.items()}, torch.device("cpu"))
            check_computes_alike(whole, part, 4)


def test_a_number_that_differs_on_the_samples_is_named():
    torch.manual_seed(0)
    model = _ReadsItsBatchSize(as_value=True)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    whole = capture_variant(model, None, (x, y), {}, torch.device("cpu"))
    part = capture_variant(model, 4, (x[:4], y[:4]), {}, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"with the number 8 on the whole batch of 8 and 4 on a microbatch of 4"):
        check_computes_alike(whole, part, 8)


class _WritesIntoACopy(nn.Module):
    """``contiguous()`` copies a transposed batch of two or more samples; of one, it is the tensor
    itself (export drops it), and the in-place ReLU then writes ``h``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(12, 12), nn.Linear(12, 16)

    def forward(self, x):
        h = self.first(x)
        t = h.transpose(0, 1).contiguous()
        t.relu_()
        return self.second(h) + t.sum(0, keepdim=True).t()


def test_a_microbatch_of_one_whose_graph_drops_a_copy_written_into_is_refused():
    """A batch of 3 in microbatches of 2 and 1: the one-sample microbatch wrote h through the
    dropped copy (gradients off by 2), silently."""
    with pytest.raises(ValueError, match=r"microbatch of 1 sample.*drops 'contiguous'.*at least 2 samples"):
        harmony_fx.compile(_WritesIntoACopy(), (torch.randn(3, 12),), devices=["host:0"], microbatches=2)
    harmony_fx.compile(_WritesIntoACopy(), (torch.randn(4, 12),), devices=["host:0"], microbatches=2)  # 2 and 2


class _PerSampleList(nn.Module):
    """Returns a list with one tensor per sample (Llava's ``image_outputs.pooler_output``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        return {"loss": self.second(h).pow(2).mean(), "per_sample": list(h.unbind(0)), "hidden": h}


def test_an_output_list_as_long_as_the_batch_is_refused_for_what_it_is():
    """A cut by hand of a model returning one tensor per sample: the two graphs return 6 and 4
    values, so pairing them by position compared other outputs, and the refusal spoke of squeeze()
    and expand; it says what differs, and the planner keeps such a batch whole."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8)
    with pytest.warns(harmony_fx.MicrobatchesComputeApart), \
            pytest.raises(ValueError, match=r"returns 6 values on the whole batch of 4 and 4 on a microbatch of 2"):
        harmony_fx.compile(_PerSampleList(), (x,), devices=["host:0"], microbatches=2)
    model = _PerSampleList()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x,), devices=["host:0"])
    assert hm.num_microbatches == 1
    out, expected = hm(x), reference(x)
    assert len(out["per_sample"]) == 4
    out["loss"].backward()
    expected["loss"].backward()
    torch.testing.assert_close(out["loss"], expected["loss"])
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad)


class _Contrastive(nn.Module):
    """CLIP's shape: every image against every text, ``[B, B]`` logits and a loss over them."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, y):
        logits = self.image(x) @ self.text(y).T
        return {"loss": F.cross_entropy(logits, torch.arange(x.shape[0])), "logits_per_image": logits}


def test_an_output_pairing_every_sample_with_every_other_is_refused_by_its_name():
    """The refusal spoke of "output 1 (t_1)" and of squeeze() and expand for CLIP's logits."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.warns(harmony_fx.MicrobatchesComputeApart), pytest.raises(
            ValueError, match=r"output\['logits_per_image'\] \(matmul\) is \[4, 4\] .* pairs every sample with every other"):
        harmony_fx.compile(_Contrastive(), (x, y), devices=["host:0"], microbatches=2)


class _ReturnsWhatTheBatchDoesNotGrow(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        h = self.layers(x)
        return h, h.mean(0) if self.what == "mean" else self.layers[0].weight[:2] * 1


@pytest.mark.parametrize("what, says", [
    ("mean", r"output\[1\] \(mean\) is \[8\] on the whole batch of 4 and \[8\] on a microbatch of 2: it does not "
             r"grow with the batch"),
    ("parameter", r"the output mul does not depend on the batch: every microbatch would compute it whole \(a "
                  r"parameter's slice"),
])
def test_an_output_that_does_not_grow_with_the_batch_is_refused_where_a_cut_would_join_it(what, says):
    """A cut by hand warned that results may differ, then joined the microbatches' [8] column means
    along dim 0: [16] where eager returns [8] (sweep tt). The planner keeps such a batch whole."""
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=says):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", harmony_fx.MicrobatchesComputeApart)
            harmony_fx.compile(_ReturnsWhatTheBatchDoesNotGrow(what), (x,), devices=["host:0"], microbatches=2)
    model = _ReturnsWhatTheBatchDoesNotGrow(what)
    out, expected = harmony_fx.compile(model, (x,), devices=["host:0"])(x), model(x)
    assert [o.shape for o in out] == [e.shape for e in expected]
    torch.testing.assert_close(out, expected)
