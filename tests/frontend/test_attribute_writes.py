"""A forward's tensor attribute writes are said once, in harmony's words (``frontend.attribute_writes``)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import harmony_fx
from tests.helpers import assert_grads_equal


class _KeepsItsAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.calls, self.last_attn = 0, None

    def forward(self, x):
        self.calls += 1  # Python scratch state: not said
        attn = torch.softmax(self.inner(x), -1)
        self.last_attn = attn.detach()  # kept for a plot: the compiled model never assigns it
        self.inner.seen = x.sum()
        return attn.sum(-1)


def _warnings_of_compile(model: nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        harmony_fx.compile(model, torch.randn(2, 4), devices=["host:0"])
    return [str(warning.message) for warning in caught]


def test_a_tensor_the_forward_assigns_to_an_attribute_is_named_once_with_what_to_do():
    said = _warnings_of_compile(_KeepsItsAttention())
    ours = [message for message in said if "keeps a tensor in the attribute" in message]
    assert len(ours) == 1 and "inner.seen, last_attn at each call" in ours[0]
    assert "outputs" in ours[0]
    assert not [message for message in said if "assigned during export" in message]  # torch.export's, replaced


def test_a_forward_that_assigns_no_tensor_is_not_warned_about():
    model = _KeepsItsAttention()
    model.forward = lambda x: model.inner(x).sum(-1)
    assert not [message for message in _warnings_of_compile(model) if "keeps a tensor in the attribute" in message]


def test_a_weight_that_weight_norm_or_spectral_norm_computes_each_call_is_not_warned_about():
    """Their pre-hooks set module.weight from weight_g/weight_v (weight_orig) at every call: nothing
    is lost, and the warning said so twice a compile."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm's own deprecation
        model = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4)), nn.Tanh(),
                              torch.nn.utils.spectral_norm(nn.Linear(4, 4)))
    assert not [message for message in _warnings_of_compile(model) if "keeps a tensor in the attribute" in message]


def test_a_model_is_told_once_whatever_its_captures():
    model = _KeepsItsAttention()
    assert len([m for m in _warnings_of_compile(model) if "keeps a tensor in the attribute" in m]) == 1
    harmony_fx.reset()  # captured anew
    assert not [m for m in _warnings_of_compile(model) if "keeps a tensor in the attribute" in m]


class _CollectsItsFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.features, self.maps, self.sizes = [], {}, []

    def forward(self, x):
        h = self.a(x)
        self.features.append(h.detach())  # a feature extractor's: the compiled model appends nothing
        self.maps["a"] = (h, h.sum())
        self.sizes.append(x.shape[0])  # Python numbers: not said
        return self.b(h).sum(-1)


def test_a_tensor_the_forward_adds_to_a_list_or_dict_on_the_module_is_named():
    model = _CollectsItsFeatures()
    said = [message for message in _warnings_of_compile(model) if "keeps a tensor in the attribute" in message]
    assert len(said) == 1 and "features, maps at each call" in said[0]
    assert "_parameters" not in said[0] and "sizes" not in said[0]  # torch's own dicts, Python numbers
    assert model.features == [] and model.maps == {}  # as the compiled model leaves them: nothing kept


class _CountsItsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1  # a new tensor: torch.export drops the assignment in a submodule
        self.seen.add_(1)  # in place: kept, as BatchNorm's statistics are
        return self.inner(x)


def test_a_buffer_a_submodule_replaces_by_a_new_tensor_is_named_with_what_to_do():
    """Eager's buffer changes at each call; the compiled model's keeps its value (timm's ConViT
    replaces its ``rel_indices`` buffer; a step counter ``self.count = self.count + 1``)."""
    model, x = nn.Sequential(_CountsItsCalls(), nn.Tanh()), torch.randn(2, 4)
    said = _warnings_of_compile(model)
    ours = [message for message in said if "replaces its buffer" in message]
    assert len(ours) == 1 and "buffer 0.count by a new tensor" in ours[0] and "in place" in ours[0]
    harmony_fx.compile(model, x, devices=["host:0"])(x).sum().backward()
    assert model[0].seen.item() == 1 and model[0].count.item() == 0  # what the warning says


def test_a_buffer_the_graph_writes_all_the_same_is_not_warned_about():
    """The root module's assignment export keeps (a ``copy_`` into the buffer), and in-place writes."""
    model, x = _CountsItsCalls(), torch.randn(2, 4)
    assert not [message for message in _warnings_of_compile(model) if "replaces its buffer" in message]
    harmony_fx.compile(model, x, devices=["host:0"])(x).sum().backward()
    assert model.seen.item() == 1 and model.count.item() == 1
    batch_norm = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert not [message for message in _warnings_of_compile(batch_norm) if "replaces its buffer" in message]


class _ReadsATable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.table = {"scale": torch.tensor(2.0)}  # read, never written

    def forward(self, x):
        return self.inner(x) * self.table["scale"]


def test_a_dict_of_tensors_the_forward_only_reads_is_not_warned_about():
    """A dict's items are new tuples at each read: compared by key and value, not by the tuple (the
    backend keeps Dynamo's 0-dim float inputs, a LayerNorm's eps, in such a dict: every dynamic=True
    graph with one was warned about an attribute 'constants' the user never wrote)."""
    model = _ReadsATable()
    assert not [m for m in _warnings_of_compile(model) if "keeps a tensor in the attribute" in m]
    torch._dynamo.reset()
    compiled = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), backend="harmony", dynamic=True,
                             options={"devices": ["host:0"]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 8)).sum().backward()
    torch._dynamo.reset()
    assert not [w for w in caught if "keeps a tensor in the attribute" in str(w.message)]


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out).sum(-1)


def test_the_weights_list_a_recurrent_layer_remakes_each_call_is_not_warned_about():
    """nn.LSTM's forward remakes its ``_flat_weights`` list from the weights export swapped in: not a
    tensor the forward keeps (pytorch/examples' mnist_rnn and word_language_model were told to return it)."""
    said = _warnings_of_compile(_Recurrent())
    assert not [message for message in said if "keeps a tensor in the attribute" in message]


def test_a_list_of_activations_beside_a_recurrent_layer_is_still_named():
    class _KeepsItsStates(_Recurrent):
        def forward(self, x):
            out, _ = self.rnn(x)
            self.states = [out]
            return self.head(out).sum(-1)

    said = [message for message in _warnings_of_compile(_KeepsItsStates())
            if "keeps a tensor in the attribute" in message]
    assert len(said) == 1 and "states" in said[0] and "_flat_weights" not in said[0]


class _CachesItsBias(nn.Module):
    """x-transformers' AlibiPositionalBias: a buffer registered as None, filled on the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("slopes", torch.ones(1), persistent=False)
        self.register_buffer("bias", None, persistent=False)

    def forward(self, n: int) -> torch.Tensor:
        if self.bias is not None and self.bias.shape[-1] >= n:
            return self.bias[..., :n, :n]
        self.register_buffer("bias", (torch.arange(n)[:, None] - torch.arange(n)).abs() * self.slopes,
                             persistent=False)
        return self.bias


class _BiasedByACache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.pos = nn.Linear(4, 4), _CachesItsBias()

    def forward(self, x):
        self.lin.last = x.sum()  # an attribute the module did not have
        return self.lin(x) @ self.pos(x.shape[1])


def test_a_tensor_the_capture_sets_where_the_model_had_none_is_taken_back():
    """export puts back what it swapped, not a buffer the forward filled where it was None, nor an
    attribute it made: its FakeTensor stayed in the model, which then computed FakeTensors eagerly
    (and a compile again, at the budget a refusal named, captured it as the buffer's value)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    model, reference = _BiasedByACache(), _BiasedByACache()
    reference.load_state_dict(model.state_dict())
    reference(x).square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
            harmony_fx.compile(model, devices=["host:0"], memory_budget=1)(x)
        assert model.pos.bias is None and "last" not in model.lin.__dict__
        compiled = harmony_fx.compile(model, devices=["host:0"], memory_budget=refused.value.smallest_budget)
        loss = compiled(x).square().mean()
    loss.backward()
    assert type(loss) is torch.Tensor and model.pos.bias is None
    assert_grads_equal(model, reference)
    assert type(model(x)) is torch.Tensor  # the model, called eagerly after compiling
