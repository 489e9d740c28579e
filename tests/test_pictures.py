"""``pictures``: the memory-over-time PNG and its refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx import api
from harmony_fx.models import MLPChain


def _module(**options):
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=3)
    x, target = torch.randn(8, 16), torch.randint(0, 10, (8,))
    return harmony_fx.compile(model, example_inputs=(x,), **options), x, target


def test_the_memory_plot_is_a_png_of_the_last_iteration(tmp_path):
    hm, x, target = _module()
    hm.record_timeline()
    F.cross_entropy(hm(x), target).backward()
    hm.plot_memory(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unrecorded_timeline_is_refused_before_anything_is_simulated(tmp_path, monkeypatch):
    def simulated(*args, **kwargs):
        raise AssertionError("simulated before the refusal")

    monkeypatch.setattr(api, "simulate_module", simulated)
    hm, x, target = _module()
    F.cross_entropy(hm(x), target).backward()
    with pytest.raises(ValueError, match="record_timeline"):
        hm.plot_memory(tmp_path / "memory.png")
    assert not (tmp_path / "memory.png").exists()
