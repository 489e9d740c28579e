"""frontend.checkpoint_regions: a model's own torch.utils.checkpoint regions, nested too, capture as
plain calls: the loss and every gradient are eager's, and torch's hook is put back after."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import harmony_fx
from harmony_fx.frontend.checkpoint_regions import checkpoints_as_plain_calls
from tests.helpers import assert_grads_equal

# as transformers binds it at gradient_checkpointing_enable(), before any capture
_CHECKPOINT = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return _CHECKPOINT(lambda h: torch.relu(self.linear(h)), x)


class _Stage(nn.Module):
    """A checkpointed block inside a checkpointed stage (transformers' Swin with gradient checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return _CHECKPOINT(self.block, x)


@pytest.mark.parametrize("nested", [False, True], ids=["one", "nested"])
def test_checkpointed_regions_train_as_eager(nested):
    """Nested, export left grad mode off after the inner region: the output did not require grad,
    and ``backward()`` failed ("element 0 of tensors does not require grad")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Stage() if nested else _Block(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=(0, 1, 2))
    loss, expected = hm(x).square().mean(), reference(x).square().mean()
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert_grads_equal(model, reference)


def test_torchs_hook_is_put_back_even_when_the_block_raises():
    hook = torch_checkpoint._checkpoint_without_reentrant_generator
    with pytest.raises(RuntimeError, match="in the block"):
        with checkpoints_as_plain_calls():
            assert torch_checkpoint._checkpoint_without_reentrant_generator is not hook
            raise RuntimeError("in the block")
    assert torch_checkpoint._checkpoint_without_reentrant_generator is hook
