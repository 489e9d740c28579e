"""``training.transaction``: what a failed step puts back (and the gradients it drops), and the
memory its copies reuse."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from harmony_fx.training.transaction import Undo
from harmony_fx.training.updates import Updater
from tests.helpers import (after_each_pack_update, assert_same_result, four_pack_model, four_pack_trainer,
                           regression_batches)


def _trained_once(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def test_restore_puts_back_weights_state_and_buffers_and_leaves_no_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = _trained_once(model)
    params = list(model.parameters())
    weights = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    assert all(p.grad is not None for p in params)
    running_mean = model[1].running_mean.clone()
    undo = Undo(optimizer, params, [model[1].running_mean])

    model[1].running_mean.add_(1.0)  # what a forward writes back
    Updater(optimizer).update_pack(0, params, {id(p): torch.full_like(p, 3.0) for p in params}, undo)
    assert not torch.equal(params[0].detach(), weights[0])
    undo.restore()

    for param, weight in zip(params, weights):
        assert torch.equal(param.detach(), weight) and param.grad is None
        for key, value in state[id(param)].items():
            assert torch.equal(optimizer.state[param][key], value)
    assert torch.equal(model[1].running_mean, running_mean)


def test_the_copies_are_written_into_the_last_steps_memory():
    model = nn.Linear(8, 8)
    optimizer = _trained_once(model)
    store: dict[int, tuple] = {}
    params = list(model.parameters())
    Undo(optimizer, params, [], store=store).save(params)
    first = {key: (data.data_ptr(), {k: v.data_ptr() for k, v in state.items() if isinstance(v, torch.Tensor)})
             for key, (data, state) in store.items()}
    Undo(optimizer, params, [], store=store).save(params)
    second = {key: (data.data_ptr(), {k: v.data_ptr() for k, v in state.items() if isinstance(v, torch.Tensor)})
              for key, (data, state) in store.items()}
    assert first == second and len(first) == len(params)


def test_without_copies_an_update_is_counted_and_kept():
    model = nn.Linear(3, 3)
    optimizer = _trained_once(model)
    params = list(model.parameters())
    undo = Undo(optimizer, params, [], copies=False)
    Updater(optimizer).update_pack(0, params, {id(p): torch.ones_like(p) for p in params}, undo)
    after = [p.detach().clone() for p in params]
    undo.restore()
    assert undo.updated == len(params)
    assert all(torch.equal(p.detach(), a) for p, a in zip(params, after))  # nothing to put back


def test_the_time_the_copies_take_is_counted_only_when_copies_are_made():
    model = nn.Linear(64, 64)
    optimizer = _trained_once(model)
    params = list(model.parameters())
    kept, dropped = Undo(optimizer, params, []), Undo(optimizer, params, [], copies=False)
    kept.save(params)
    dropped.save(params)
    assert kept.seconds > 0 and dropped.seconds == 0.0


class _Injected(RuntimeError):
    pass


def test_a_failed_step_leaves_no_grad_and_the_next_step_equals_eager(monkeypatch):
    """A step whose second pack update fails (each pack's gradients landed in the last step's
    tensors) is undone: weights and optimizer state as before it, every ``.grad`` ``None``. The
    step run again equals eager's, gradients included."""
    trainer = four_pack_trainer()
    reference = four_pack_model()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    params = list(trainer.model.parameters())
    updates = []

    def fail_in_second_step(params):
        updates.append(len(updates))
        if len(updates) == 4 + 2:  # the first step's 4 packs, then 2 of the second's
            raise _Injected("after two packs of the second step")

    after_each_pack_update(monkeypatch, fail_in_second_step)
    try:
        for step, (x, target) in enumerate(regression_batches(3)):
            if step == 1:
                weights = [p.detach().clone() for p in params]
                state = [{k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in params]
                with pytest.raises(_Injected):
                    trainer.step((x, target))
                assert all(p.grad is None for p in params)
                assert all(torch.equal(p.detach(), w) for p, w in zip(params, weights))
                for param, before in zip(params, state):
                    assert all(torch.equal(trainer.optimizer.state[param][k], v) for k, v in before.items())
                assert trainer.step_count == 1
            loss = trainer.step((x, target))
            ref_optimizer.zero_grad()
            ref_loss = nn.functional.mse_loss(reference(x), target)
            ref_loss.backward()
            ref_optimizer.step()
            assert_same_result(loss, ref_loss, params, reference.parameters())
            for param, ref in zip(params, reference.parameters()):
                torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6)
    finally:
        trainer.close()
    assert len(updates) == 4 * 4  # the failed step's worker went on with its other packs, undone too
