"""ir.values: FakeTensors made without the mode's dispatch are what the mode's ops make."""
from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import FakeTensor

from harmony_fx.ir.tracking import AllocationTracker, storage_key
from harmony_fx.ir.values import alias_fake, empty_fake


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t._base is None


@pytest.mark.parametrize("shape, stride, offset", [((4, 6), (6, 1), 0), ((3, 4), (1, 6), 2), ((2, 2, 3), (12, 3, 1), 6)])
def test_an_alias_is_what_as_strided_then_detach_make(shape, stride, offset):
    """Same layout, the base's storage, no ``_base``; and it keeps the storage alive (counted once
    by a tracker) after the base is gone, as a detached alias does."""
    with FakeTensorMode():
        base = empty_fake((4, 6), (6, 1), torch.float32, torch.device("cpu"))
        expected = base.as_strided(shape, stride, offset).detach()
        alias = alias_fake(base, shape, stride, offset)
    assert isinstance(alias, FakeTensor) and alias.fake_mode is base.fake_mode
    assert _layout(alias) == _layout(expected)
    assert storage_key(alias) == storage_key(base)
    tracker = AllocationTracker()
    tracker.register(base)
    tracker.register(alias)
    assert tracker.live == 4 * 6 * 4
    del base, expected
    gc.collect()
    assert tracker.live == 4 * 6 * 4  # the alias holds the storage
    del alias
    gc.collect()
    assert tracker.live == 0


def test_an_alias_of_a_real_tensor_goes_through_the_ops():
    base = torch.arange(24.0).reshape(4, 6)
    alias = alias_fake(base, (2, 3), (6, 2), 1)
    assert not isinstance(alias, FakeTensor) and alias._base is None
    assert torch.equal(alias, base.as_strided((2, 3), (6, 2), 1))
