"""``analysis.buffer_writes``: which op updates a buffer in place, also inside a ``no_grad`` region."""
from __future__ import annotations

import torch
from torch import nn

from harmony_fx.analysis.buffer_writes import first_buffer_write
from harmony_fx.frontend.capture import capture
from harmony_fx.testing.models import StepCounter


class _ReadsUnderNoGrad(nn.Module):
    """A buffer only read inside a no_grad block (Llama's rotary frequencies)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.rand(8))

    def forward(self, x):
        with torch.no_grad():
            angles = x.detach() * self.inv_freq
        return self.linear(x) * angles.cos()


def _first_write(model: nn.Module):
    return first_buffer_write(capture(model, (torch.randn(4, 8),)).gm)


def test_an_update_inside_a_no_grad_region_is_found_and_a_read_there_is_not():
    assert _first_write(StepCounter(8)) is not None
    # spectral_norm writes its vectors with div(..., out=buffer), the buffer given by keyword
    assert _first_write(nn.utils.spectral_norm(nn.Linear(8, 8))) is not None
    assert _first_write(_ReadsUnderNoGrad()) is None
    assert _first_write(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))) is not None  # num_batches_tracked
    assert _first_write(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()) is None
