"""``compiler.heap``: a compile keeps the objects that were there before it out of the cyclic
collector's reach while it runs, and gives them back, on error paths too."""
from __future__ import annotations

import gc

import pytest
import torch

import harmony_fx
from harmony_fx.compiler import capture_cache
from harmony_fx.models import MLPChain


def _compile(**options):
    torch.manual_seed(0)
    return harmony_fx.compile(MLPChain(width=16, depth=4), (torch.randn(8, 16),), devices=["host:0"], **options)


def test_a_compile_freezes_the_heap_while_it_runs_and_gives_it_back(monkeypatch):
    seen = []
    capture = capture_cache.capture_variant
    monkeypatch.setattr(capture_cache, "capture_variant", lambda *args, **kwargs: seen.append(gc.get_freeze_count())
                        or capture(*args, **kwargs))
    _compile(microbatches=1)
    assert seen and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0
    with pytest.raises(harmony_fx.BudgetTooSmallError):
        _compile(microbatches=1, memory_budget=1)
    assert gc.get_freeze_count() == 0


def test_a_heap_the_caller_froze_stays_frozen():
    held = [[]]  # a tracked object the caller froze: unfrozen, it would be back in generation 2
    gc.freeze()
    try:
        _compile(microbatches=1)
        assert not any(o is held for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
    assert any(o is held for o in gc.get_objects(generation=2))  # what the check would see
