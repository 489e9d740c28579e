"""Integration: ``harmony_fx.compile`` end to end against eager PyTorch (the public API and the numbers it promises)."""
from __future__ import annotations

import copy
import functools
import gc
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import harmony_fx
from harmony_fx.config import CompileOptions
from harmony_fx.models import MLPChain
from tests.helpers import (
    SEED, ZOO, assert_buffers_equal, assert_grads_equal, assert_step_equal, cached_train_step, eager_bytes,
    smallest_budget, train_step, train_step_equal,
)

FRACTIONS = (1.0, 0.5, 0.25)
CASES = [pytest.param(name, fraction, id=f"{name}-{fraction}") for name in ZOO for fraction in FRACTIONS]


# ---------------------------------------------------------------------- every zoo model x budget


@pytest.mark.parametrize("name,fraction", CASES)
def test_training_step_matches_eager(name, fraction):
    """Loss, every parameter gradient and every buffer (BatchNorm statistics updated exactly once)."""
    assert_step_equal(cached_train_step(name, fraction))


@pytest.mark.parametrize("name,fraction", CASES)
def test_measured_peak_within_budget(name, fraction):
    """The runtime's peak (whose tracker would raise past the budget) against an independent count."""
    result = cached_train_step(name, fraction)
    peak = result.hm.stats.peak_bytes[result.hm.devices[0].name]
    assert 0 < peak == result.witnessed_peak <= result.budget


@pytest.mark.parametrize("name,fraction", CASES)
def test_measured_bytes_equal_plan(name, fraction):
    hm = cached_train_step(name, fraction).hm
    assert hm.stats.bytes_h2d == hm.plan.bytes_h2d
    assert hm.stats.bytes_d2h == hm.plan.bytes_d2h
    assert hm.stats.as_dict()["bytes_by_kind"] == hm.plan.predicted_bytes
    assert hm.stats.bytes_h2d > 0 and hm.stats.bytes_d2h > 0


@pytest.mark.parametrize("name,fraction", CASES)
def test_predicted_peak_equals_measured(name, fraction):
    hm = cached_train_step(name, fraction).hm
    assert hm.plan.predicted_peak == hm.stats.peak_bytes


@pytest.mark.parametrize("name,fraction", CASES)
def test_generated_code_moves_data_between_packs(name, fraction):
    hm = cached_train_step(name, fraction).hm
    if fraction <= 0.5:
        # eager needs the whole model at once; half of that cannot hold it in one pack
        assert len(hm.packs) > 1
    if len(hm.packs) > 1:
        for op in ("rt.prefetch(", "rt.offload(", "rt.recompute("):
            assert op in hm.code, f"{op} missing from the code of a {len(hm.packs)}-pack program"
    else:
        assert "rt.recompute(" not in hm.code  # one pack keeps its graph from forward to backward


@pytest.mark.parametrize("name,fraction", CASES)
def test_device_holds_nothing_after_the_step(name, fraction):
    hm = cached_train_step(name, fraction).hm
    assert hm.devices[0].live_bytes() == 0


# ---------------------------------------------------------------------- several steps with an optimizer


@pytest.mark.parametrize("name", ["tiny_gpt", "small_cnn"])
def test_sgd_momentum_steps_match_eager(name):
    """Three steps of torch.optim.SGD(momentum) on the harmony model's own (host) parameters."""
    entry = ZOO[name]
    model, inputs, target = entry.build(0)
    reference, _, _ = entry.build(0)
    hm = harmony_fx.compile(model, inputs, memory_budget=eager_bytes(name) // 2)
    assert len(hm.packs) > 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        torch.manual_seed(SEED + step)
        loss = entry.loss_fn(hm(*inputs), target)
        loss.backward()
        optimizer.step()
        torch.manual_seed(SEED + step)
        ref_loss = entry.loss_fn(reference(*inputs), target)
        ref_loss.backward()
        ref_optimizer.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-7)
        assert_grads_equal(model, reference)
        for (pname, param), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.detach(), ref.detach(), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step}, {pname}: {m}")
        assert_buffers_equal(model, reference)


# ---------------------------------------------------------------------- calling conventions


@pytest.mark.parametrize("name", ["tiny_gpt", "small_cnn"])
def test_no_grad_call_matches_eager_and_leaves_no_grads(name):
    entry = ZOO[name]
    model, inputs, _ = entry.build(0)
    reference, _, _ = entry.build(0)
    hm = harmony_fx.compile(model, inputs, memory_budget=eager_bytes(name) // 2)
    with torch.no_grad():
        torch.manual_seed(SEED)
        out = hm(*inputs)
        torch.manual_seed(SEED)
        expected = reference(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)
    assert not out.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert_buffers_equal(model, reference)  # a forward in train mode updates BatchNorm statistics once
    assert hm.devices[0].live_bytes() == 0


class DictNet(nn.Module):
    """Returns a dict; ``mid`` (an inner block's output) is also consumed by later blocks."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks[:3]:
            x = block(x)
        mid = x
        for block in self.blocks[3:]:
            x = block(x)
        return {"logits": self.head(x), "mid": mid}


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h), h.sum(-1)


@functools.lru_cache(maxsize=None)
def _dict_net_setup():
    torch.manual_seed(0)
    model = DictNet()
    x = torch.randn(8, 16)
    target = torch.randint(0, 4, (8,))
    return model, x, target, smallest_budget(model, (x,))


def _compiled_dict_net():
    template, x, target, budget = _dict_net_setup()
    model, reference = DictNet(), DictNet()
    model.load_state_dict(template.state_dict())
    reference.load_state_dict(template.state_dict())
    hm = harmony_fx.compile(model, (x,), memory_budget=budget)
    assert len(hm.packs) > 1
    return hm, model, reference, x, target


def test_dict_output_keeps_its_structure():
    hm, model, reference, x, target = _compiled_dict_net()
    out = hm(x)
    expected = reference(x)
    assert isinstance(out, dict) and list(out) == ["logits", "mid"]
    for key in out:
        torch.testing.assert_close(out[key], expected[key], rtol=1e-5, atol=1e-7)
    F.cross_entropy(out["logits"], target).backward()
    F.cross_entropy(expected["logits"], target).backward()
    assert_grads_equal(model, reference)


def test_gradient_flows_into_an_output_that_later_packs_consume():
    hm, model, reference, x, target = _compiled_dict_net()

    def loss_fn(out):
        return F.cross_entropy(out["logits"], target) + out["mid"].pow(2).mean()

    loss_fn(hm(x)).backward()
    loss_fn(reference(x)).backward()
    assert_grads_equal(model, reference)


def test_tuple_output_keeps_its_structure():
    torch.manual_seed(0)
    model, reference = TupleNet(), TupleNet()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 8)
    hm = harmony_fx.compile(model, (x,))
    out, expected = hm(x), reference(x)
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    (out[0].square().sum() + out[1].sum()).backward()
    (expected[0].square().sum() + expected[1].sum()).backward()
    assert_grads_equal(model, reference)


def test_input_that_requires_grad_gets_eager_grad():
    entry = ZOO["mlp_chain"]
    model, (x,), target = entry.build(0)
    reference, _, _ = entry.build(0)
    x_harmony = x.clone().requires_grad_(True)
    x_eager = x.clone().requires_grad_(True)
    hm = harmony_fx.compile(model, (x_harmony,), memory_budget=eager_bytes("mlp_chain") // 2)
    assert len(hm.packs) > 1
    entry.loss_fn(hm(x_harmony), target).backward()
    entry.loss_fn(reference(x_eager), target).backward()
    assert x_harmony.grad is not None
    torch.testing.assert_close(x_harmony.grad, x_eager.grad, rtol=1e-5, atol=1e-7)
    assert_grads_equal(model, reference)


def test_call_with_another_feature_dim_asks_to_compile_again():
    # another batch size is planned anew (tests/test_errors.py); any other dim is baked in
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=2)
    hm = harmony_fx.compile(model, (torch.randn(4, 8),))
    with pytest.raises(ValueError, match="compile"):
        hm(torch.randn(4, 9))


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_missing_cuda_device_is_named():
    model = MLPChain(width=8, depth=2)
    with pytest.raises(ValueError, match="cuda:7"):
        harmony_fx.compile(model, (torch.randn(4, 8),), devices=["cuda:7"])


def test_unknown_device_kind_is_refused():
    model = MLPChain(width=8, depth=2)
    with pytest.raises(ValueError, match="gpu:0"):
        harmony_fx.compile(model, (torch.randn(4, 8),), devices=["gpu:0"])


def test_a_host_device_named_twice_is_refused():
    """It made two HostDevices of one name, each with the whole budget, and one key for their peaks."""
    model = MLPChain(width=8, depth=2)
    with pytest.raises(ValueError, match="'host:0' is named twice.*host:0, host:1"):
        harmony_fx.compile(model, (torch.randn(4, 8),), devices=["host:0", "host:0"])


# ---------------------------------------------------------------------- microbatches


@functools.lru_cache(maxsize=None)
def _microbatched_step():
    return train_step(ZOO["mlp_chain"], 0.5, microbatches=4)


def test_microbatched_step_matches_eager():
    result = _microbatched_step()
    assert result.hm.num_microbatches == 4
    assert_step_equal(result)
    assert result.witnessed_peak == result.hm.stats.peak_bytes[result.hm.devices[0].name] <= result.budget
    # input-batch grouping: the weights of each pack come in once for all microbatches
    weight_prefetches = [a for a in result.hm.forward_actions
                         if a.kind.name == "PREFETCH" and a.key.kind.name == "WEIGHTS"]
    assert len(weight_prefetches) == len(result.hm.packs)
    # under a budget too, the bytes moved are the plan's (tests/frontend/test_microbatch.py: fixed packs)
    assert result.hm.stats.as_dict()["bytes_by_kind"] == result.hm.plan.predicted_bytes


# ---------------------------------------------------------------------- errors in the middle of an iteration


def _out_of_memory_in_forward(hm, inputs) -> str:
    """Lower the device's cap so the forward runs out of memory part-way through; the error's text.

    Only the text is kept: the exception's traceback holds the frames, and so the device tensors, of
    the failed task until the garbage collector breaks the cycle.
    """
    tracker = hm.devices[0].tracker
    cap = tracker.cap
    tracker.cap = hm.plan.predicted_peak[hm.devices[0].name] // 2
    try:
        with pytest.raises(harmony_fx.DeviceOutOfMemoryError, match="forward") as info:
            hm(*inputs)
        message = str(info.value)
        del info
    finally:
        tracker.cap = cap
    gc.collect()
    return message


def test_out_of_memory_in_forward_loses_nothing():
    entry = ZOO["small_cnn"]
    model, inputs, _ = entry.build(0)
    hm = harmony_fx.compile(model, inputs, memory_budget=eager_bytes("small_cnn") // 2)
    assert len(hm.packs) > 1
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    message = _out_of_memory_in_forward(hm, inputs)
    assert "budget" in message
    assert all(p.grad is None for p in model.parameters())
    for before, after in zip(params, model.parameters()):
        assert torch.equal(before, after)
    for before, after in zip(buffers, model.buffers()):  # no BatchNorm statistics written back
        assert torch.equal(before, after)


def test_after_out_of_memory_the_next_step_is_clean():
    entry = ZOO["small_cnn"]
    model, inputs, target = entry.build(0)
    reference, _, _ = entry.build(0)
    hm = harmony_fx.compile(model, inputs, memory_budget=eager_bytes("small_cnn") // 2)
    _out_of_memory_in_forward(hm, inputs)
    assert hm.devices[0].live_bytes() == 0
    torch.manual_seed(SEED)
    entry.loss_fn(hm(*inputs), target).backward()
    torch.manual_seed(SEED)
    entry.loss_fn(reference(*inputs), target).backward()
    assert_grads_equal(model, reference)
    assert_buffers_equal(model, reference)
    assert hm.stats.peak_bytes == hm.plan.predicted_peak


# ---------------------------------------------------------------------- CUDA (skipped without a GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(ZOO))
def test_cuda_training_step_matches_eager(name):
    result = train_step_equal(ZOO[name], 0.5, devices=["cuda:0"])
    assert result.hm.stats.peak_bytes["cuda:0"] <= result.budget
    assert result.hm.stats.as_dict()["bytes_by_kind"] == result.hm.plan.predicted_bytes


def test_compiling_and_closing_leaves_no_thread_behind():
    """Nothing in a compile may start a thread that outlives the module (``fx.Interpreter``, for one,
    starts tqdm's monitor thread on its first run)."""
    import threading

    from tqdm import tqdm

    if tqdm.monitor is not None:  # started by an earlier test: stop it, so this one can see a new one
        tqdm.monitor.exit()
        tqdm.monitor.join()
        tqdm.monitor = None
    threads = set(threading.enumerate())
    torch.manual_seed(0)
    model, x = MLPChain(width=16, depth=4), torch.randn(8, 16)
    hm = harmony_fx.compile(model, (x,), devices=["host:0", "host:1"], microbatches=2)
    hm(x).sum().backward()
    hm.close()
    assert {t for t in threading.enumerate() if t.is_alive()} - threads == set()


@pytest.mark.parametrize("given, why", [
    ({}, r"the fastest schedule the planner simulated takes [\d.]+ ms and needs no more \(the largest packs that fit "
         r"simulate at [\d.]+ ms, no faster; the batch is already whole \(one microbatch\)\)"),
    ({"pack_boundaries": (0, 2)}, "pack_boundaries fixes the packs"),
    ({"microbatches": 2}, r"packed by the balanced policy with the microbatches given"),
])
def test_explain_says_why_a_plan_leaves_more_than_half_of_its_budget_unused(given, why):
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.models import MLPChain

    torch.manual_seed(0)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    model = MLPChain(width=32, depth=6)
    need = eager_training_bytes(model, (x,), lambda out: F.cross_entropy(out, y))
    hm = harmony_fx.compile(model, (x,), memory_budget=4 * need, **given)
    (line,) = [line for line in hm.explain().splitlines() if line.startswith("budget:")]
    peak = max(hm.plan.predicted_peak.values())
    assert 2 * peak <= hm.budget
    assert re.fullmatch(rf"budget: this plan uses .+ of .+: {why}.*", line), line
    tight = harmony_fx.compile(MLPChain(width=32, depth=6), (x,), memory_budget=need // 2)
    assert 2 * max(tight.plan.predicted_peak.values()) > tight.budget
    assert "budget:" not in tight.explain()  # a plan that uses its budget needs no excuse


def test_explain_says_nothing_of_the_budget_where_the_plan_uses_most_of_it():
    """The demo's GPT under a quarter of eager's memory. Until the planner measured what autograd
    keeps per layer, its estimate of its schedule was about twice the planning run's exact count,
    which left half the budget unused (and explain said why); now the plan uses most of it."""
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=6, n_head=4, n_embd=32, dropout=0.0)
    model = TinyGPT(config)
    idx = torch.randint(0, 64, (8, 32))
    need = eager_training_bytes(model, (idx,), lambda out: out.float().mean())
    hm = harmony_fx.compile(model, (idx,), memory_budget=need // 4)
    assert 2 * max(hm.plan.predicted_peak.values()) > hm.budget
    assert not [line for line in hm.explain().splitlines() if line.startswith("budget:")]


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_compiled_module_is_its_models_copy_compiled_the_same_way(how, tmp_path):
    """A teacher copy made from the compiled module (as from torch.compile's): it failed on the
    devices' locks. The copy holds its own weights and computes as the model's copy."""
    import copy as copying
    import io

    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    x = torch.randn(8, 16)
    hm = harmony_fx.compile(model, x, devices=["host:0"], pack_boundaries=[0, 2])
    if how == "deepcopy":
        copied = copying.deepcopy(hm)
    else:
        buffer = io.BytesIO()
        torch.save(hm, buffer)
        buffer.seek(0)
        # torch.load's default (weights_only=True) loads it with harmony's two classes allowed beside the
        # model's, as README says
        allowed = {type(module) for module in model.modules()} | {harmony_fx.HarmonyModule, CompileOptions}
        with torch.serialization.safe_globals(list(allowed)):
            copied = torch.load(buffer)
    assert copied.model is not model and copied.options == hm.options
    copied(x).square().mean().backward()
    hm(x).square().mean().backward()
    assert len(copied.packs) == len(hm.packs) == 2
    for param, original in zip(copied.model.parameters(), model.parameters()):
        assert param.data_ptr() != original.data_ptr()
        torch.testing.assert_close(param.grad, original.grad)


def test_an_ema_built_from_the_compiled_module_averages_evaluates_and_saves_as_eagers():
    """torchvision's reference train.py builds its EMA (an ``AveragedModel``) from the model it
    trains. When the compiled module was not an ``nn.Module``, the EMA's copy of it was a plain
    attribute: ``ema.eval()`` left it training (its BatchNorm evaluated on batch statistics) and
    ``ema.state_dict()`` held ``n_averaged`` alone, with no error. Now the copy is the EMA's
    submodule: it averages, evaluates (through harmony) and saves as an EMA of the eager model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"])
    x = torch.randn(4, 6)
    emas = []
    for trained in (hm, reference):
        trained(x).square().mean().backward()
        ema = torch.optim.swa_utils.AveragedModel(trained, use_buffers=True)
        ema.update_parameters(trained)
        emas.append(ema.eval())
    assert isinstance(emas[0].module, harmony_fx.HarmonyModule) and not emas[0].module.model.training
    assert emas[0].state_dict().keys() == emas[1].state_dict().keys()
    for key, value in emas[1].state_dict().items():
        torch.testing.assert_close(emas[0].state_dict()[key], value)
    with torch.no_grad():
        torch.testing.assert_close(emas[0](x), emas[1](x))
    assert "compiled" in emas[0].module._last.__dict__  # it ran harmony's program, not the model eagerly


def test_update_bn_of_an_ema_of_the_compiled_module_says_to_give_it_the_plain_model():
    """SWA's recipe after ``AveragedModel(hm)``: ``update_bn`` sets every BatchNorm's momentum to
    None (a cumulative average no graph holds): refused naming the plain model, which then gets
    eager's statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    loader = [torch.randn(4, 6) for _ in range(3)]
    ema, eager_ema = (torch.optim.swa_utils.AveragedModel(m) for m in (harmony_fx.compile(model), reference))
    with pytest.raises(harmony_fx.CaptureError, match=r"give update_bn the plain model \(hm\.model, or an "
                                                      r"AveragedModel's \.module\.model\)"):
        torch.optim.swa_utils.update_bn(loader, ema)
    for averaged in (ema.module.model, eager_ema):
        torch.optim.swa_utils.update_bn(loader, averaged)
    torch.testing.assert_close(ema.module.model[1].running_var, eager_ema.module[1].running_var)


class _Classifier(nn.Module):
    """An eager head over an encoder: compiled (``harmony_fx.compile(encoder)``) or not."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        encoder = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.encoder = harmony_fx.compile(encoder, devices=["host:0"], pack_boundaries=[0, 3]) if compiled else encoder
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def test_a_parent_module_trains_saves_and_evaluates_its_compiled_part_as_eager():
    """A compiled part held by a parent module (``self.encoder = harmony_fx.compile(encoder)``).
    When the compiled module was not an ``nn.Module`` the parent's ``parameters()``,
    ``state_dict()`` and ``eval()`` missed the part: an optimizer over the parent never trained it,
    with no error. Three SGD steps over the parent's parameters: each loss and every gradient as
    eager's; the parent's state_dict has eager's keys and values; eval reaches the part's BatchNorm;
    eager's state_dict loads into a compiled parent."""
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    parents = [_Classifier(compiled=True), _Classifier(compiled=False)]
    assert [name for name, _ in parents[0].named_parameters()] == [name for name, _ in parents[1].named_parameters()]
    optimizers = [torch.optim.SGD(parent.parameters(), lr=0.1, momentum=0.9) for parent in parents]
    for _ in range(3):
        losses = []
        for parent, optimizer in zip(parents, optimizers):
            loss = F.cross_entropy(parent(x), y)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
        for (name, param), (_, eager) in zip(parents[0].named_parameters(), parents[1].named_parameters()):
            torch.testing.assert_close(param.grad, eager.grad, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    states = [parent.state_dict() for parent in parents]
    assert list(states[0]) == list(states[1])
    for key, value in states[1].items():
        torch.testing.assert_close(states[0][key], value, msg=key)
    for parent in parents:
        parent.eval()
    assert not parents[0].encoder.training and not parents[0].encoder.model[1].training
    with torch.no_grad():
        torch.testing.assert_close(parents[0](x), parents[1](x))
    fresh = _Classifier(compiled=True)
    fresh.load_state_dict(states[1])
    torch.testing.assert_close(fresh.encoder.model[3].weight, parents[1].encoder[3].weight)
    torch.testing.assert_close(fresh.encoder.model[1].running_var, parents[1].encoder[1].running_var)


def test_a_parents_dtype_reaches_its_compiled_part_and_a_device_leaves_it_on_the_host():
    """``parent.double()`` converts the compiled part's weights (its next call compiles for them, as
    eager's double); ``parent.to(device)`` moves the parent's own weights and leaves the part's in
    host memory, where harmony keeps them (said)."""
    x = torch.randn(6, 8, dtype=torch.float64)
    compiled, eager = _Classifier(compiled=True).double().eval(), _Classifier(compiled=False).double().eval()
    assert compiled.encoder.model[0].weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x))
    with pytest.warns(UserWarning, match="a move to meta on a compiled model leaves its weights in host memory"):
        compiled.to("meta")
    assert compiled.head.weight.is_meta and compiled.encoder.model[0].weight.device.type == "cpu"


def test_update_bn_of_an_ema_of_a_parent_says_how_to_run_its_compiled_part_plainly():
    """``update_bn(loader, AveragedModel(parent))`` where the parent holds a compiled part: the
    refusal named ``hm.model`` or ``.module.model``, which a parent has not, and not that the
    refused ``update_bn`` leaves every BatchNorm's momentum None. Followed (the part's model in its
    place for the call, the momentum set back), the statistics and outputs are eager's."""
    torch.manual_seed(0)
    loader = [torch.randn(6, 8) for _ in range(3)]
    ema, eager_ema = (torch.optim.swa_utils.AveragedModel(_Classifier(compiled=c)) for c in (True, False))
    with pytest.raises(harmony_fx.CaptureError, match=r"leaves it None: set each BatchNorm's momentum back.*for a "
                                                      r"parent module holding a compiled part, put that part's \.model "
                                                      r"in its place for the call"):
        torch.optim.swa_utils.update_bn(loader, ema)
    compiled_part = ema.module.encoder
    ema.module.encoder = compiled_part.model
    torch.optim.swa_utils.update_bn(loader, ema)
    ema.module.encoder = compiled_part
    compiled_part.model[1].momentum = 0.1
    torch.optim.swa_utils.update_bn(loader, eager_ema)
    torch.testing.assert_close(compiled_part.model[1].running_var, eager_ema.module.encoder[1].running_var)
    assert compiled_part.model[1].momentum == eager_ema.module.encoder[1].momentum
    with torch.no_grad():
        torch.testing.assert_close(ema.eval()(loader[0]), eager_ema.eval()(loader[0]))


class _WithAux(nn.Module):
    """A flag its forward reads, set by scripts on the model they hold (torchvision's ``aux_logits``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.aux = nn.Linear(8, 8), nn.Linear(8, 8)
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return h + self.aux(h) if self.use_aux else h

    def describe(self) -> str:
        return f"aux={self.use_aux}"


def test_an_attribute_set_on_the_compiled_module_is_the_models():
    """``hm.use_aux = False`` was kept on the compiled module: read back through it as set, while
    the model's forward (captured on the first call) and its methods went on with the old value,
    and the outputs differed from eager's without a word. It is set on the model, as a read of
    ``hm.use_aux`` is the model's; a submodule set on it is the model's as before; del too."""
    torch.manual_seed(0)
    model = _WithAux()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=[0, 1])
    hm.use_aux, reference.use_aux = False, False
    assert model.use_aux is False and "use_aux" not in hm.__dict__ and hm.describe() == "aux=False"
    x = torch.randn(4, 8)
    hm(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert_grads_equal(model, reference)
    hm.extra = nn.Linear(2, 2)
    assert model.extra is hm.extra and "extra" in dict(hm.named_modules())
    hm.compile()  # nn.Module's own attribute (_compiled_call_impl) stays here: on the model, capturing it recursed
    assert model._compiled_call_impl is None
    hm(x.double().float()[:3]).square().mean().backward()  # another batch size: compiles the model again
    del hm.use_aux
    assert not hasattr(model, "use_aux")


def test_the_models_device_and_layers_are_read_through_the_compiled_module():
    """``hm.device`` was harmony's first device (a ``HostDevice``): a script's ``x.to(model.device)``,
    as Hugging Face examples write it, failed; ``hm.layers`` was the plan's layers where the model's
    own ``self.layers`` was meant. Both are the model's, as any other attribute."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    hm = harmony_fx.compile(transformers.GPT2LMHeadModel(config), devices=["host:0"])
    ids = torch.randint(0, 50, (2, 8))
    assert hm.device == torch.device("cpu") and hm(input_ids=ids.to(hm.device)).logits.shape == (2, 8, 50)
    assert hm.devices[0].name == "host:0"
    stack = nn.Sequential()
    stack.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    compiled = harmony_fx.compile(stack, devices=["host:0"])
    assert compiled.layers is stack.layers
    with pytest.raises(AttributeError):  # a module without one has none, as eager
        compiled.device


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels=None):
        out = self.proj(input_ids * attention_mask[..., None])
        return out if labels is None else F.cross_entropy(out.flatten(0, 1), labels.flatten())


def test_the_compiled_modules_forward_has_the_models_signature():
    """``inspect.signature(hm.forward)`` was ``(*args, **kwargs)``: transformers' ``Trainer(model=hm)``
    keeps only the dataset's columns the forward names, so it dropped every column and refused
    ("No columns in the dataset match the model's forward method signature"). It is the model's;
    ``hm.forward(...)`` still runs harmony."""
    torch.manual_seed(0)
    model = _Keywords()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"])
    assert list(inspect.signature(hm.forward).parameters) == ["input_ids", "attention_mask", "labels"]
    assert callable(harmony_fx.HarmonyModule.forward)
    x, mask, labels = torch.randn(4, 5, 8), torch.ones(4, 5), torch.randint(0, 3, (4, 5))
    hm.forward(input_ids=x, attention_mask=mask, labels=labels).backward()
    assert "compiled" in hm.__dict__
    reference(input_ids=x, attention_mask=mask, labels=labels).backward()
    assert_grads_equal(model, reference)


class _RenamedWeight(nn.Module):
    """A model that loads checkpoints of an older version, whose weight was called ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self._register_load_state_dict_pre_hook(self._rename)

    @staticmethod
    def _rename(state_dict: dict, prefix: str, *args) -> None:
        if prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_parents_load_state_dict_loads_its_compiled_part_as_the_model_loads_itself():
    """Through a parent, the compiled part's own loading runs the model's (its hooks, its class's
    ``_load_from_state_dict``): an old checkpoint's key is renamed as without harmony."""
    parent = nn.Sequential(harmony_fx.compile(_RenamedWeight(), devices=["host:0"]), nn.Linear(4, 2))
    old = {"0.w": torch.ones(4, 4), "1.weight": torch.zeros(2, 4), "1.bias": torch.zeros(2)}
    parent.load_state_dict(old)
    torch.testing.assert_close(parent[0].model.weight, torch.ones(4, 4))


def test_a_hook_registered_on_the_compiled_module_is_the_models():
    """The compiled module's ``__call__`` runs harmony's program, so a hook kept on it would never
    run: it goes on the model, where the next call's capture sees it."""
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=3)
    hm, x = harmony_fx.compile(model, devices=["host:0"]), torch.randn(4, 8)
    before = hm(x).detach()
    handle = hm.register_forward_hook(lambda module, args, out: out * 2)
    assert len(model._forward_hooks) == 1
    torch.testing.assert_close(hm(x), 2 * before)
    handle.remove()
    torch.testing.assert_close(hm(x), before)


class _WithChildCalledModel(nn.Module):
    """The shape of a Hugging Face ``LlamaForCausalLM``: a child called ``model``, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.lm_head = nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(x))


def test_the_names_the_compiled_module_lists_are_looked_up_in_the_model():
    """``named_modules()`` gives the model's names (``model.0``), but the compiled module's own
    ``model`` attribute shadowed the child of that name: ``get_submodule('model.0')`` raised, and so
    did PEFT's ``get_peft_model(hm)``, which finds each target by its name so. Each name listed is
    found, and a module set by name replaces the model's, which the next call captures."""
    torch.manual_seed(0)
    wrapped = _WithChildCalledModel()
    reference = copy.deepcopy(wrapped)
    hm, x = harmony_fx.compile(wrapped, devices=["host:0"]), torch.randn(4, 8)
    for name, module in hm.named_modules():
        assert hm.get_submodule(name) is (hm if name == "" else module)
    for name, param in hm.named_parameters():
        assert hm.get_parameter(name) is param
    hm.set_submodule("model.0", nn.Linear(8, 8))
    reference.model[0] = copy.deepcopy(wrapped.model[0])
    hm(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert_grads_equal(wrapped, reference)


def test_a_forward_set_on_the_compiled_module_is_refused_naming_the_models():
    """accelerate's ``prepare`` with mixed precision sets an autocast ``forward`` on the module it
    is given; on the compiled module it would never run (nor the autocast): refused, saying where
    to set it and in which order to prepare and compile."""
    hm = harmony_fx.compile(MLPChain(width=8, depth=2), devices=["host:0"])
    with pytest.raises(TypeError, match=r"hm\.model\.forward = .*prepare the model first, then compile it"):
        hm.forward = lambda x: x


def test_a_flop_counter_around_calls_counts_eagers_flops_and_compiles_nothing_more():
    """``FlopCounterMode`` (Lightning's model summary) around a call: it counted the compile's
    FakeTensor runs and the host's calibration (8.5x eager's flops), and its module tracker's global
    hooks changed the call's key, so every new counter compiled again. Compiling runs outside the
    caller's dispatch modes, and the tracker's hooks are not keyed."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, x = MLPChain(width=16, depth=3), torch.randn(4, 16)
    with FlopCounterMode(display=False) as eager:
        model(x)
    hm = harmony_fx.compile(model, devices=["host:0"])
    for _ in range(2):  # the first call compiles, the second runs the program
        with FlopCounterMode(display=False) as counted:
            hm(x)
        assert counted.get_total_flops() == eager.get_total_flops()
    assert len(hm.variants) == 1


def test_a_compiled_module_given_to_harmony_again_is_refused_naming_its_model():
    """As the model, or as a part of it, of ``compile`` and ``Trainer``: capturing would run its
    own program on FakeTensors."""
    hm = harmony_fx.compile(MLPChain(width=8, depth=2), devices=["host:0"])
    parent = nn.Sequential(hm, nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with pytest.raises(TypeError,
                       match=r"compiled already \(a HarmonyModule\): give it that module's model, hm\.model"):
        harmony_fx.compile(hm)
    with pytest.raises(TypeError, match=r"the module '0' of Sequential is a harmony_fx compiled module"):
        harmony_fx.compile(parent, (x,))
    with pytest.raises(TypeError, match=r"the module '0' of Sequential is a harmony_fx compiled module"):
        harmony_fx.Trainer(parent, F.mse_loss, torch.optim.SGD(parent.parameters(), lr=0.1), (x, torch.randn(4, 2)))


def test_a_compiled_module_set_on_its_own_model_is_refused_at_the_next_call():
    """``model.compiled = hm`` makes the model hold itself (the compiled module shares its
    submodules): the next call's key walked the cycle until memory ran out (15 GB in a Lightning
    module keeping its strategy's compiled step). The walks stop at a module seen before, and
    the compile the changed model needs refuses, saying what to do."""
    model = MLPChain(width=8, depth=2)
    hm, x = harmony_fx.compile(model, devices=["host:0"]), torch.randn(4, 8)
    hm(x)
    model.compiled = hm
    with pytest.raises(TypeError, match=r"'compiled' of MLPChain is that model's own compiled module.*del model"):
        hm(x)


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


@pytest.mark.parametrize("around", ["set_detect_anomaly", "non-reentrant checkpoint"])
def test_a_call_that_compiles_inside_the_callers_autograd_contexts_trains_like_eager(around):
    """Compiling runs the forward on FakeTensors many times: under anomaly mode every compile failed
    (its checks read values), and a non-reentrant checkpoint around the call counted those runs'
    saved tensors as the call's (its recompute raised CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    pre, model = nn.Linear(16, 16), _Small()
    reference_pre, reference = copy.deepcopy(pre), copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"])  # compiled on its first call, inside the context
    for length in (8, 12):  # the second length compiles again
        x = torch.randn(length, 16)
        if around == "set_detect_anomaly":
            with torch.autograd.set_detect_anomaly(True):
                hm(pre(x)).pow(2).mean().backward()
            assert torch.is_anomaly_enabled() is False
        else:
            checkpoint(hm, pre(x), use_reentrant=False).pow(2).mean().backward()
        reference(reference_pre(x)).pow(2).mean().backward()
    for param, expected in zip([*pre.parameters(), *model.parameters()],
                               [*reference_pre.parameters(), *reference.parameters()]):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-6)


def test_forward_is_the_compiled_call_and_the_module_prints_its_model():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=[0, 2])
    x = torch.randn(8, 16)
    hm.forward(x).square().mean().backward()  # a script's model.forward(x): it ran the bare model eagerly
    assert len(hm.packs) == 2
    reference(x).square().mean().backward()
    assert_grads_equal(model, reference)
    assert repr(hm).startswith("HarmonyModule(\n  (model): MLPChain(") and "Linear(in_features=16" in repr(hm)


@pytest.mark.parametrize("chain", [
    lambda m: m.to("cpu"), lambda m: m.cpu(), lambda m: m.float(), lambda m: m.requires_grad_(True),
    lambda m: m.apply(lambda module: None), lambda m: m.to(torch.device("cpu"), non_blocking=True),
], ids=["to(cpu)", "cpu()", "float()", "requires_grad_()", "apply(fn)", "to(device, non_blocking)"])
def test_a_models_chained_method_returns_the_compiled_module(chain):
    """``model = model.to(device)`` (minGPT's Trainer) and ``hm.float()`` returned the bare model,
    which then trained eagerly, outside harmony and its budget; they return the compiled module."""
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=[0, 2])
    assert chain(hm) is hm
    hm(x).square().mean().backward()
    assert len(hm.packs) == 2  # harmony ran it
    reference(x).square().mean().backward()
    assert_grads_equal(model, reference)


def test_moving_a_compiled_model_to_a_device_keeps_its_weights_on_the_host_and_says_so():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    hm = harmony_fx.compile(model, devices=["host:0"])
    for move in (lambda: hm.to("cuda:0"), lambda: hm.cuda(), lambda: hm.to("cuda", torch.float64)):
        with pytest.warns(UserWarning, match="leaves its weights in host memory"):
            assert move() is hm
        assert all(param.device.type == "cpu" for param in model.parameters())
    assert all(param.dtype == torch.float64 for param in model.parameters())  # the dtype part is done


def test_a_dtype_conversion_compiles_again_for_the_new_weights():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model).double()
    x = torch.randn(8, 16)
    hm = harmony_fx.compile(model, x, devices=["host:0"])
    hm = hm.to(torch.float64)
    assert hm.model is model
    out = hm(x.double())
    assert out.dtype == torch.float64
    out.square().mean().backward()
    reference(x.double()).square().mean().backward()
    assert_grads_equal(model, reference)


class _PaddedConvs(nn.Module):
    """Its first op (a pad) saves nothing of the input: eager's backward never reads it again."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 3, 1)

    def forward(self, x):
        return self.third(torch.relu(self.second(torch.relu(self.first(F.pad(x, (1, 1, 1, 1), mode="reflect"))))))


def test_an_input_changed_in_place_between_the_forward_and_backward_is_refused_not_read_again():
    """fast_neural_style's loop divides its batch in place after the forward (``x.div_(255)``):
    harmony's backward recomputes the first pack from the caller's tensor, and computed gradients of
    the divided values, silently. Refused as autograd refuses a saved tensor changed in place; a
    change after backward() is the caller's own."""
    torch.manual_seed(0)
    model = _PaddedConvs()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=[0, 2, 4])
    x = torch.rand(2, 3, 8, 8)
    out = hm(x)
    x.div_(255.0)
    with pytest.raises(RuntimeError, match=r"input 'x' was modified by an in-place operation after the forward"):
        out.square().mean().backward()
    model.zero_grad()
    hm(x).square().mean().backward()
    x.mul_(255.0)  # after backward: nothing reads it again
    reference(x / 255.0).square().mean().backward()
    assert_grads_equal(model, reference)


class _ExpandedOutput(nn.Module):
    def __init__(self, frames: bool = False) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.frames = frames

    def forward(self, x):
        h = self.second(torch.relu(self.first(x)))
        if self.frames:  # frames of 2 with a hop of 1: neighbours share an element
            return h.unfold(1, 2, 1)
        return h[:, None].expand(-1, 3, -1)  # stride 0 along dim 1


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("frames", [False, True], ids=["expand", "unfold"])
def test_an_output_whose_elements_share_memory_trains_like_eager(microbatches, frames):
    """The output's gradient was laid out with the output's own strides: stride 0 made copy_ refuse
    to write ("more than one element ... refers to a single memory location"), and overlapping
    frames kept one write of each shared element (gradients off by 6, silently). A gradient has an
    entry for each element: laid out dense."""
    torch.manual_seed(0)
    model = _ExpandedOutput(frames)
    reference = copy.deepcopy(model)
    x, weights = torch.randn(4, 4), torch.randn(4, 3, 2 if frames else 4)
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=[0, 1], microbatches=microbatches)
    (hm(x) * weights).sum().backward()
    (reference(x) * weights).sum().backward()
    assert_grads_equal(model, reference)


def test_torch_compile_around_a_compiled_module_runs_it_as_it_is():
    """nanoGPT's compile=True after harmony_fx.compile: Dynamo traced into harmony's own compile and
    failed on a FakeTensor device mismatch; it runs the module as it is, in a compiled step too."""
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=[0, 2])
    step = torch.compile(lambda x: hm(x).square().mean())
    x = torch.randn(8, 16)
    step(x).backward()
    reference(x).square().mean().backward()
    assert_grads_equal(model, reference)
    assert len(hm.packs) == 2


def test_a_parameter_changed_in_place_between_the_forward_and_backward_is_refused():
    """An EMA or optimizer step before backward(): a recomputed pack reads the new weights, and the
    gradient was of another function than the forward's (eager keeps what exp saved), silently."""
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=[0, 2])
    out = hm(torch.randn(8, 16)).square().mean()
    with torch.no_grad():
        model.blocks[0][0].weight.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"model's 'blocks\.0\.0\.weight' was modified by an in-place operation"):
        out.backward()
    hm(torch.randn(8, 16)).square().mean().backward()  # the next call is unaffected


class _AnnealedScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        return self.second(torch.tanh(self.first(x) * self.scale))


def test_a_buffer_changed_in_place_between_the_forward_and_backward_is_refused():
    """An annealed buffer changed before backward(): the recomputed pack read the new value."""
    torch.manual_seed(0)
    model = _AnnealedScale()
    hm = harmony_fx.compile(model, devices=["host:0"], pack_boundaries=[0, 1])
    out = hm(torch.randn(4, 8)).square().mean()
    model.scale.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"model's 'scale' was modified by an in-place operation"):
        out.backward()


def test_a_distributed_data_parallel_given_to_harmony_is_refused_saying_to_wrap_the_compiled_module():
    """``accelerate``'s ``prepare`` under torchrun returns a ``DistributedDataParallel``: compiled
    after it (the order for one process), capture failed on DDP's forward with advice about control
    flow and caches. Refused by name, saying where the compiled module goes; the Trainer, which
    trains across processes itself, says to give it the model DDP wraps. Wrapped around the
    compiled module, DDP trains as eager DDP does."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, reference = MLPChain(width=8, depth=3), MLPChain(width=8, depth=3)
        reference.load_state_dict(model.state_dict())
        x = torch.randn(4, 8)
        wrapped = DDP(model)
        with pytest.raises(TypeError, match=r"harmony_fx\.compile was given a DistributedDataParallel: .*"
                                            r"DDP\(harmony_fx\.compile\(model\)\).*ddp\.module = harmony_fx\.compile"):
            harmony_fx.compile(wrapped, (x,), devices=["host:0"])
        with pytest.raises(TypeError, match=r"as its module '0'"):
            harmony_fx.compile(nn.Sequential(wrapped, nn.Linear(8, 2)), (x,), devices=["host:0"])
        with pytest.raises(TypeError, match=r"harmony_fx\.Trainer was given a DistributedDataParallel: .*ddp\.module"):
            harmony_fx.Trainer(wrapped, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), (x, torch.randn(4, 8)))
        wrapped.module = harmony_fx.compile(model, devices=["host:0"], memory_budget="64KiB")
        wrapped(x).square().mean().backward()
        DDP(reference)(x).square().mean().backward()
        assert_grads_equal(model, reference)
    finally:
        dist.destroy_process_group()


def test_a_forward_that_calls_its_own_compiled_module_is_refused_in_words():
    """A forward set on the model that calls the compiled module recursed into the capture and was
    reported as an internal assertion (``reads_recorded is not reentrant``) with advice on dtypes."""
    layer = nn.Linear(4, 4)
    hm = harmony_fx.compile(layer, devices=["host:0"])
    layer.forward = lambda t: hm(t)
    with pytest.raises(ValueError, match=r"Linear's forward calls its own compiled module") as raised:
        hm(torch.randn(2, 4))
    assert "dtypes" not in str(raised.value)
    del layer.forward  # the class's forward again: the module compiles and runs
    x = torch.randn(2, 4)
    torch.testing.assert_close(hm(x), x @ layer.weight.T + layer.bias)


def test_a_later_call_that_does_not_fit_says_it_was_planned_afresh_and_how_it_differs():
    """A module compiled near its smallest budget, called with a larger batch: the refusal named a budget
    the user thought they had met, without saying that this call, not the first, was planned."""
    torch.manual_seed(0)
    model = MLPChain(width=64, depth=6)
    x = torch.randn(4, 64)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as smallest:
        harmony_fx.compile(model, (x,), memory_budget=1, devices=["host:0"])
    hm = harmony_fx.compile(model, memory_budget=smallest.value.smallest_budget, devices=["host:0"])
    hm(x).sum().backward()
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        hm(torch.randn(64, 64))
    (note,) = [note for note in refused.value.__notes__ if "planned afresh" in note]
    assert "differs from the first call (x (4, 64))" in note and "shapes" in note


def test_a_later_call_that_does_not_fit_names_the_first_call_whole_not_its_microbatch():
    """A first call cut into microbatches, then a longer one that does not fit: the note named the first
    call by its first microbatch's shapes (``x (2, 64)`` for a batch of 8), a call the user never made."""
    torch.manual_seed(0)
    model = MLPChain(width=64, depth=6)
    x = torch.randn(8, 64)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as smallest:
        harmony_fx.compile(model, (x,), memory_budget=1, microbatches=4, devices=["host:0"])
    hm = harmony_fx.compile(model, memory_budget=smallest.value.smallest_budget, microbatches=4, devices=["host:0"])
    hm(x).sum().backward()
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        hm(torch.randn(256, 64))
    (note,) = [note for note in refused.value.__notes__ if "planned afresh" in note]
    assert "differs from the first call (x (8, 64))" in note, note


def test_the_plan_is_the_last_calls_as_the_stats_are():
    """A call of new shapes is planned afresh: ``hm.stats`` measured it while ``hm.plan`` was the first
    call's, so a measured peak above ``hm.plan.predicted_peak`` read as a budget kept badly (sweep ww)."""
    torch.manual_seed(0)
    model = MLPChain(width=64, depth=6)
    hm = harmony_fx.compile(model, memory_budget="4MiB", devices=["host:0"], microbatches=1, track_memory=True)
    peaks = []
    for batch in (4, 32, 4):
        hm(torch.randn(batch, 64)).sum().backward()
        assert hm.stats.peak_bytes["host:0"] == hm.plan.predicted_peak["host:0"], batch
        peaks.append(hm.plan.predicted_peak["host:0"])
    assert peaks[0] == peaks[2] < peaks[1] and hm.compiled.plan.predicted_peak["host:0"] == peaks[0]
