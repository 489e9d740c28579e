"""``Trainer`` for the models people have: dict batches, models that return their own loss
(Hugging Face's ``.loss``, nanoGPT's ``(logits, loss)``), one- and two-argument ``loss_fn``, each
trained next to eager with the same optimizer."""
from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx

RTOL, ATOL = 1e-5, 1e-6


def _assert_params_equal(model: nn.Module, reference: nn.Module, rtol=RTOL, atol=ATOL) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _train(model, loss_fn, batches, optimizer_of, call_eager, steps, **options):
    """``steps`` Trainer steps and as many eager steps on a copy; returns both loss lists."""
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = optimizer_of(model), optimizer_of(reference)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, batches[0], **options)
    losses, ref_losses = [], []
    try:
        for step in range(steps):
            batch = batches[step % len(batches)]
            losses.append(trainer.step(batch).item())
            ref_loss = call_eager(reference, batch)
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            ref_losses.append(ref_loss.item())
    finally:
        trainer.close()
    return trainer, reference, losses, ref_losses


def test_hugging_face_gpt2_with_labels_in_a_dict_batch_trains_like_eager_adamw():
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    model = build_hf_model("gpt2")
    batches = [hf_batch("gpt2", seed=seed, batch=4, seq=32) for seed in (1, 2)]
    trainer, reference, losses, ref_losses = _train(
        model, None, batches, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), lambda m, b: m(**b).loss,
        steps=5, microbatches=1)
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    _assert_params_equal(model, reference)
    assert len(trainer.plan.packs) >= 1


class _NanoGPTLike(nn.Module):
    """Returns ``(logits, loss)`` as nanoGPT does when given targets."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1)
        return logits, loss


def _token_batch(seed: int, batch: int = 6, seq: int = 8, vocab: int = 32):
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq), generator=generator)
    targets = torch.roll(idx, -1, dims=1)
    targets[0, 3:] = -1  # ignored positions, more in one microbatch than another
    return idx, targets


def test_a_one_argument_loss_fn_picks_the_loss_out_of_the_output_across_uneven_microbatches():
    torch.manual_seed(0)
    batches = [_token_batch(seed) for seed in (1, 2, 3)]
    trainer, reference, losses, ref_losses = _train(
        _NanoGPTLike(), lambda out: out[1], batches, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda m, b: m(*b)[1], steps=3, microbatches=4, pack_boundaries=(0, 2, 4))
    assert trainer.hm.mb_sizes == [2, 2, 1, 1]
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)


def test_loss_fn_none_takes_a_model_that_returns_its_loss_and_a_dict_batch():
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, features, labels):
            return F.mse_loss(self.layers(features).squeeze(-1), labels)

    torch.manual_seed(0)
    batch = {"features": torch.randn(10, 4), "labels": torch.randn(10)}
    _, reference, losses, ref_losses = _train(
        WithLoss(), None, [batch], lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), lambda m, b: m(**b),
        steps=3, microbatches=3)
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)


def test_a_two_argument_loss_fn_takes_keyword_inputs_beside_the_target():
    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, features):
            return self.second(torch.tanh(self.first(features)))

    torch.manual_seed(0)
    features, target = torch.randn(8, 4), torch.randint(0, 3, (8,))
    batch = ({"features": features}, target)
    _, _, losses, ref_losses = _train(
        Keyword(), F.cross_entropy, [batch], lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda m, b: F.cross_entropy(m(**b[0]), b[1]), steps=2, microbatches=2)
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)


def test_loss_weights_follow_the_batch_dims_actually_split_not_the_first_input():
    """The first input is shared (not split); the microbatches are 3 and 2 samples of the second."""

    class SharedFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, bias, x):
            return self.linear(x) + bias

    torch.manual_seed(0)
    bias, x, target = torch.randn(3), torch.randn(5, 4), torch.randint(0, 3, (5,))
    batch = ((bias, x), target)
    _, _, losses, ref_losses = _train(
        SharedFirst(), F.cross_entropy, [batch], lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda m, b: F.cross_entropy(m(*b[0]), b[1]), steps=2, microbatches=2, batch_dims={"bias": None})
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)


def test_a_model_returning_a_tuple_without_a_loss_fn_is_refused_with_what_to_do():
    torch.manual_seed(0)
    model = _NanoGPTLike()
    with pytest.raises(ValueError, match=r"lambda out: out\[1\]"):
        harmony_fx.Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.1), _token_batch(1))


def test_loss_fn_none_takes_the_first_item_of_a_tuple_that_is_a_number():
    """A Hugging Face model with ``return_dict=False`` returns ``(loss, logits)``: transformers'
    Trainer takes ``outputs[0]``; harmony refused it."""

    class LossFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, features, labels):
            logits = self.linear(features)
            return F.cross_entropy(logits, labels), logits

    torch.manual_seed(0)
    batch = {"features": torch.randn(8, 4), "labels": torch.randint(0, 3, (8,))}
    _, _, losses, ref_losses = _train(
        LossFirst(), None, [batch], lambda m: torch.optim.SGD(m.parameters(), lr=0.1), lambda m, b: m(**b)[0],
        steps=2, microbatches=2)
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)


def test_a_loss_scale_multiplies_the_steps_loss_and_every_gradient():
    """``step(batch, loss_scale=3)``: three times the loss eager computes, and three times each
    gradient (what a caller adding its batches' losses asks for)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x, target = torch.randn(6, 8), torch.randn(6, 2)
    trainer = harmony_fx.Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.0), (x, target),
                                 devices=["host:0"], microbatches=2)
    loss = trainer.step((x, target), loss_scale=3.0)
    expected = F.mse_loss(reference(x), target)
    expected.backward()
    torch.testing.assert_close(loss, 3 * expected.detach(), rtol=1e-5, atol=1e-6)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, 3 * ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_float64_models_loss_comes_back_in_float64_as_eager_computes_it(microbatches):
    """A float64 model's step returns eager's float64 loss, not the loss rounded to float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    reference = copy.deepcopy(model)
    x, target = torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 4, (6,))
    trainer = harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0), (x, target),
                                 devices=["host:0"], microbatches=microbatches)
    try:
        loss = trainer.step((x, target))
    finally:
        trainer.close()
    expected = F.cross_entropy(reference(x), target)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)


def test_a_microbatch_whose_every_label_is_ignored_adds_nothing_to_the_steps_loss():
    """Its mean is over no label (NaN); eager's mean over the whole batch never sees it, and the
    step's loss and updates are eager's (a masked prompt, a padded tail)."""
    torch.manual_seed(0)
    model = _NanoGPTLike()
    idx, targets = _token_batch(1)
    targets[:2] = -1  # all of the first of three microbatches
    _, reference, losses, ref_losses = _train(
        model, lambda out: out[1], [(idx, targets)], lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda m, b: m(*b)[1], steps=2, microbatches=3)
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    _assert_params_equal(model, reference)


class _Annealed(nn.Module):
    """A loss module whose plain attribute a schedule moves (a KL warm-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = 0.0

    def forward(self, out, y):
        return F.cross_entropy(out, y) + self.weight * out.pow(2).mean()


class _Schedule:
    """What a training script keeps its knobs in: a class attribute, an instance's, a counter."""

    aux = 0.0

    def __init__(self) -> None:
        self.smoothing, self.weight, self.step = 0.0, torch.tensor(0.0), 0


_SCHEDULE = _Schedule()
_CONFIG = types.ModuleType("config")  # `import config; config.AUX`
_CONFIG.AUX = 0.0
_GLOBAL_AUX = 0.0
_SETTINGS = {"aux": 0.0, "smoothing": 0.0}


def _aux_weight():
    return _GLOBAL_AUX


def _with_settings(out, y, settings):
    return F.cross_entropy(out, y, label_smoothing=settings["smoothing"]) + settings["aux"] * out.pow(2).mean()


def _set(value: float) -> None:
    global _GLOBAL_AUX
    _SETTINGS.update(aux=value, smoothing=value / 10)
    _Schedule.aux = _CONFIG.AUX = _GLOBAL_AUX = _SCHEDULE.smoothing = value
    _SCHEDULE.weight = torch.tensor(value)  # a tensor put in the old one's place, not updated in it
    _ANNEALED.weight = _CRITERION.label_smoothing = value / 10


_ANNEALED = _Annealed()
_CRITERION = nn.CrossEntropyLoss()
_LOSSES = {
    "a dict in the closure": lambda out, y: _with_settings(out, y, _SETTINGS),
    "functools.partial": functools.partial(_with_settings, settings=_SETTINGS),
    "a loss module's attribute": _ANNEALED,
    "a criterion the loss calls": lambda out, y: _CRITERION(out, y) + out.pow(2).mean(),
    "a class attribute": lambda out, y: F.cross_entropy(out, y) + _Schedule.aux * out.pow(2).mean(),
    "a module's attribute": lambda out, y: F.cross_entropy(out, y) + _CONFIG.AUX * out.pow(2).mean(),
    "a helper's global": lambda out, y: F.cross_entropy(out, y) + _aux_weight() * out.pow(2).mean(),
    "an object's attribute": lambda out, y: F.cross_entropy(out, y, label_smoothing=_SCHEDULE.smoothing),
    "a tensor replaced": lambda out, y: F.cross_entropy(out, y) + _SCHEDULE.weight * out.pow(2).mean(),
}


@pytest.mark.parametrize("form", list(_LOSSES))
def test_a_python_value_the_loss_reads_is_the_steps_own(form):
    """An annealed aux-loss weight and a label-smoothing schedule, read however a script reads them:
    the graph captured at the first step held their first values, and every later step trained on
    them (loss 1.73 where eager's was 19.2). What the loss reads is part of the call's key: a change
    compiles again, and a value that comes back finds its graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    loss_fn = _LOSSES[form]
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    _set(0.0)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, batches[0], devices=["host:0"], microbatches=1)
    try:
        for step, (x, y) in enumerate(batches + batches[:1]):
            _set(0.5 * (step % 3))
            loss = trainer.step((x, y))
            reference_optimizer.zero_grad()
            expected = loss_fn(reference(x), y)
            expected.backward()
            reference_optimizer.step()
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
    finally:
        _set(0.0)
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    if form != "a tensor replaced":  # a new tensor each step: a graph each
        assert len({*trainer.hm._by_key.values(), trainer.hm}) == 3  # one graph per value, the fourth step the first's


def test_a_loss_whose_python_values_stay_compiles_once():
    """Nor does a counter on an object the loss reads, which its code does not name (``run.step``
    beside ``run.smoothing``): it compiled the step again every time."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    run = _Schedule()
    run.smoothing = 0.1
    trainer = harmony_fx.Trainer(model, lambda out, y: F.cross_entropy(out, y, label_smoothing=run.smoothing),
                                 torch.optim.SGD(model.parameters(), lr=0.1),
                                 (torch.randn(8, 16), torch.randint(0, 4, (8,))), devices=["host:0"])
    for _ in range(3):
        run.step += 1
        trainer.step((torch.randn(8, 16), torch.randint(0, 4, (8,))))
    assert set(trainer.hm._by_key.values()) <= {trainer.hm}  # its own key, if any: nothing compiled again
