"""``harmony_fx.Trainer``: whole iterations (forward, loss, backward, optimizer) equal to eager for
every zoo model, optimizer, clipping and budget; input-batch grouping measured from the byte
counters; per-pack updates during the backward; LR schedulers; learning a task; argument checks."""
from __future__ import annotations

import copy
import functools
import gc
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.models import GPTConfig, MLPChain, TinyGPT
from harmony_fx.runtime.executor import Runtime
from harmony_fx.program.actions import ActionKind
from harmony_fx.testing.models import zoo
from tests.helpers import (FOUR_PACKS, after_each_pack_update, assert_same_result, four_pack_model,
                           four_pack_trainer, regression_batches)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 5
# The zoo at batch 8 (a quarter of eager's memory is still feasible for every model, and it is fast).
ZOO = zoo(batch=8)
# Below every zoo model's gradient norm at initialisation, so clipping really scales the gradients.
CLIP = 0.25

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
}


@functools.lru_cache(maxsize=None)
def eager_need(name: str) -> int:
    entry = ZOO[name]
    model, inputs, target = entry.build(0)
    return eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target))


def _case(name, optimizer, clip, fraction, slow=False):
    return pytest.param(name, optimizer, clip, fraction, marks=[pytest.mark.slow] if slow else [],
                        id=f"{name}-{optimizer}-{'clip' if clip else 'noclip'}-{int(fraction * 100)}%")


# every combination on the fast models; a spread of them on the slower ones
CASES = [_case(name, opt, clip, fraction)
         for name in ("mlp_chain", "residual_mlp") for opt in OPTIMIZERS
         for clip in (None, CLIP) for fraction in (1.0, 0.25)]
CASES += [
    _case("tiny_gpt", "adamw", CLIP, 0.25),
    _case("tiny_gpt", "adam", None, 0.25, slow=True),  # 10 s; adamw with clipping covers it by default
    _case("tiny_gpt", "sgd", None, 1.0),
    _case("small_cnn", "sgd", CLIP, 0.25),
    _case("small_cnn", "adamw", None, 0.25),
    _case("small_cnn", "adam", CLIP, 1.0),
]


def _assert_state_dicts_equal(state, ref_state):
    assert state["param_groups"] == ref_state["param_groups"]
    assert state["state"].keys() == ref_state["state"].keys()
    assert len(state["state"]) > 0
    for index, per_param in state["state"].items():
        ref_per_param = ref_state["state"][index]
        assert per_param.keys() == ref_per_param.keys()
        for key, value in per_param.items():
            ref_value = ref_per_param[key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == ref_value.dtype, f"state[{index}][{key}]"
                torch.testing.assert_close(value, ref_value, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"optimizer state[{index}][{key!r}]: {m}")
            else:
                assert value == ref_value, f"optimizer state[{index}][{key!r}]"


@pytest.mark.parametrize("name,optimizer_name,clip,fraction", CASES)
def test_trainer_steps_equal_eager(name, optimizer_name, clip, fraction, memory_witness):
    entry = ZOO[name]
    model, inputs, target = entry.build(0)
    reference, ref_inputs, ref_target = entry.build(0)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    ref_optimizer = OPTIMIZERS[optimizer_name](reference.parameters())
    budget = int(eager_need(name) * fraction)
    trainer = harmony_fx.Trainer(model, entry.loss_fn, optimizer, (inputs, target), max_grad_norm=clip,
                                 memory_budget=budget)
    try:
        if fraction < 1:
            assert len(trainer.hm.packs) >= 3
        clipped = False
        for step in range(STEPS):
            torch.manual_seed(step)
            loss = trainer.step((inputs, target))
            torch.manual_seed(step)
            ref_optimizer.zero_grad()
            ref_loss = entry.loss_fn(reference(*ref_inputs), ref_target)
            ref_loss.backward()
            if clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
                clipped |= bool(norm > clip)
            ref_optimizer.step()

            assert loss.dtype == torch.float32 and loss.dim() == 0
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"loss of step {step}: {m}")
            ref_params = dict(reference.named_parameters())
            for pname, param in model.named_parameters():
                ref = ref_params[pname]
                torch.testing.assert_close(param.detach(), ref.detach(), rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{pname} after step {step}: {m}")
                # .grad holds what the optimizer stepped with (clipped, when clipping), as in eager
                assert (param.grad is None) == (ref.grad is None), pname
                if ref.grad is not None:
                    torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"grad of {pname} in step {step}: {m}")
        if clip is not None:
            assert clipped, "the clipping threshold never bit; the clipped path went untested"
        ref_buffers = dict(reference.named_buffers())
        for bname, buffer in model.named_buffers():
            torch.testing.assert_close(buffer, ref_buffers[bname], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"buffer {bname}: {m}")
        _assert_state_dicts_equal(optimizer.state_dict(), ref_optimizer.state_dict())
        assert trainer.step_count == STEPS
        # the last step moved what the plan predicted and stayed within the budget
        assert trainer.stats.as_dict()["bytes_by_kind"] == trainer.plan.predicted_bytes
        device = trainer.hm.devices[0].name
        assert memory_witness.peak_of(trainer.hm.devices[0]) == trainer.stats.peak_bytes[device] <= budget
        assert trainer.stats.peak_bytes[device] == trainer.plan.predicted_peak[device]
        assert trainer.hm.devices[0].live_bytes() == 0
    finally:
        trainer.close()


# ---------------------------------------------------------------------- input-batch grouping

GROUPING_BOUNDARIES = (0, 4, 8)   # MLPChain(depth=10): blocks 0-3 | blocks 4-7 | blocks 8-9 + head


@functools.lru_cache(maxsize=None)
def _grouping_run(grouping: bool, num_microbatches: int):
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=10)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, (x, target), microbatches=num_microbatches,
                                 grouping=grouping, pack_boundaries=GROUPING_BOUNDARIES)
    try:
        loss = trainer.step((x, target))
    finally:
        trainer.close()
    params = [p.detach().clone() for p in model.parameters()]
    return trainer, dict(trainer.stats.as_dict()["bytes_by_kind"]), loss, params


def _weight_bytes(pack_index: int, trainer) -> int:
    return sum(t.numel() * t.element_size() for t in trainer.hm.host_state.masters[pack_index])


@pytest.mark.parametrize("num_microbatches", [1, 4, 16])
def test_grouping_moves_each_pack_weights_once_per_pass(num_microbatches):
    trainer, moved, _, _ = _grouping_run(True, num_microbatches)
    assert len(trainer.hm.packs) == 3
    assert moved["h2d/weights"] == trainer.plan.predicted_bytes["h2d/weights"]
    assert moved == trainer.plan.predicted_bytes
    # the first packs come in for the forward and again for the recompute + backward; the last
    # pack runs forward, loss and backward as one task: its weights come in once
    last = len(trainer.hm.packs) - 1
    expected = sum(_weight_bytes(p, trainer) * (1 if p == last else 2) for p in range(last + 1))
    assert moved["h2d/weights"] == expected
    # every pack's weight gradients leave the device once, summed over the microbatches
    assert moved["d2h/wgrad"] == sum(_weight_bytes(p, trainer) for p in range(last + 1))


def test_grouping_weight_traffic_does_not_grow_with_microbatches():
    moved = {m: _grouping_run(True, m)[1] for m in (1, 4, 16)}
    assert moved[1]["h2d/weights"] == moved[4]["h2d/weights"] == moved[16]["h2d/weights"] > 0
    assert moved[1]["d2h/wgrad"] == moved[4]["d2h/wgrad"] == moved[16]["d2h/wgrad"] > 0


@pytest.mark.parametrize("num_microbatches", [1, 4, 16])
def test_without_grouping_weight_traffic_is_per_microbatch(num_microbatches):
    trainer, moved, _, _ = _grouping_run(False, num_microbatches)
    grouped = _grouping_run(True, 1)[1]
    assert moved["h2d/weights"] == num_microbatches * grouped["h2d/weights"]
    assert moved["d2h/wgrad"] == num_microbatches * grouped["d2h/wgrad"]
    assert moved == trainer.plan.predicted_bytes
    # activations do not depend on grouping
    assert moved["h2d/act"] == _grouping_run(True, num_microbatches)[1]["h2d/act"]


def _eager_grouping_reference():
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=10)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))
    loss = F.cross_entropy(model(x), target)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return loss.detach(), [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("num_microbatches", [1, 4, 16])
def test_grouped_trainer_step_equals_eager(num_microbatches):
    _, _, loss, params = _grouping_run(True, num_microbatches)
    ref_loss, ref_params = _eager_grouping_reference()
    assert_same_result(loss, ref_loss, params, ref_params, RTOL, ATOL)


def test_ungrouped_trainer_step_with_one_microbatch_equals_eager():
    _, _, loss, params = _grouping_run(False, 1)
    ref_loss, ref_params = _eager_grouping_reference()
    assert_same_result(loss, ref_loss, params, ref_params, RTOL, ATOL)


@pytest.mark.parametrize("num_microbatches", [4, 16])
def test_ungrouped_trainer_step_with_microbatches_equals_eager(num_microbatches):
    trainer, _, loss, params = _grouping_run(False, num_microbatches)
    ref_loss, ref_params = _eager_grouping_reference()
    assert_same_result(loss, ref_loss, params, ref_params, RTOL, ATOL)
    updates = [a.pack for a in trainer.hm.forward_actions + trainer.hm.backward_actions if a.kind == ActionKind.UPDATE]
    num_groups = len(trainer.hm.update_groups())
    assert len(updates) == num_groups  # one update per group and iteration


def test_ungrouped_trainer_with_clipping_and_microbatches_equals_eager():
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=10)
    reference = copy.deepcopy(model)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, (x, target), microbatches=4,
                                 grouping=False, max_grad_norm=CLIP, pack_boundaries=GROUPING_BOUNDARIES)
    try:
        loss = trainer.step((x, target))
    finally:
        trainer.close()
    ref_loss = F.cross_entropy(reference(x), target)
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------- LR schedulers


@pytest.mark.parametrize("clip", [None, CLIP], ids=["noclip", "clip"])
def test_step_lr_scheduler_matches_eager(clip):
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=6)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 16, generator=generator)
    target = torch.randint(0, 10, (16,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, (x, target), max_grad_norm=clip,
                                 pack_boundaries=(0, 2, 4))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, step_size=2, gamma=0.5)
    lrs = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(6):
                loss = trainer.step((x, target))
                scheduler.step()
                ref_optimizer.zero_grad()
                ref_loss = F.cross_entropy(reference(x), target)
                ref_loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
                ref_optimizer.step()
                ref_scheduler.step()
                lrs.append(scheduler.get_last_lr()[0])
                assert scheduler.get_last_lr() == ref_scheduler.get_last_lr()
                assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"]
                torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
                for param, ref in zip(model.parameters(), reference.parameters()):
                    torch.testing.assert_close(param.detach(), ref.detach(), rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"after step {step}: {m}")
        # the Trainer steps the optimizer itself: no "lr_scheduler.step() before optimizer.step()"
        assert not [w for w in caught if "lr_scheduler" in str(w.message)]
        assert lrs == pytest.approx([0.2, 0.1, 0.1, 0.05, 0.05, 0.025])
    finally:
        trainer.close()


# ---------------------------------------------------------------------- per-pack updates


class RecordingSGD(torch.optim.SGD):
    """Records, for every ``step``, the parameters it was given and the thread it ran on; its step is
    SGD's, each parameter's own update, as it says."""

    harmony_steps_per_parameter = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], str]] = []

    def step(self, closure=None):
        ids = [id(p) for group in self.param_groups for p in group["params"]]
        self.calls.append((ids, threading.current_thread().name))
        return super().step(closure)


@functools.lru_cache(maxsize=None)
def _update_setup():
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=6)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))
    need = eager_training_bytes(model, (x,), lambda out: F.cross_entropy(out, target))
    return model.state_dict(), x, target, need // 2  # several packs (a quarter does not fit this model)


def _update_trainer(clip, monkeypatch):
    state, x, target, budget = _update_setup()
    model = MLPChain(width=32, depth=6)
    model.load_state_dict(state)
    reference = copy.deepcopy(model)
    optimizer = RecordingSGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, (x, target), max_grad_norm=clip,
                                 memory_budget=budget)
    log: list[tuple[str, int]] = []
    original_bwd, original_update = Runtime.bwd, Runtime.update

    def bwd(self, pack_index, mb):
        log.append(("bwd", pack_index))
        return original_bwd(self, pack_index, mb)

    def update(self, pack_index, *copies):
        log.append(("update", pack_index))
        return original_update(self, pack_index, *copies)

    monkeypatch.setattr(Runtime, "bwd", bwd)
    monkeypatch.setattr(Runtime, "update", update)
    return model, reference, optimizer, trainer, x, target, log


def test_updates_run_per_pack_during_the_backward(monkeypatch):
    model, reference, optimizer, trainer, x, target, log = _update_trainer(None, monkeypatch)
    try:
        num_packs = len(trainer.hm.packs)
        assert num_packs >= 3
        assert "UPDATE" in repr(trainer.hm.backward_actions)
        assert "rt.update(" in trainer.code
        # the last pack's forward, loss and backward are one task: its update is in the forward program
        actions = trainer.hm.forward_actions + trainer.hm.backward_actions
        updates = [a for a in actions if a.kind == ActionKind.UPDATE]
        groups = trainer.hm.update_groups()
        assert sorted(a.pack for a in updates) == sorted(groups)  # one update per group
        assert len([a for a in trainer.hm.backward_actions if a.kind == ActionKind.UPDATE]) >= 2
        assert len(updates) >= 3
        # statically: the update of pack p comes before the backward of pack p - 1
        for update in updates:
            later_bwd = [i for i, a in enumerate(actions) if a.kind == ActionKind.BWD and a.pack < update.pack]
            if later_bwd:
                assert actions.index(update) < min(later_bwd)

        loss = trainer.step((x, target))
        # dynamically: each update was issued before the backward of the packs before it
        for index, (what, pack) in enumerate(log):
            if what == "update" and pack > 0:
                assert ("bwd", pack - 1) in log[index + 1:], f"update of p{pack} came after p{pack - 1}'s backward"
        assert [p for what, p in log if what == "update"] == sorted(groups, reverse=True)

        # one optimizer step per group of parameters, on the update thread, covering each parameter once
        assert len(optimizer.calls) == len(groups)
        seen: list[int] = []
        for (ids, thread), pack in zip(optimizer.calls, sorted(groups, reverse=True)):
            assert ids == [id(p) for p in groups[pack]]
            assert thread != threading.current_thread().name
            seen += ids
        assert sorted(seen) == sorted(id(p) for p in model.parameters())

        # and the result is the one full optimizer.step() gives
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        ref_loss = F.cross_entropy(reference(x), target)
        ref_loss.backward()
        ref_optimizer.step()
        assert_same_result(loss, ref_loss, model.parameters(), reference.parameters(), RTOL, ATOL)
    finally:
        trainer.close()


def test_clipping_updates_after_the_backward(monkeypatch):
    model, _, optimizer, trainer, x, target, log = _update_trainer(1.0, monkeypatch)
    try:
        assert len(trainer.hm.packs) >= 3
        actions = trainer.hm.forward_actions + trainer.hm.backward_actions
        assert not [a for a in actions if a.kind == ActionKind.UPDATE]
        assert "UPDATE" not in repr(actions)
        assert "rt.update(" not in trainer.code
        trainer.step((x, target))
        assert not [entry for entry in log if entry[0] == "update"]
        assert [entry for entry in log if entry[0] == "bwd"]
        # one step over every parameter, after the backward, on the caller's thread
        assert len(optimizer.calls) == 1
        ids, thread = optimizer.calls[0]
        assert sorted(ids) == sorted(id(p) for p in model.parameters())
        assert thread == threading.current_thread().name
    finally:
        trainer.close()


def test_an_update_error_reaches_the_caller():
    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("optimizer exploded")

    state, x, target, budget = _update_setup()
    model = MLPChain(width=32, depth=6)
    model.load_state_dict(state)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, Failing(model.parameters(), lr=0.1), (x, target),
                                 memory_budget=budget)
    try:
        with pytest.raises(RuntimeError, match="optimizer exploded"):
            trainer.step((x, target))
    finally:
        trainer.close()


# ---------------------------------------------------------------------- learning a task


def _previous_token_loss(logits, target):
    # position 0 has no previous token: leave it out
    return F.cross_entropy(logits[:, 1:].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores (which run has it: tests/tiers.py)
def test_small_gpt_learns_to_copy_the_previous_token_under_a_quarter_budget(memory_witness):
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_embd=32, dropout=0.0)
    torch.manual_seed(0)
    model = TinyGPT(config)
    generator = torch.Generator().manual_seed(1)

    def batch():
        idx = torch.randint(0, config.vocab_size, (16, config.block_size), generator=generator)
        return idx, torch.roll(idx, 1, dims=1)

    idx, target = batch()
    budget = eager_training_bytes(model, (idx,), lambda out: _previous_token_loss(out, target)) // 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = harmony_fx.Trainer(model, _previous_token_loss, optimizer, (idx, target), memory_budget=budget,
                                 microbatches=2)
    try:
        assert len(trainer.hm.packs) >= 3
        losses = [trainer.step(batch()).item() for _ in range(150)]
        assert memory_witness.peak_of(trainer.hm.devices[0]) <= budget
    finally:
        trainer.close()
    assert losses[0] > 3.5  # about log(64) at the start
    assert sum(losses[-5:]) / 5 < 0.1
    # the model's own (host) parameters learned it: eager on fresh data
    idx, target = batch()
    with torch.no_grad():
        assert _previous_token_loss(model(idx), target).item() < 0.1


# ---------------------------------------------------------------------- argument checks


def _small():
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=2)
    return model, torch.randn(4, 8), torch.randint(0, 10, (4,))


def test_optimizer_over_another_models_parameters_is_refused():
    model, x, target = _small()
    other = MLPChain(width=8, depth=2)
    with pytest.raises(ValueError, match="neither the model.s nor its loss_fn.s"):
        harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(other.parameters(), lr=0.1), (x, target))


def test_no_optimizer_is_refused_saying_what_to_pass():
    """``Trainer(model, loss_fn, None, ...)`` failed on an AttributeError inside the Trainer."""
    model, x, target = _small()
    with pytest.raises(TypeError, match=r"steps an optimizer .* got None.* use harmony_fx.compile"):
        harmony_fx.Trainer(model, F.cross_entropy, None, (x, target))


def test_optimizer_with_one_foreign_parameter_is_refused():
    model, x, target = _small()
    stray = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [stray]}], lr=0.1)
    with pytest.raises(ValueError, match="1 parameter"):
        harmony_fx.Trainer(model, F.cross_entropy, optimizer, (x, target))


@pytest.mark.parametrize("bad", ["tensor", "triple", "single"])
def test_example_batch_that_is_not_inputs_and_target_is_refused(bad):
    model, x, target = _small()
    batch = {"tensor": x, "triple": (x, target, target), "single": (x,)}[bad]
    with pytest.raises(ValueError, match=r"\(inputs, target\)"):
        harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), batch)


def test_step_with_a_batch_that_is_not_inputs_and_target_is_refused():
    model, x, target = _small()
    trainer = harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), (x, target))
    try:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"\(inputs, target\)"):
            trainer.step(x)
        with pytest.raises(ValueError, match=r"\(inputs, target\)"):
            trainer.step((x, target, target))
        assert trainer.step_count == 0
        for param, old in zip(model.parameters(), before):
            assert torch.equal(param.detach(), old)
        trainer.step((x, target))  # and a good batch still works
        assert trainer.step_count == 1
    finally:
        trainer.close()


def test_unknown_loss_reduction_is_refused():
    model, x, target = _small()
    with pytest.raises(ValueError, match="loss_reduction"):
        harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), (x, target),
                           loss_reduction="max")


def test_the_undo_copies_are_written_into_the_same_memory_every_step():
    """Cloning every parameter and optimizer state each step faulted in fresh pages: about twice the
    cost of copying into what the last step's copies used (benchmarks: the undo copy per step)."""
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    trainer = harmony_fx.Trainer(model, F.cross_entropy, torch.optim.AdamW(model.parameters()), (x, y),
                                 pack_boundaries=(0, 2))
    try:
        trainer.step((x, y))
        trainer.step((x, y))  # the first step's copies made the memory; this one writes into it
        first = {key: (data.data_ptr(), {k: v.data_ptr() for k, v in state.items() if torch.is_tensor(v)})
                 for key, (data, state) in trainer._undo_store.items()}
        trainer.step((x, y))
        again = {key: (data.data_ptr(), {k: v.data_ptr() for k, v in state.items() if torch.is_tensor(v)})
                 for key, (data, state) in trainer._undo_store.items()}
        assert first == again and len(first) == len(list(model.parameters()))
    finally:
        trainer.close()


def _storage_bytes(tensors) -> dict[int, int]:
    """The distinct storages of ``tensors``: data pointer -> bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _live_host_tensors() -> list[torch.Tensor]:
    """Every live plain host tensor (gradients are such: type(), not isinstance, as some module
    objects warn when their __class__ is looked up, and compiled graphs keep fake and meta tensors)."""
    gc.collect()
    return [t for t in gc.get_objects() if type(t) is torch.Tensor and t.device.type == "cpu"]


def _live_bytes_shaped_as(params, besides, earlier: dict[int, weakref.ref]) -> int:
    """Bytes of the live host tensors of a parameter's shape and dtype, each storage once, but for
    the storages of ``besides`` and the tensors ``earlier`` (id -> weakref: alive before the
    trainer, other tests' leftovers). In a function, so that no list of them outlives the count."""
    shapes = {(p.shape, p.dtype) for p in params}
    not_counted = _storage_bytes(besides)
    return sum(_storage_bytes(t for t in _live_host_tensors() if (t.shape, t.dtype) in shapes
                              and not (id(t) in earlier and earlier[id(t)]() is t)
                              and t.untyped_storage().data_ptr() not in not_counted).values())


@pytest.mark.parametrize("atomic", [True, False])
def test_one_set_of_host_gradients_serves_every_step(atomic, monkeypatch):
    """Each step's weight gradients land in the tensors that held the last step's: the host holds
    one set of gradients, not the last step's beside this one's. Counted here, over 3 steps of a
    4-pack model: every gradient an update stepped with that is still alive, while each update
    runs (the last one of a step sees them all); after each step, every live tensor of a
    parameter's shape that is no parameter (and no undo copy); and where ``.grad`` lives."""
    earlier = {id(t): weakref.ref(t) for t in _live_host_tensors()}
    trainer = four_pack_trainer(lambda params: torch.optim.SGD(params, lr=0.05), atomic=atomic)
    params = list(trainer.model.parameters())
    one_set = sum(p.numel() * p.element_size() for p in params)
    stepped_with: list[weakref.ref] = []  # every .grad an update read, as long as it lives
    alive_during_updates: list[int] = []

    def count_alive(params):  # on the update worker, after each pack's update
        stepped_with.extend(weakref.ref(p.grad) for p in params)
        alive = [grad for grad in (ref() for ref in stepped_with) if grad is not None]
        alive_during_updates.append(sum(_storage_bytes(alive).values()))

    after_each_pack_update(monkeypatch, count_alive)
    where_grads_live = []
    try:
        for x, target in regression_batches(3):
            trainer.step((x, target))
            copies = [data for data, _ in trainer._undo_store.values() if data is not None]
            assert _live_bytes_shaped_as(params, [*params, *copies], earlier) == one_set, "after a step"
            where_grads_live.append(sorted(_storage_bytes(p.grad for p in params)))
    finally:
        trainer.close()
    assert len(alive_during_updates) == 3 * len(FOUR_PACKS)
    assert max(alive_during_updates) == one_set
    assert where_grads_live[0] == where_grads_live[1] == where_grads_live[2]
    assert len(where_grads_live[0]) == len(params)


@pytest.mark.parametrize("devices", [None, ["host:0", "host:1"]], ids=["one-device", "data-parallel"])
def test_gradients_landing_in_last_steps_buffers_equal_eager(devices):
    """Losses, weights and every .grad over several steps equal eager's while each step's gradients
    are written into the last step's (two devices: each share of a gradient lands, one of them in
    the last step's tensor, and they are summed)."""
    options = {"devices": devices} if devices is not None else {}
    trainer = four_pack_trainer(**options)
    reference = four_pack_model()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    try:
        for step, (x, target) in enumerate(regression_batches(4)):
            loss = trainer.step((x, target))
            ref_optimizer.zero_grad()
            ref_loss = F.mse_loss(reference(x), target)
            ref_loss.backward()
            ref_optimizer.step()
            assert_same_result(loss, ref_loss, trainer.model.parameters(), reference.parameters())
            for param, ref in zip(trainer.model.parameters(), reference.parameters()):
                torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"a .grad after step {step}: {m}")
    finally:
        trainer.close()


def test_microbatch_weights_replace_the_graphs_and_must_be_one_per_microbatch():
    """A caller whose microbatches are its own batches adds their mean losses (weights of 1): the
    step is eager's sum of the halves' means; a weight count other than the microbatches' is
    refused before anything changes."""
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model)
    x, target = torch.randn(8, 16), torch.randint(0, 10, (8,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, (x, target), microbatches=2)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"microbatch_weights has 3 weight\(s\) for the batch's 2 microbatches"):
            trainer.step((x, target), microbatch_weights=[1.0, 1.0, 1.0])
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert trainer.microbatch_sizes((x, target)) == [4, 4]  # what the weights are given for
        assert trainer.microbatch_sizes((x[:6], target[:6])) == [3, 3]  # a batch of another size, planned
        loss = trainer.step((x, target), microbatch_weights=[1.0, 1.0])
    finally:
        trainer.close()
    expected = sum(F.cross_entropy(reference(half), labels) for half, labels in zip(x.chunk(2), target.chunk(2)))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    with torch.no_grad():
        for param in reference.parameters():
            param -= 0.1 * param.grad
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref)
