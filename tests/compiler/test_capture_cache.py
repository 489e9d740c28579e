"""``compiler.capture_cache``: a compile of a model already captured in the same state takes a copy
of that capture; anything the graph bakes in that changed captures again. Each compile is checked
against eager (loss and every gradient), and captures are counted at ``capture_variant``."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.compiler import capture_cache
from harmony_fx.ir import meta
from tests.helpers import RTOL, ATOL, assert_grads_equal


class _Settings:
    """A plain object a module holds, as a Hugging Face config."""

    def __init__(self) -> None:
        self.activation = "relu"


class _Scaled(nn.Module):
    """Its forward reads a plain attribute, a setting of a held object and a tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)
        self.scale = 2.0
        self.settings = _Settings()
        self.offset = torch.zeros(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x) * self.scale + self.offset
        h = torch.relu(h) if self.settings.activation == "relu" else torch.tanh(h)
        return self.second(h)


@pytest.fixture
def captures(monkeypatch) -> list:
    """The calls of ``capture_variant`` (each a real capture) in this test."""
    calls: list = []
    real = capture_cache.capture_variant

    def counted(*args, **kwargs):
        calls.append(args[1])  # the microbatch size
        return real(*args, **kwargs)

    monkeypatch.setattr(capture_cache, "capture_variant", counted)
    return calls


def _batch(size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator)


def _assert_like_eager(model: nn.Module, hm, x: torch.Tensor, target: torch.Tensor) -> None:
    reference = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(hm(x), target)
    loss.backward()
    ref_loss = F.cross_entropy(reference(x), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_grads_equal(model, reference)


def _compile(model: nn.Module, x: torch.Tensor, **options):
    options = {"pack_boundaries": (0, 2), "microbatches": 1, **options}
    return harmony_fx.compile(model, (x,), devices=["host:0"], **options)


def test_a_second_compile_in_the_same_state_takes_the_capture_and_trains_like_eager(captures):
    model, (x, target) = _Scaled(), _batch()
    _compile(model, x)
    hm = _compile(model, x, pack_boundaries=(0, 1, 3))
    assert captures == [None]
    decision = next(stage.decision for stage in hm.passes if stage.name == "capture microbatches")
    assert "kept from an earlier compile" in decision
    _assert_like_eager(model, hm, x, target)


def test_two_compiles_of_one_capture_keep_their_own_packs(captures):
    """Passes annotate the graph of their compile: the second compile's packs must not be written
    on the first one's graph, which goes on running."""
    model, (x, target) = _Scaled(), _batch()
    first = _compile(model, x, pack_boundaries=(0, 2))
    second = _compile(model, x, pack_boundaries=(0, 1, 2, 3))
    assert captures == [None]
    first_graph, second_graph = (hm.compiled.variants[None].captured.gm for hm in (first, second))
    assert first_graph is not second_graph
    last = lambda gm: max(node.meta.get(meta.PACK, -1) for node in gm.graph.nodes)  # noqa: E731
    assert (last(first_graph), last(second_graph)) == (1, 3)
    _assert_like_eager(model, first, x, target)
    _assert_like_eager(model, second, x, target)


def _change_scale(model: nn.Module) -> None:
    model.scale = 3.0


def _change_setting(model: nn.Module) -> None:
    model.settings.activation = "tanh"


def _replace_tensor_attribute(model: nn.Module) -> None:
    model.offset = torch.ones(16)


def _add_hook(model: nn.Module) -> None:
    model.first.register_forward_hook(lambda module, inputs, output: output * 0.5)


def _replace_parameter(model: nn.Module) -> None:
    model.second.weight = nn.Parameter(torch.randn(4, 16))


def _eval(model: nn.Module) -> None:
    model.eval()


@pytest.mark.parametrize("change", [_change_scale, _change_setting, _replace_tensor_attribute, _add_hook,
                                    _replace_parameter, _eval])
def test_what_the_graph_bakes_in_changed_captures_again(captures, change):
    model, (x, target) = _Scaled(), _batch()
    _compile(model, x)
    change(model)
    hm = _compile(model, x)
    assert captures == [None, None]
    _assert_like_eager(model, hm, x, target)


class _Defaults:
    """Settings whose value is a class-level default, not in the instance's ``__dict__``."""

    scale = 2.0


class _Deep:
    def __init__(self, **values) -> None:
        self.__dict__.update(values)


class _ReadsFarOff(nn.Module):
    """Its forward reads settings ``attribute_facts`` does not reach: a class-level default of a held
    object, and a value five objects down."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)
        self.defaults = _Defaults()
        self.deep = _Deep(a=_Deep(b=_Deep(c=_Deep(scale=1.0))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x) * self.defaults.scale * self.deep.a.b.c.scale))


def _change_class_default(model: nn.Module) -> None:
    _Defaults.scale = 3.0


def _change_far_setting(model: nn.Module) -> None:
    model.deep.a.b.c.scale = -1.0


@pytest.mark.parametrize("change", [_change_class_default, _change_far_setting])
def test_a_value_read_beyond_the_keys_reach_captures_again(captures, change):
    """Before, ``CallKey`` saw the change and compiled again, but the capture kept for the old value
    was handed back: the new compile computed the old numbers, silently."""
    model, (x, target) = _ReadsFarOff(), _batch()
    hm = _compile(model, x)
    hm(x)
    try:
        change(model)
        _assert_like_eager(model, hm, x, target)
        assert captures == [None, None] and len(hm.variants) == 2
    finally:
        _Defaults.scale = 2.0


def test_a_tensor_attribute_changed_in_place_is_read_by_the_capture_kept(captures):
    """Export lifts a tensor attribute to a placeholder, read at every call: the capture is kept,
    and the values are the new ones."""
    model, (x, target) = _Scaled(), _batch()
    _compile(model, x)
    model.offset.add_(1.0)
    hm = _compile(model, x)
    assert captures == [None]
    _assert_like_eager(model, hm, x, target)


def test_another_batch_size_or_precision_captures_again(captures):
    model, (x, _) = _Scaled(), _batch()
    _compile(model, x)
    _compile(model, x[:4])
    _compile(model, x, precision="bf16")
    _compile(model, x)
    assert len(captures) == 3


def test_reset_forgets_the_captures(captures):
    model, (x, _) = _Scaled(), _batch()
    _compile(model, x)
    harmony_fx.reset()
    _compile(model, x)
    assert len(captures) == 2


def test_the_captures_kept_go_with_the_model():
    model, (x, _) = _Scaled(), _batch()
    hm = _compile(model, x)
    alive = weakref.ref(model)
    del model, hm
    gc.collect()
    assert alive() is None


def test_a_capture_kept_never_keeps_a_replaced_parameter_alive():
    """``load_state_dict(assign=True)`` replaces every parameter: the capture kept must not hold
    the old ones (a copy of the weights each time), and a compile after it captures again."""
    model, (x, target) = _Scaled(), _batch()
    _compile(model, x)
    old = weakref.ref(model.first.weight)
    model.load_state_dict({name: value.clone() for name, value in model.state_dict().items()}, assign=True)
    gc.collect()
    assert old() is None
    _assert_like_eager(model, _compile(model, x), x, target)


def test_a_capture_kept_runs_on_the_models_own_masters(captures):
    """The reused capture's parameters and buffers are the model's own objects, tied ones one object."""
    model, (x, target) = _Scaled(), _batch()
    model.register_buffer("unused", torch.zeros(1))
    first = _compile(model, x).compiled.variants[None].captured
    second = _compile(model, x).compiled.variants[None].captured
    assert captures == [None]
    assert list(second.params) == list(first.params) and list(second.buffers) == list(first.buffers)
    assert all(second.params[name] is first.params[name] for name in first.params)
    assert all(second.buffers[name] is first.buffers[name] for name in first.buffers)
