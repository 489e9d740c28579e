"""``training.updates`` and the turn order of ``distributed.updates``, without a compiled model:
the updates against a plain ``optimizer.step()``, and the order every rank issues its packs in."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch import nn

import harmony_fx

from harmony_fx.distributed.updates import TurnOrder
from harmony_fx.training.transaction import Undo
from harmony_fx.training.updates import Updater, steps_per_parameter


def _model_and_grads(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    grads = {id(p): torch.randn_like(p) * 10 for p in model.parameters()}  # large: clipping bites
    return model, grads


def _groups(model: nn.Module) -> dict[int, list[nn.Parameter]]:
    params = list(model.parameters())
    return {0: params[:2], 1: params[2:]}


def _eager(model: nn.Module, grads: dict, clip: float | None):
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for param, original in zip(reference.parameters(), model.parameters()):
        param.grad = grads[id(original)].clone()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    optimizer.step()
    return reference


def _assert_params_equal(model: nn.Module, reference: nn.Module) -> None:
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=0, atol=0)


def test_per_pack_updates_equal_one_optimizer_step():
    model, grads = _model_and_grads()
    reference = _eager(model, grads, clip=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    updater, undo = Updater(optimizer), Undo(optimizer, list(model.parameters()), [])
    for pack, params in sorted(_groups(model).items(), reverse=True):  # the backward's order
        seconds, waited = updater.update_pack(pack, params, grads, undo)
        assert seconds >= 0 and waited == 0.0  # no tier: nothing waited for
    _assert_params_equal(model, reference)


def test_the_final_update_clips_by_the_global_norm_as_torch_does():
    model, grads = _model_and_grads(1)
    reference = _eager(model, grads, clip=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    norm = Updater(optimizer, max_grad_norm=0.5).update_all(_groups(model), grads, Undo(optimizer, [], []))
    _assert_params_equal(model, reference)
    assert norm == pytest.approx(float(expected), rel=1e-6) and norm > 0.5  # before clipping: the log's figure
    assert Updater(optimizer).update_all(_groups(model), grads, Undo(optimizer, [], [])) is None  # no clipping
    unclipped = _eager(model, grads, clip=None)
    assert any(not torch.equal(a, b) for a, b in zip(reference.parameters(), unclipped.parameters()))


def test_an_update_saves_each_parameter_before_stepping_it_and_restore_puts_it_back():
    model, grads = _model_and_grads(2)
    before = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    undo = Undo(optimizer, list(model.parameters()), [])
    Updater(optimizer).update_pack(1, _groups(model)[1], grads, undo)
    assert [param for param, _, _ in undo.saved] == _groups(model)[1]
    assert all(param in optimizer.state for param in _groups(model)[1])
    undo.restore()
    _assert_params_equal(model, before)
    assert not optimizer.state  # it had none before the step


@given(st.permutations(list(range(6))))
def test_turns_come_in_the_common_order_whatever_order_packs_complete_in(arrival):
    order = [5, 4, 3, 2, 1, 0]
    turns = TurnOrder(order)
    taken = []
    for count, pack in enumerate(arrival, start=1):
        came = turns.arrive(pack, f"copies of {pack}")
        assert all(item == f"copies of {turn}" for turn, item in came)
        taken += [turn for turn, _ in came]
        assert taken == order[:len(taken)]  # a prefix of the order, each pack once
        assert turns.remaining() == order[len(taken):]
        # a pack's turn comes as soon as every pack before it is complete
        assert len(taken) == next((i for i, p in enumerate(order) if p not in arrival[:count]), len(order))
    assert taken == order


@pytest.mark.parametrize("max_grad_norm", [None, 0.1])
def test_the_optimizers_step_hooks_run_once_a_step_seeing_every_parameter(max_grad_norm):
    """A step updates pack by pack, an ``optimizer.step()`` over each pack's parameters: the
    optimizer's own hooks (an EMA, a step counter) ran once a pack, each seeing that pack's two
    parameters. As around one eager ``optimizer.step()``: once, before and after, over all six."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    def hook(kind):
        return lambda opt, args, kwargs: calls.append((kind, sum(len(group["params"]) for group in opt.param_groups)))

    optimizer.register_step_pre_hook(hook("pre"))
    optimizer.register_step_post_hook(hook("post"))
    # torch's global hooks (every optimizer's), around the optimizer's own as torch orders them
    hooks_module = importlib.import_module("torch.optim.optimizer")  # torch.optim does not keep it as an attribute
    handles = [hooks_module.register_optimizer_step_pre_hook(hook("global pre")),
               hooks_module.register_optimizer_step_post_hook(hook("global post"))]
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, (x, y), pack_boundaries=[0, 2, 4],
                                 max_grad_norm=max_grad_norm, devices=["host:0"])
    try:
        for _ in range(2):
            trainer.step((x, y))
        assert calls == [("global pre", 6), ("pre", 6), ("post", 6), ("global post", 6)] * 2
        assert len(optimizer._optimizer_step_pre_hooks) == len(optimizer._optimizer_step_post_hooks) == 1
        assert all(handle.id in hooks for handle, hooks in zip(handles, (
            hooks_module._global_optimizer_pre_hooks, hooks_module._global_optimizer_post_hooks)))
    finally:
        for handle in handles:
            handle.remove()


def _centralized(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with gradient centralization in a step pre-hook, which reads and changes the gradients:
    it ran before the backward, on none the first step and the last step's after, so its change
    was overwritten by the new gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    def centralize(opt, args, kwargs):
        for group in opt.param_groups:
            for param in group["params"]:
                if param.grad is not None and param.ndim > 1:
                    param.grad.sub_(param.grad.mean(dim=1, keepdim=True))

    optimizer.register_step_pre_hook(centralize)
    return optimizer


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_a_step_pre_hook_sees_and_changes_this_steps_gradients(max_grad_norm):
    _steps(_centralized, max_grad_norm=max_grad_norm)


def _add_pre_hook(optimizer: torch.optim.Optimizer) -> None:
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: None)


def _replace_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step = lambda *args, **kwargs: None


@pytest.mark.parametrize("change, said", [(_add_pre_hook, "pre-hook was registered .* after the Trainer was made"),
                                          (_replace_step, "SGD.step was replaced.*before making the Trainer")])
def test_a_step_changed_after_the_trainer_was_made_is_refused(change, said):
    """The Trainer chose to update each pack during the backward: a pre-hook added since would not
    see every gradient, a step set since would run once a pack."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, batch, pack_boundaries=[0, 2, 4],
                                 devices=["host:0"])
    change(optimizer)
    with pytest.raises(ValueError, match=said):
        trainer.step(batch)


def test_an_optimizer_that_steps_with_a_closure_is_refused_with_what_to_use():
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match="closure.*SGD, Adam"):
        harmony_fx.Trainer(model, F.mse_loss, torch.optim.LBFGS(model.parameters()),
                           (torch.randn(2, 4), torch.randn(2, 2)))


class _SecondOrder(torch.optim.SGD):
    """timm's ``Adahessian`` says so: its step takes Hessian-vector products of the gradients, which
    failed inside the update ("element 0 of tensors does not require grad")."""

    is_second_order = True


def test_a_second_order_optimizer_is_refused_with_what_to_use():
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match="_SecondOrder is a second-order optimizer.*first-order optimizer"):
        harmony_fx.Trainer(model, F.mse_loss, _SecondOrder(model.parameters(), lr=0.1),
                           (torch.randn(2, 4), torch.randn(2, 2)))


class _CountingSGD(torch.optim.SGD):
    """An optimizer outside torch that counts its steps in each param group (timm's ``Lookahead``,
    schedule-free optimizers): one count a step, however many packs the step updates."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["steps"] = group.get("steps", 0) + 1
            group["lr"] = 0.1 / group["steps"]  # what the count decides
        return super().step(closure)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _steps(make_optimizer, before_step=lambda i, model: None, steps: int = 3, **options):
    """The Trainer's parameters and eager's (zero_grad, forward, backward, step) after each step."""
    model = _mlp()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(steps)]
    optimizer, reference_optimizer = make_optimizer(model), make_optimizer(reference)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, batches[0], pack_boundaries=[0, 2, 4],
                                 devices=["host:0"], microbatches=2, **options)
    for i, (x, y) in enumerate(batches):
        before_step(i, model)
        before_step(i, reference)
        trainer.step((x, y))
        reference_optimizer.zero_grad()
        loss = F.cross_entropy(reference(x), y)
        loss.backward()
        if options.get("max_grad_norm"):
            torch.nn.utils.clip_grad_norm_(reference.parameters(), options["max_grad_norm"])
        reference_optimizer.step()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-5, atol=1e-6, msg=f"step {i}: {name}")
    return optimizer, reference_optimizer, model, reference


def test_an_optimizer_whose_step_counts_in_its_groups_is_stepped_once_a_step():
    """It was stepped once a pack (three here): its count ran three times as fast, and so its lr fell."""
    optimizer, reference_optimizer, _, _ = _steps(lambda model: _CountingSGD(model.parameters(), lr=0.1))
    assert optimizer.param_groups[0]["steps"] == reference_optimizer.param_groups[0]["steps"] == 3


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_a_layer_frozen_mid_training_is_not_stepped_with_its_last_gradient(max_grad_norm):
    """With the final update (clipping), every optimizer parameter was stepped: a layer frozen since
    the last step moved on with the gradient that step left it."""
    def freeze_from_the_second_step(i, model):
        if i == 1:
            model[0].requires_grad_(False)

    _, _, model, reference = _steps(lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    freeze_from_the_second_step, max_grad_norm=max_grad_norm)
    assert model[0].weight.grad is None and reference[0].weight.grad is None  # not the last step's


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_a_parameters_own_gradient_hooks_run_as_autograd_runs_them(max_grad_norm):
    """A pruning mask as a tensor hook, and a post-accumulate hook: the Trainer set each ``.grad``
    itself, past both (the pruned weights grew back)."""
    calls = []

    def prune(i, model):
        if i == 0:
            mask = (torch.arange(model[2].weight.numel()) % 3 != 0).view_as(model[2].weight).float()
            with torch.no_grad():
                model[2].weight.mul_(mask)
            model[2].weight.register_hook(lambda grad: grad * mask)
            model[4].weight.register_post_accumulate_grad_hook(lambda param: calls.append(param.grad.norm()))

    _steps(lambda model: torch.optim.SGD(model.parameters(), lr=0.1), prune, max_grad_norm=max_grad_norm)
    assert len(calls) == 6  # three steps each, the Trainer's and eager's
    torch.testing.assert_close(calls[0::2], calls[1::2], rtol=1e-5, atol=1e-6)


def test_the_tier_refuses_an_optimizer_whose_step_is_not_per_parameter(tmp_path):
    """The tier streams the state through one parameter's update at a time."""
    model = _mlp()
    with pytest.raises(ValueError, match="nvme_path= streams.*_CountingSGD"):
        harmony_fx.Trainer(model, F.cross_entropy, _CountingSGD(model.parameters(), lr=0.1),
                           (torch.randn(8, 16), torch.randint(0, 4, (8,))), nvme_path=str(tmp_path), devices=["host:0"])


class _UncertaintyWeighted(nn.Module):
    """A loss with learnable weights (Kendall et al.'s log-variances per task): its parameters are
    captured with the model and trained by the same optimizer (it was refused as not the model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_var = nn.Parameter(torch.zeros(2))

    def forward(self, out, y):
        return (torch.exp(-self.log_var[0]) * F.cross_entropy(out, y) + self.log_var[0]
                + torch.exp(-self.log_var[1]) * out.pow(2).mean() + self.log_var[1])


def test_a_loss_modules_own_parameters_train_with_the_model_as_in_eager():
    model, loss = _mlp(), _UncertaintyWeighted()
    reference, reference_loss = copy.deepcopy(model), copy.deepcopy(loss)
    optimizer = torch.optim.AdamW([*model.parameters(), *loss.parameters()], lr=1e-2)
    reference_optimizer = torch.optim.AdamW([*reference.parameters(), *reference_loss.parameters()], lr=1e-2)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
    trainer = harmony_fx.Trainer(model, loss, optimizer, batches[0], pack_boundaries=[0, 2, 4], devices=["host:0"])
    for x, y in batches:
        trainer.step((x, y))
        reference_optimizer.zero_grad()
        reference_loss(reference(x), y).backward()
        reference_optimizer.step()
    torch.testing.assert_close(loss.log_var.detach(), reference_loss.log_var.detach(), rtol=1e-5, atol=1e-6)
    assert loss.log_var.abs().min() > 0  # it moved
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-5, atol=1e-6)


def _warmed_up_by_its_calls(model: nn.Module) -> torch.optim.Optimizer:
    """SGD whose ``step``, set on the optimizer itself, counts its calls and warms the lr up by them
    (a clip-then-step wrapper is the same case): it ran once a pack, three times a step here."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inner, optimizer.calls = optimizer.step, 0

    def step(*args, **kwargs):
        optimizer.calls += 1
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, optimizer.calls / 3)
        return inner(*args, **kwargs)

    optimizer.step = step
    return optimizer


def test_a_step_set_on_the_optimizer_itself_runs_once_a_step():
    optimizer, reference_optimizer, _, _ = _steps(_warmed_up_by_its_calls)
    assert optimizer.calls == reference_optimizer.calls == 3


def test_which_optimizers_step_per_parameter():
    model = _mlp()
    adam = torch.optim.Adam(model.parameters())
    assert steps_per_parameter(adam)
    torch.optim.lr_scheduler.LambdaLR(adam, lambda step: 1.0)  # its wrapper of step only notes the call
    assert steps_per_parameter(adam)
    assert not steps_per_parameter(_warmed_up_by_its_calls(model))
    assert not steps_per_parameter(_CountingSGD(model.parameters(), lr=0.1))
    # torch's own whose module is torch.optim itself: each parameter's own update too
    assert steps_per_parameter(torch.optim.Adafactor(model.parameters()))
    _steps(lambda model: torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01))
