"""Every call means what eager means: what a captured graph bakes in (training flags, grad mode,
autocast, parameters, input shapes) is keyed on every call (``frontend.guards``), each against an
eager copy of the same model."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.frontend.guards import CallKey, attribute_facts
from harmony_fx.program.actions import ActionKind, KeyKind
from tests.helpers import RTOL, ATOL, assert_buffers_equal, assert_grads_equal

BOUNDARIES = (0, 3, 6)  # three packs, so the middle one is recomputed from its stash


def _drop_bn(seed: int = 0) -> nn.Module:
    """Dropout and BatchNorm: both compute differently in train and eval mode."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))


def _batch(size: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 16, generator=generator), torch.randint(0, 4, (size,), generator=generator)


def _pair(**options):
    model = _drop_bn()
    reference = copy.deepcopy(model)
    return model, reference, harmony_fx.compile(model, pack_boundaries=BOUNDARIES, **options)


def _step(module, model, optimizer, x, target, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # the same dropout masks in both
    optimizer.zero_grad()
    loss = F.cross_entropy(module(x), target)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _assert_params_equal(model: nn.Module, reference: nn.Module) -> None:
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------- train and eval


@pytest.mark.parametrize("first", ["train", "eval"])
def test_train_and_eval_in_either_order_equal_eager(first):
    model, reference, hm = _pair()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, target = _batch()
    order = ["train", "eval", "train"] if first == "train" else ["eval", "train", "eval", "train"]
    for step, mode in enumerate(order):
        hm.train(mode == "train")
        reference.train(mode == "train")
        assert hm.training == model.training == (mode == "train")
        if mode == "train":
            loss = _step(hm, model, optimizer, x, target, seed=step)
            ref_loss = _step(reference, reference, ref_optimizer, x, target, seed=step)
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        else:
            with torch.no_grad():
                out, ref_out = hm(x), reference(x)
                torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(hm(x), out)  # dropout off: the same twice
            # and a step in eval mode (frozen statistics, no dropout: fine-tuning), grad on
            loss = _step(hm, model, optimizer, x, target, seed=step)
            ref_loss = _step(reference, reference, ref_optimizer, x, target, seed=step)
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        _assert_params_equal(model, reference)
        assert_buffers_equal(model, reference)  # BatchNorm statistics updated in train mode only
    # train with grad, eval without, eval with; back to a state seen before: no new compile
    assert len(hm.variants) == 3
    hm.close()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_eval_loop_is_forward_only_and_equals_eager(mode):
    model, reference, hm = _pair(memory_budget=None)
    x, target = _batch()
    for module in (hm, reference):  # a training call first (its program stashes), statistics updated alike
        torch.manual_seed(0)
        F.cross_entropy(module(x), target).backward()
    hm.eval()
    reference.eval()
    buffers = [b.clone() for b in model.buffers()]
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        for seed in range(3):
            x = _batch(seed=seed)[0]
            torch.testing.assert_close(hm(x), reference(x), rtol=RTOL, atol=ATOL)
    for before, after in zip(buffers, model.buffers()):
        torch.testing.assert_close(before, after, rtol=0, atol=0)  # running statistics used, not updated
    forward_only = hm._last
    assert forward_only is not hm and forward_only.compiled.signature.forward_only
    forward, backward = forward_only.device_actions[0]
    assert backward == []
    # nothing but the model's output goes to the host, and no pack keeps a graph
    offloaded = {a.key.name for a in forward if a.kind == ActionKind.OFFLOAD and a.key.kind == KeyKind.ACT}
    assert offloaded == set(forward_only.signature.model_outputs)
    assert forward_only.stats.bytes_d2h == 8 * 4 * 4  # the (8, 4) fp32 logits, counted from the shape
    assert not any(a.kind == ActionKind.RECOMPUTE for a in forward)
    hm.close()


def test_a_training_call_under_no_grad_updates_batchnorm_statistics_once():
    model, reference, hm = _pair()
    x, _ = _batch()
    with torch.no_grad():
        torch.manual_seed(0)
        out = hm(x)
        torch.manual_seed(0)
        torch.testing.assert_close(out, reference(x), rtol=RTOL, atol=ATOL)
    assert_buffers_equal(model, reference)
    hm.close()


# ---------------------------------------------------------------------- parameters


def test_freezing_a_layer_after_compile_stops_its_gradient():
    model, reference, hm = _pair()
    hm.eval(), reference.eval()
    x, target = _batch()
    F.cross_entropy(hm(x), target).backward()
    F.cross_entropy(reference(x), target).backward()
    for module in (model, reference):
        module[0].requires_grad_(False)
        module.zero_grad()
    F.cross_entropy(hm(x), target).backward()
    F.cross_entropy(reference(x), target).backward()
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert_grads_equal(model, reference)
    hm.close()


def test_a_parameter_replaced_by_assignment_is_the_one_trained():
    model, reference, hm = _pair()
    hm.eval(), reference.eval()
    x, target = _batch()
    F.cross_entropy(hm(x), target).backward()
    for module in (model, reference):
        module[8].weight = nn.Parameter(torch.full_like(module[8].weight, 0.01))
        module.zero_grad()
    out = hm(x)
    ref_out = reference(x)
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    F.cross_entropy(out, target).backward()
    F.cross_entropy(ref_out, target).backward()
    assert model[8].weight.grad is not None
    assert_grads_equal(model, reference)
    hm.close()


# ---------------------------------------------------------------------- autocast


def _autocast_losses(hm_model, reference, x, target):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref_out = hm_model(x), reference(x)
        assert out.dtype == ref_out.dtype == torch.bfloat16
        loss, ref_loss = F.cross_entropy(out, target), F.cross_entropy(ref_out, target)
    loss.backward()
    ref_loss.backward()
    return loss, ref_loss


def test_autocast_around_the_forward_equals_eager_autocast_with_recompute():
    model, reference, hm = _pair()
    hm.eval(), reference.eval()  # deterministic: equal bitwise where eager is
    x, target = _batch()
    F.cross_entropy(hm(x), target).backward()  # compiled outside autocast first
    model.zero_grad()
    loss, ref_loss = _autocast_losses(hm, reference, x, target)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert_grads_equal(model, reference, rtol=0, atol=0)
    assert any(a.kind == ActionKind.RECOMPUTE for a in hm._last.backward_actions)
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
    hm.close()


def test_recompute_replays_the_forwards_autocast_not_the_backwards():
    model, reference, hm = _pair()
    hm.eval(), reference.eval()
    x, target = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(hm(x), target)
        ref_loss = F.cross_entropy(reference(x), target)
    # the backward (and so every recompute) runs with autocast off here
    loss.backward()
    ref_loss.backward()
    assert_grads_equal(model, reference, rtol=0, atol=0)
    hm.close()


def test_autocast_weight_cache_is_not_held_past_the_budget():
    # fp32 fits this budget with room to spare; autocast's cache of every pack's bf16 weights would not
    model = _drop_bn()
    model.eval()
    x, target = _batch()
    from tests.helpers import smallest_budget
    budget = smallest_budget(model, (x,), pack_boundaries=BOUNDARIES)
    hm = harmony_fx.compile(model, memory_budget=budget, pack_boundaries=BOUNDARIES, track_memory=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(hm(x), target)
    loss.backward()
    assert 0 < hm.stats.peak_bytes["host:0"] <= budget
    hm.close()


def test_backend_under_autocast_equals_eager_autocast():
    torch._dynamo.reset()
    model = _drop_bn().eval()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="harmony", options={"pack_boundaries": BOUNDARIES})
    x, target = _batch()
    try:
        loss, ref_loss = _autocast_losses(compiled, reference, x, target)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        assert_grads_equal(model, reference, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------------- shapes


def test_new_sequence_lengths_reuse_the_plan_that_fits():
    from harmony_fx.models import GPTConfig, TinyGPT
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=4, dropout=0.0))
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, memory_budget="2MiB", microbatches=2)
    for length in (32, 24, 16, 24):
        idx = torch.randint(0, 96, (4, length), generator=torch.Generator().manual_seed(length))
        model.zero_grad(), reference.zero_grad()
        hm(idx).sum().backward()
        reference(idx).sum().backward()
        assert_grads_equal(model, reference, rtol=1e-4, atol=1e-5)
        # the reused packing's peak is a bound: what the device held, counted by its tracker
        assert 0 < hm.stats.peak_bytes["host:0"] <= hm._last.plan.predicted_peak["host:0"] <= hm.budget
    modules = [module for _, module in hm.variants]
    assert len(modules) == 3  # 24 again found its program
    decisions = [list(module.passes)[-1].decision for module in modules[1:]]
    assert all("reused (it fits)" in d for d in decisions), decisions
    for module in modules[1:]:  # no packing searched, no FakeTensor run: every value is no larger
        stages = {stage.name: stage.decision for stage in module.passes}
        assert "plan packs" not in stages and "choose schedule" not in stages
        assert "its peak bounds this one's" in stages["reuse packs"]
    assert {len(m.packs) for m in modules} == {len(hm.packs)}
    # a longer call than any so far is checked in full (its values are larger)
    idx = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(0))
    small = harmony_fx.compile(model, (idx[:, :16],), memory_budget="2MiB", microbatches=2)
    small(idx).sum().backward()
    stages = {stage.name: stage.decision for stage in small._last.passes}
    assert "does not serve here (BudgetTooSmallError" in stages["guards"] and "planned afresh" in stages["guards"]
    assert "balanced" in stages["plan packs"]
    # where it still fits, the same packing is checked in full (lowered, run on FakeTensors) and kept
    fixed = harmony_fx.compile(model, (idx[:, :16],), pack_boundaries=(0, 2, 4), microbatches=2)
    fixed(idx).sum().backward()
    stages = {stage.name: stage.decision for stage in fixed._last.passes}
    assert "a value is larger here" in stages["reuse packs"] and "fixed: 3 pack(s)" in stages["plan packs"]
    assert "reused (it fits)" in stages["guards"]
    for module in (hm, small, fixed):
        module.close()


def test_a_batch_the_largest_calls_microbatches_cut_into_graphs_that_differ_is_planned_afresh():
    """After a batch of 5 in 2 microbatches, a batch of 3 cut as 2 and 1: a Llama's graph of one
    sample has other layers, and the packing of the batch of 5 indexed layers it has not (an
    internal split_packs error, where a fresh compile runs)."""
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    torch.manual_seed(0)
    model = build_hf_model("llama")
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, example_kwargs=hf_batch("llama", batch=4, seq=13), devices=["host:0"],
                            memory_budget="700KiB", microbatches=2)
    for batch in (5, 3):
        kwargs = hf_batch("llama", batch=batch, seq=13, seed=batch)
        torch.testing.assert_close(hm(**kwargs).loss, reference(**kwargs).loss, rtol=1e-5, atol=1e-6)
    stages = {stage.name: stage.decision for stage in hm._last.passes}
    assert "planned afresh" in stages["guards"]
    hm.close()


def test_the_key_sees_what_the_graph_bakes_in():
    model = _drop_bn()
    x = torch.randn(4, 16)
    key = CallKey.of(model, (x,), {})
    assert CallKey.of(model, (x.clone(),), {}) == key
    changed = []
    model.eval()
    changed.append(CallKey.of(model, (x,), {}))
    model.train()
    with torch.no_grad():
        changed.append(CallKey.of(model, (x,), {}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        changed.append(CallKey.of(model, (x,), {}))
    changed.append(CallKey.of(model, (torch.randn(4, 16, dtype=torch.float64),), {}))
    changed.append(CallKey.of(model, (x,), {"flag": True}))
    previous = torch.get_default_dtype()
    try:  # torch.arange(1.0) makes float64 now
        torch.set_default_dtype(torch.float64)
        changed.append(CallKey.of(model, (x,), {}))
    finally:
        torch.set_default_dtype(previous)
    model[1].running_mean = torch.zeros(32)
    changed.append(CallKey.of(model, (x,), {}))
    assert all(k != key for k in changed) and len(set(changed)) == len(changed)
    assert CallKey.of(model, (torch.randn(4, 16),), {}) == changed[-1]


def test_many_call_states_warn_once_with_what_to_do():
    model, _, hm = _pair()
    hm.eval()
    with torch.no_grad(), pytest.warns(UserWarning, match="pad_to_multiple_of") as caught:
        for size in range(2, 12):  # ten batch sizes: ten call states
            hm(torch.randn(size, 16))
    assert len([w for w in caught if "call states" in str(w.message)]) == 1
    hm.close()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, scale):
        return self.linear(x) * scale


def test_a_number_passed_in_that_changes_every_call_is_named_in_the_warning():
    """A Python number (a token count as an int, a diffusion sampler's timestep) is a constant of
    the graph: each value compiles anew, and the warning blamed the sequence length, or came only
    at the ninth call state. The third call in a row that compiles for a new value says so."""
    hm = harmony_fx.compile(_Scaled(), devices=["host:0"])
    x = torch.randn(2, 4)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for scale in (1, 2, 1, 2, 3, 4, 5):  # back to a value compiled before: no compile, the count starts again
            torch.testing.assert_close(hm(x, scale), hm.model.linear(x) * scale)
            if scale < 5:
                assert not any("calls compiled the model again" in str(w.message) for w in caught)
    early = [w for w in caught if "each of the last 3 calls compiled the model again" in str(w.message)]
    assert len(early) == 1 and "(4 -> 5; the graph holds it as a constant: pass a number" in str(early[0].message)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"the value of an input that is not a tensor.*0-dim tensor"):
        for scale in range(6, 11):
            hm(x, scale)
    hm.close()


class _Counting(nn.Module):
    """A forward that reads a step counter the training loop moves (a warm-up scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.step = 0

    def forward(self, x):
        return self.linear(x) * min(1.0, (self.step + 1) / 10)


def test_an_attribute_that_changes_every_call_computes_as_eager_and_is_named_in_the_warning():
    model = _Counting()
    hm, x = harmony_fx.compile(model, devices=["host:0"]), torch.randn(2, 4)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"_Counting.step: 2 -> 3.*a buffer updated in place") as caught:
        for step in range(10):
            model.step = step
            torch.testing.assert_close(hm(x), model.linear(x) * min(1.0, (step + 1) / 10))
    assert not any("pad_to_multiple_of" in str(w.message) for w in caught)
    hm.close()


def test_transformers_output_capturing_hooks_are_not_keyed():
    """transformers 5 installs forward hooks on the first call asking for hidden states and never
    removes them; they do nothing unless a call asks (the config flag, keyed). Keyed, turning the
    flag off again compiled a third time, and the log blamed "train mode"."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    hm, ids = harmony_fx.compile(model, devices=["host:0"]), torch.randint(0, 50, (2, 8))
    hm(input_ids=ids)
    model.config.output_hidden_states = True
    assert len(hm(input_ids=ids).hidden_states) == 2
    model.config.output_hidden_states = False
    assert hm(input_ids=ids).hidden_states is None
    modules = list({id(m): m for _, m in hm.variants}.values())
    assert len(modules) == 2 and "output_hidden_states: False -> True" in list(modules[1].passes)[-1].decision
    model.transformer.h[0].mlp.c_fc.weight.requires_grad_(False)  # not a training flag: said as it is
    hm(input_ids=ids)
    assert "the modules' parameters, buffers or hooks" in list(hm.variants[-1][1].passes)[-1].decision
    hm.close()


def test_the_module_methods_act_on_the_wrapped_model():
    model, _, hm = _pair()
    assert hm.eval() is hm and not model.training and not hm.training
    assert hm.train() is hm and model.training and all(m.training for m in model.modules())
    assert [p for p in hm.parameters()] == [p for p in model.parameters()]
    assert [n for n, _ in hm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(hm.state_dict()) == list(model.state_dict())
    assert hm.training is model.training and hm._modules is model._modules  # the model's own attributes
    with pytest.raises(AttributeError, match="exists after the first call"):
        hm.plan


@pytest.mark.parametrize("parallel", ["dp", "pp"])
def test_forward_only_on_two_devices_equals_eager(parallel):
    model, reference, _ = _pair()
    model.eval(), reference.eval()
    hm = harmony_fx.compile(model, devices=["host:0", "host:1"], parallel=parallel, microbatches=2,
                            pack_boundaries=BOUNDARIES)
    x = _batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(hm(x), reference(x), rtol=RTOL, atol=ATOL)
    assert all(backward == [] for _, backward in hm.device_actions)
    hm.close()


# ---------------------------------------------------------------------- attribute facts (compiler.capture_cache's key)


class _Config:
    def __init__(self) -> None:
        self.rope = {"type": "linear", "factor": 2.0}


class _Held(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 4)
        self.config = _Config()
        self.act = lambda x: x

    def forward(self, x):
        return self.act(self.lstm(x)[0]) * self.config.rope["factor"]


@pytest.mark.parametrize("change", [
    lambda m: m.config.rope.update(factor=3.0),                              # in a dict in a held object
    lambda m: setattr(m, "act", lambda x: 2 * x),                            # a function replaced
    lambda m: setattr(m.lstm, "dropout", 0.5),                               # a submodule's number
])
def test_attribute_facts_see_what_the_forward_reads_beyond_the_call_key(change):
    model = _Held()
    before = attribute_facts(model)
    assert attribute_facts(model) == before
    change(model)
    assert attribute_facts(model) != before


def test_attribute_facts_stay_through_a_training_step():
    """An LSTM lists its parameters in a plain attribute: their values are no part of the graph
    (each step's in-place update must not change the facts)."""
    model = _Held()
    before = attribute_facts(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 2, 4)).sum().backward()
    optimizer.step()
    assert attribute_facts(model) == before
    with torch.inference_mode():
        model.constant = torch.ones(2)  # an inference tensor keeps no version counter
    hash(attribute_facts(model))


def test_a_forward_hook_added_after_compiling_runs_and_removed_stops():
    """A hook added after the first call (to read or change a layer's output) is part of the
    forward the next call captures; removed, the first program runs again."""
    model, reference, hm = _pair()
    model.eval(), reference.eval()
    x, _ = _batch()
    with torch.no_grad():
        hm(x)
        handles = [m[0].register_forward_hook(lambda module, args, output: output * 0.5) for m in (model, reference)]
        torch.testing.assert_close(hm(x), reference(x), rtol=RTOL, atol=ATOL)
        for handle in handles:
            handle.remove()
        torch.testing.assert_close(hm(x), reference(x), rtol=RTOL, atol=ATOL)
    assert len(hm.variants) == 2


def test_a_forward_set_on_the_instance_after_compiling_runs():
    """accelerate's ``prepare`` sets ``model.forward`` to an autocast wrapper (here: one that halves
    the output): the graph captured before ran on, silently."""
    model, reference, hm = _pair()
    model.eval(), reference.eval()
    x, _ = _batch()
    with torch.no_grad():
        hm(x)
        for m in (model, reference):
            m.forward = lambda *args, m=m: type(m).forward(m, *args) * 0.5
        torch.testing.assert_close(hm(x), reference(x), rtol=RTOL, atol=ATOL)
    assert len(hm.variants) == 2


def test_a_backward_hook_added_after_compiling_is_refused_at_the_next_call():
    model, _, hm = _pair()
    x, target = _batch()
    F.cross_entropy(hm(x), target).backward()
    model[4].register_full_backward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="has a backward hook"):
        hm(x)


class _WithAnEmptySlot(nn.Module):
    """x-transformers leaves its blocks' optional norms None (``register_module(name, None)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_module("post_norm", None)

    def forward(self, x):
        x = self.lin(x)
        return x if self.post_norm is None else self.post_norm(x)


def test_a_child_slot_holding_none_is_keyed_as_eager_skips_it():
    """module_state walked ``_modules`` with its None entries: AttributeError at every call."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    model, reference = _WithAnEmptySlot(), _WithAnEmptySlot()
    reference.load_state_dict(model.state_dict())
    reference(x).square().mean().backward()
    harmony_fx.compile(model, devices=["host:0"])(x).square().mean().backward()
    assert_grads_equal(model, reference)
