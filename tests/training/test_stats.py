"""``Trainer.stats``: the step's own figures beside the iteration's, each from its own source."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.models import MLPChain


def _trainer(**options) -> tuple[harmony_fx.Trainer, tuple]:
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=4)
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return harmony_fx.Trainer(model, F.cross_entropy, optimizer, batch, microbatches=2, **options), batch


@pytest.mark.parametrize("atomic", [True, False])
def test_a_steps_figures_are_its_own_and_its_iterations(atomic):
    trainer, batch = _trainer(atomic=atomic)
    try:
        assert trainer.stats.update_seconds == 0.0  # before any step: nothing yet, and no error
        trainer.step(batch)
        stats = trainer.stats
        assert stats.update_seconds > 0 and 0 <= stats.update_exposed_seconds
        assert (stats.undo_seconds > 0) == atomic and stats.undo_seconds <= stats.update_seconds
        # the iteration's figures read through: bytes moved as the plan predicted them
        assert stats.as_dict()["bytes_by_kind"] == trainer.plan.predicted_bytes
        assert stats.bytes_h2d > 0 and stats.as_dict()["update_seconds"] == stats.update_seconds
        assert "update_seconds" not in trainer.hm.stats.as_dict()  # the runtime keeps no Trainer figures
    finally:
        trainer.close()


def test_a_clipped_step_shows_its_gradient_norm_before_clipping():
    """``max_grad_norm``: ``stats.grad_norm`` is the global norm the step clipped by (what a log
    shows), the norm of the gradients left in ``.grad`` scaled back up; without clipping, None."""
    trainer, batch = _trainer(max_grad_norm=1e-3)
    reference = copy.deepcopy(trainer.model)
    F.cross_entropy(reference(batch[0]), batch[1]).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    try:
        trainer.step(batch)
        clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()]))
        assert trainer.stats.grad_norm == pytest.approx(float(expected), rel=1e-5) and float(expected) > 1e-3
        assert float(clipped) == pytest.approx(1e-3, rel=1e-3)
        assert trainer.stats.as_dict()["grad_norm"] == trainer.stats.grad_norm
    finally:
        trainer.close()
    trainer, batch = _trainer()
    try:
        trainer.step(batch)
        assert trainer.stats.grad_norm is None
    finally:
        trainer.close()
