"""``precision="bf16"``: compute and transfers in bfloat16 on the device, fp32 master weights,
gradients and optimizer state on the host; half the weight bytes on the wire."""
from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(1)  # tiny ops on a 2-core machine: threads only add synchronisation

import harmony_fx  # noqa: E402
from harmony_fx.models import GPTConfig, MLPChain, TinyGPT  # noqa: E402
from harmony_fx.program.actions import ActionKind, KeyKind  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_embd=32, dropout=0.0)
# embeddings | h.0, h.1 | h.2, h.3 | ln_f, head and loss
GPT_BOUNDARIES = (0, 5, 7, 9)
STEPS = 50
BATCH = 16
LR = 3e-3
BF16_RTOL = 0.03


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@functools.lru_cache(maxsize=None)
def _batches():
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size), generator=generator)
        batches.append((idx, torch.roll(idx, 1, dims=1)))
    return batches


@functools.lru_cache(maxsize=None)
def _gpt_runs():
    """50 steps with precision="bf16" next to eager under autocast(bf16); one fp32 step with the
    same packs for the byte counts."""
    torch.manual_seed(0)
    template = TinyGPT(CONFIG)
    model, reference, fp32_model = (copy.deepcopy(template) for _ in range(3))
    batches = _batches()

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    trainer = harmony_fx.Trainer(model, _loss, optimizer, batches[0], precision="bf16", pack_boundaries=GPT_BOUNDARIES)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    losses, ref_losses = [], []
    try:
        for idx, target in batches:
            losses.append(trainer.step((idx, target)))
            ref_optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_loss = _loss(reference(idx), target)
            ref_loss.backward()
            ref_optimizer.step()
            ref_losses.append(ref_loss.detach().float())
    finally:
        trainer.close()

    fp32_trainer = harmony_fx.Trainer(fp32_model, _loss, torch.optim.AdamW(fp32_model.parameters(), lr=LR),
                                      batches[0], pack_boundaries=GPT_BOUNDARIES)
    try:
        fp32_trainer.step(batches[0])
    finally:
        fp32_trainer.close()
    return template, model, optimizer, trainer, losses, ref_losses, fp32_trainer


def test_bf16_loss_curve_tracks_eager_autocast():
    _, _, _, trainer, losses, ref_losses, _ = _gpt_runs()
    assert len(trainer.hm.packs) == len(GPT_BOUNDARIES)
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        assert torch.isfinite(loss)
        assert abs(loss.item() - ref.item()) <= BF16_RTOL * abs(ref.item()), \
            f"step {step}: bf16 loss {loss.item():.4f}, eager autocast {ref.item():.4f}"
    # the curve moved: training happened in both, not only a matching first step
    assert losses[-1].item() < losses[0].item() - 0.3
    assert ref_losses[-1].item() < ref_losses[0].item() - 0.3


def test_bf16_returns_an_fp32_loss():
    losses = _gpt_runs()[4]
    assert all(loss.dtype == torch.float32 and loss.dim() == 0 for loss in losses)


def test_bf16_master_weights_gradients_and_optimizer_state_stay_fp32():
    template, model, optimizer, _, _, _, _ = _gpt_runs()
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, name
        assert param.grad is None or param.grad.dtype == torch.float32, name
    states = list(optimizer.state.values())
    assert len(states) == len(list(model.parameters()))
    for state in states:
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32
    # updates accumulate in fp32: after 50 small AdamW steps the masters hold values that bf16
    # cannot represent (a master kept in bf16, or rounded through it, would not)
    changed = not_bf16 = 0
    for param, initial in zip(model.parameters(), template.parameters()):
        changed += int(not torch.equal(param.detach(), initial.detach()))
        not_bf16 += int((param.detach() != param.detach().bfloat16().float()).any())
    assert changed == len(list(model.parameters()))
    assert not_bf16 == len(list(model.parameters()))


def _nonfloat_weight_bytes_moved(trainer) -> int:
    """Bytes of non-floating masters (e.g. a bool attention mask) the weight copies move: those
    keep their dtype in bf16."""
    hm = trainer.hm
    total = 0
    for action in hm.forward_actions + hm.backward_actions:
        if action.kind == ActionKind.PREFETCH and action.key.kind == KeyKind.WEIGHTS:
            masters = hm.host_state.masters[int(action.key.name[1:])]
            total += sum(t.numel() * t.element_size() for t in masters if not t.is_floating_point())
    return total


def test_bf16_moves_half_the_weight_bytes_of_fp32():
    _, _, _, trainer, _, _, fp32_trainer = _gpt_runs()
    bf16 = trainer.stats.as_dict()["bytes_by_kind"]
    fp32 = fp32_trainer.stats.as_dict()["bytes_by_kind"]
    nonfloat = _nonfloat_weight_bytes_moved(trainer)
    assert nonfloat == _nonfloat_weight_bytes_moved(fp32_trainer) > 0  # TinyGPT's causal masks
    assert bf16["h2d/weights"] - nonfloat == (fp32["h2d/weights"] - nonfloat) // 2
    assert 2 * (bf16["h2d/weights"] - nonfloat) == fp32["h2d/weights"] - nonfloat
    assert bf16["d2h/wgrad"] == fp32["d2h/wgrad"]  # summed over microbatches and copied in fp32


def test_bf16_measured_bytes_and_peak_equal_the_plan():
    _, _, _, trainer, _, _, fp32_trainer = _gpt_runs()
    device = trainer.hm.devices[0].name
    assert trainer.stats.as_dict()["bytes_by_kind"] == trainer.plan.predicted_bytes
    assert fp32_trainer.stats.as_dict()["bytes_by_kind"] == fp32_trainer.plan.predicted_bytes
    assert trainer.stats.peak_bytes[device] == trainer.plan.predicted_peak[device]
    # the device holds bf16 copies: well under the fp32 program's peak
    assert trainer.stats.peak_bytes[device] < 0.6 * fp32_trainer.stats.peak_bytes[device]


# ---------------------------------------------------------------------- a model with only floating state


@functools.lru_cache(maxsize=None)
def _mlp_bytes(precision: str, num_microbatches: int):
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=8)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2))
    trainer = harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), (x, target),
                                 precision=precision, microbatches=num_microbatches, pack_boundaries=(0, 3, 6))
    try:
        loss = trainer.step((x, target))
    finally:
        trainer.close()
    return trainer, dict(trainer.stats.as_dict()["bytes_by_kind"]), loss


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_bf16_weight_traffic_is_exactly_half_and_weight_gradients_stay_fp32(num_microbatches):
    bf16_trainer, bf16, loss = _mlp_bytes("bf16", num_microbatches)
    _, fp32, fp32_loss = _mlp_bytes("fp32", num_microbatches)
    assert len(bf16_trainer.hm.packs) == 3
    assert bf16["h2d/weights"] > 0 and 2 * bf16["h2d/weights"] == fp32["h2d/weights"]
    assert bf16["d2h/wgrad"] > 0 and bf16["d2h/wgrad"] == fp32["d2h/wgrad"]
    # stashed activations and the losses travel in bf16 too (every one of them is floating)
    assert 2 * bf16["d2h/act"] == fp32["d2h/act"]
    assert 2 * bf16["h2d/grad"] == fp32["h2d/grad"]
    # inputs: the floating x is halved, the int64 target is not
    target_bytes = 32 * torch.empty((), dtype=torch.int64).element_size()
    assert 2 * (bf16["h2d/act"] - target_bytes) == fp32["h2d/act"] - target_bytes
    assert bf16 == bf16_trainer.plan.predicted_bytes
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, fp32_loss, rtol=BF16_RTOL, atol=0)


def test_bf16_compile_gives_fp32_outputs_and_gradients_close_to_eager():
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=6)
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    target = torch.randint(0, 10, (16,))
    hm = harmony_fx.compile(model, x, precision="bf16", pack_boundaries=(0, 3, 5))
    out = hm(x)
    assert out.dtype == torch.float32
    ref_out = reference(x)
    torch.testing.assert_close(out, ref_out, rtol=0.05, atol=0.02)
    F.cross_entropy(out, target).backward()
    F.cross_entropy(ref_out, target).backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
        cosine = F.cosine_similarity(param.grad.flatten(), ref.grad.flatten(), dim=0)
        assert cosine > 0.99
    assert hm.stats.as_dict()["bytes_by_kind"] == hm.plan.predicted_bytes


class CastsAround(nn.Module):
    """Casts that follow the tensors' dtypes around fp32 and fp64 computations (as Hugging Face's
    attention does: ``softmax(..., dtype=torch.float32).to(query.dtype)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.first(x)).double()
        h = self.second(h.to(x.dtype))
        h = torch.softmax(h, dim=-1, dtype=torch.float32).to(x.dtype)
        return self.third(h)


def _tied(model) -> set[int]:
    """The ids of the parameters the model holds under more than one name."""
    names = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {ident for ident, count in names.items() if count > 1}


def _in_bf16(model):
    """The eager reference: the model's copy in bf16, what the devices compute with."""
    return copy.deepcopy(model).to(torch.bfloat16)


def test_bf16_computes_what_the_model_in_bf16_computes_casts_and_all():
    """A model that casts to fp32 and fp64 inside trains under bf16 (its casts captured as they
    follow bf16 tensors): output and every gradient bit for bit those of the model in bf16."""
    torch.manual_seed(0)
    model = CastsAround()
    reference = _in_bf16(model)
    x = torch.randn(16, 8)
    hm = harmony_fx.compile(model, x, precision="bf16", pack_boundaries=(0, 2, 4), microbatches=1)
    assert len(hm.packs) == 3
    out = hm(x)
    ref_out = reference(x.to(torch.bfloat16))
    assert out.dtype == torch.float32 and torch.equal(out, ref_out.float())
    out.square().sum().backward()
    ref_out.float().square().sum().backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad.dtype == torch.float32 and torch.equal(param.grad, ref.grad.float()), name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_hugging_face_models_equal_the_model_in_bf16(arch):
    """Hugging Face Llama and GPT-2 (fp32 casts in their norms, attention and loss) under bf16, in
    several packs at the smallest budget: the loss and every gradient bit for bit the model's in
    bf16 with one microbatch (but a tied weight's, whose packs' parts are summed in fp32, where
    eager sums them in bf16: within bf16's rounding); with two microbatches, close to it."""
    pytest.importorskip("transformers")
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    model, batch = build_hf_model(arch, num_layers=2), hf_batch(arch)
    reference = _in_bf16(model)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    ref_grads = [p.grad.float() for p in reference.parameters()]
    for microbatches in (1, 2):
        trained = copy.deepcopy(model)
        options = dict(example_kwargs=batch, precision="bf16", microbatches=microbatches, devices=["host:0"])
        with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
            harmony_fx.compile(trained, (), memory_budget=1, **options)
        hm = harmony_fx.compile(trained, (), memory_budget=refused.value.smallest_budget, **options)
        assert len(hm.packs) > 2
        loss = hm(**batch).loss
        loss.backward()
        assert loss.dtype == torch.float32
        grads = [p.grad for p in trained.parameters()]
        if microbatches == 1:
            assert torch.equal(loss, ref_loss.float())
            for (param, grad), ref in zip(zip(trained.parameters(), grads), ref_grads):
                if id(param) in _tied(trained):
                    torch.testing.assert_close(grad, ref, rtol=0, atol=2 ** -8 * ref.abs().max().item())
                else:
                    assert torch.equal(grad, ref)
        else:
            torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-3, atol=0)
            for grad, ref in zip(grads, ref_grads):
                assert F.cosine_similarity(grad.flatten(), ref.flatten(), dim=0) > 0.999


class MakesAConstant(nn.Module):
    """A floating tensor the forward makes from numbers (DeBERTa's attention scale): export lifts it
    as a constant in its own fp32, which bf16 leaves as it is, as the model in bf16 does."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        scale = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0])
        return self.second((self.first(x) * scale).to(x.dtype))


def test_bf16_stages_a_constant_the_model_makes_in_its_own_dtype():
    torch.manual_seed(0)
    model = MakesAConstant()
    reference = _in_bf16(model)
    x = torch.randn(16, 8)
    hm = harmony_fx.compile(model, x, precision="bf16", pack_boundaries=(0, 1), microbatches=1)
    out = hm(x)
    expected = reference(x.to(torch.bfloat16))
    assert torch.equal(out, expected.float())
    out.sum().backward()
    expected.float().sum().backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(param.grad, ref.grad.float())
    # the constant's copy moves its 4-byte elements, the weights' 2: as the plan counted
    assert hm.stats.as_dict()["bytes_by_kind"] == hm.plan.predicted_bytes


@pytest.mark.parametrize("track_memory", [True, False])
def test_bf16_two_calls_before_one_backward_train_as_the_model_in_bf16(track_memory):
    """A siamese pair: an untracked HostDevice hands its bf16 staging buffer to the last pack, whose
    graph the first call keeps; the second call cast into that buffer again, and the first call's
    backward failed in autograd ("modified by an inplace operation")."""
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=4)
    reference = copy.deepcopy(model).to(torch.bfloat16)
    x1, x2 = torch.randn(8, 32), torch.randn(8, 32)
    hm = harmony_fx.compile(model, devices=["host:0"], precision="bf16", pack_boundaries=[0, 2],
                            track_memory=track_memory)
    (hm(x1).float() - hm(x2).float()).pow(2).mean().backward()
    (reference(x1.bfloat16()).float() - reference(x2.bfloat16()).float()).pow(2).mean().backward()
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad.float(), rtol=2e-2, atol=2e-4)
