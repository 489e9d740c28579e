"""A model that returns a key/value cache by default (Hugging Face's ``use_cache=True``) compiles
with the cache off, trains as eager does, and gets its config back as it was."""
from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.frontend.capture import CaptureError
from harmony_fx.frontend.key_value_caches import key_value_caches_off
from tests.helpers import assert_grads_equal


class TinyCache:
    """A cache as transformers' are: an object holding tensors, no pytree node."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class _Cached(nn.Module):
    """Returns a cache object (not a tensor, not a pytree) beside its output where its config asks."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.linear = nn.Linear(4, 4)

    def forward(self, x, use_cache=None):
        y = self.linear(x)
        cache = TinyCache(y) if (self.config.use_cache if use_cache is None else use_cache) else None
        return {"y": y, "cache": cache} if cache is not None else {"y": y}


def test_every_distinct_config_that_caches_is_off_within_and_put_back_after():
    shared, own, off = (types.SimpleNamespace(use_cache=value) for value in (True, True, False))
    model = nn.Sequential(_Cached(shared), _Cached(shared), _Cached(own), _Cached(off))
    with key_value_caches_off(model, {}) as turned_off:
        assert turned_off
        assert [m.config.use_cache for m in model] == [False, False, False, False]
    assert [m.config.use_cache for m in model] == [True, True, True, False]
    with key_value_caches_off(model, {"use_cache": True}) as turned_off:  # the caller chose: left alone
        assert not turned_off and own.use_cache


def test_the_configs_are_put_back_when_capturing_fails():
    config = types.SimpleNamespace(use_cache=True)
    model = _Cached(config)
    with pytest.raises(RuntimeError, match="failed"), key_value_caches_off(model, {}):
        raise RuntimeError("capture failed")
    assert config.use_cache is True


def test_a_model_returning_its_cache_by_default_compiles_without_it_and_trains_as_eager():
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    model = build_hf_model("gpt2")
    model.config.use_cache = True  # transformers' default: every forward returns a DynamicCache
    reference = copy.deepcopy(model)
    batch = hf_batch("gpt2")
    assert reference(**batch).past_key_values is not None

    compiled = harmony_fx.compile(model, (), example_kwargs=batch, devices=["host:0"], microbatches=2)
    out = compiled(**batch)
    out.loss.backward()
    expected = reference(**batch)
    expected.loss.backward()

    assert model.config.use_cache is True  # put back
    assert getattr(out, "past_key_values", None) is None
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    assert_grads_equal(model, reference, rtol=1e-4, atol=1e-6)
    capture = next(stage for stage in compiled.passes if stage.name == "capture microbatches")
    assert "key/value cache off" in capture.decision


def test_a_call_asking_for_the_cache_is_refused_with_what_to_do():
    model = _Cached(types.SimpleNamespace(use_cache=False))
    with pytest.raises(CaptureError, match="use_cache=False"):
        harmony_fx.compile(model, (torch.randn(2, 4),), {"use_cache": True}, devices=["host:0"])


def test_a_call_passing_a_cache_in_is_refused_saying_to_decode_with_the_model():
    """A decode step (the previous step's cache as ``past_key_values``) got the advice about
    control flow on values, which says nothing of the cache."""
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from harmony_fx.testing.hf_models import build_hf_model

    model = build_hf_model("gpt2").eval()
    ids = torch.randint(0, 100, (1, 4))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    assert isinstance(cache, DynamicCache)
    with torch.no_grad(), pytest.raises(CaptureError, match="passes a key/value cache.*decode with the model itself"):
        harmony_fx.compile(model, (), {"input_ids": ids[:, -1:], "past_key_values": cache}, devices=["host:0"])
