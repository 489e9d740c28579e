"""analyze_batch_dims is sound on random chains of views, transposes, row-wise and along-a-dim ops:
where it says the samples stay apart, changing one sample's input changes only that sample's part
of the output (a count made by running the model, independent of the analysis)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("hypothesis")  # a test extra: without it this module skips
from hypothesis import HealthCheck, given, settings, strategies as st

from harmony_fx.analysis.batch_dims import analyze_batch_dims
from harmony_fx.frontend.capture import capture

BATCH = 4


class _Chain(nn.Module):
    """Applies ``steps`` to ``x``, then the inverse of the last ``undone`` views and transposes in
    reverse order: what a step merged the batch with may be split back out, or stay merged."""

    def __init__(self, steps: list[tuple], undone: int) -> None:
        super().__init__()
        self.steps, self.undone = steps, undone
        self.weight = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        shapes = []
        for step in self.steps:
            kind = step[0]
            if kind == "view":
                shapes.append(x.shape)
                x = x.reshape(step[1])
            elif kind == "transpose":
                shapes.append(("t", step[1], step[2]))
                x = x.transpose(step[1], step[2])
            elif kind == "rows":  # tanh, and a shared matrix over the last dim: each row apart
                x = torch.tanh(x) @ self.weight[:x.shape[-1], :x.shape[-1]]
            else:  # softmax along a dim: mixes the samples only where that dim carries them
                x = x.softmax(step[1])
        for undo in reversed(shapes[len(shapes) - min(self.undone, len(shapes)):]):
            x = x.transpose(undo[1], undo[2]) if undo[0] == "t" else x.reshape(undo)
        return x


def _factorisations(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes the same elements take by merging two neighbouring dims or splitting one in two."""
    found = [shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2:] for i in range(len(shape) - 1)]
    for i, size in enumerate(shape):
        found += [shape[:i] + (f, size // f) + shape[i + 1:] for f in range(2, size) if size % f == 0]
    return found


@st.composite
def _chains(draw) -> tuple[int, list[tuple]]:
    """The input's batch dim (its shape ``[4, 6]`` or ``[6, 4]``), and the steps."""
    dim = draw(st.integers(0, 1))
    shape, steps = ((BATCH, 6), (6, BATCH))[dim], []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["view", "view", "transpose", "rows", "rows", "softmax"]))
        if kind == "view":
            shape = draw(st.sampled_from(_factorisations(shape)))
            steps.append(("view", shape))
        elif kind == "transpose" and len(shape) > 1:
            first, second = draw(st.permutations(range(len(shape))))[:2]
            shape = list(shape)
            shape[first], shape[second] = shape[second], shape[first]
            shape = tuple(shape)
            steps.append(("transpose", first, second))
        elif kind == "rows" and shape[-1] <= 6:
            steps.append(("rows",))
        elif kind == "softmax":
            steps.append(("softmax", draw(st.integers(0, len(shape) - 1))))
    return dim, steps


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_chains(), st.integers(0, 6), st.integers(0, BATCH - 1))
def test_where_the_samples_are_said_apart_one_samples_input_changes_only_its_output(chain, undone, changed):
    batch_dim, steps = chain
    torch.manual_seed(0)
    model = _Chain(steps, undone)
    x = torch.randn(BATCH, 6) if batch_dim == 0 else torch.randn(6, BATCH)
    captured = capture(model, (x,))
    analysis = analyze_batch_dims(captured.gm, {captured.inputs[0]: batch_dim}, BATCH)
    if not analysis.separable:
        return
    (dim,) = analysis.output_dims.values()
    other = x.clone()
    other.select(batch_dim, changed).add_(torch.randn(6))  # not a constant shift, which a softmax would not see
    with torch.no_grad():
        before, after = model(x), model(other)
    rows = before.shape[dim] // BATCH  # each sample's part: a block of rows of the batch dim
    for sample in range(BATCH):
        moved = not torch.equal(before.narrow(dim, sample * rows, rows), after.narrow(dim, sample * rows, rows))
        assert moved == (sample == changed), (steps, dim, sample)
    assert math.prod(before.shape) == BATCH * 6
