"""``training.transaction``: what a failed step puts back, and the memory its copies reuse."""
from __future__ import annotations

import torch
from torch import nn

from harmony_fx.training.transaction import Undo
from harmony_fx.training.updates import Updater


def _trained_once(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def test_restore_puts_back_weights_state_buffers_and_grads_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = _trained_once(model)
    params = list(model.parameters())
    weights = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    grads = [p.grad for p in params]
    running_mean = model[1].running_mean.clone()
    undo = Undo(optimizer, params, [model[1].running_mean])

    model[1].running_mean.add_(1.0)  # what a forward writes back
    Updater(optimizer).update_pack(0, params, {id(p): torch.full_like(p, 3.0) for p in params}, undo)
    assert not torch.equal(params[0].detach(), weights[0])
    undo.restore()

    for param, weight, grad in zip(params, weights, grads):
        assert torch.equal(param.detach(), weight) and param.grad is grad
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
