"""``Trainer(precision="bf16", frozen_to_bf16=True)``: a frozen fp32 parameter (a LoRA model's base)
costs 2 bytes an element on the host instead of its fp32 tensor plus the bf16 copy the devices
stage (6). Checked against the same trainer without the option: bitwise equal losses and adapters,
the same bytes on the bus, host bytes for weights counted here from the tensors the trainer holds
equal to each plan's figure and 4 bytes a frozen element apart; the trained model's state_dict
loads into a new fp32 model; the option needs bf16, and a failed compile leaves the weights as
they were.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.compiler.packing import BudgetTooSmallError
from tests.helpers import FOUR_PACKS, regression_batches

WIDTH = 32


class LoRALinear(nn.Module):
    """A frozen ``Linear(WIDTH, WIDTH)`` plus a trainable rank-2 adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.down = nn.Linear(WIDTH, 2, bias=False)
        self.up = nn.Linear(2, WIDTH, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def lora_model() -> nn.Module:
    """Four LoRA blocks and a trainable head, all fp32, the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(LoRALinear(), nn.ReLU()) for _ in range(4)], nn.Linear(WIDTH, 4))


def lora_trainer(**options) -> harmony_fx.Trainer:
    model = lora_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the frozen base included, as people write it
    # a host_memory far above the need: the plan then itemises the host bytes
    return harmony_fx.Trainer(model, nn.functional.mse_loss, optimizer, regression_batches(1)[0], microbatches=2,
                              pack_boundaries=FOUR_PACKS, precision="bf16", host_memory="1GiB", **options)


def _weight_bytes_held(trainer: harmony_fx.Trainer) -> int:
    """Host bytes of the model's parameters and buffers as they are now, and of the bf16 copies
    the devices staged."""
    tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) + sum(d.staging.nbytes for d in trainer.hm.devices)


def test_frozen_weights_cost_two_bytes_on_the_host_and_train_as_before():
    reference, narrowed = lora_trainer(), lora_trainer(frozen_to_bf16=True)
    frozen = [name for name, p in narrowed.model.named_parameters() if not p.requires_grad]
    assert len(frozen) == 8  # every base weight and bias
    for batch in regression_batches(4):
        assert torch.equal(reference.step(batch), narrowed.step(batch))
    assert len(narrowed.hm.variants) == 1  # converted before capturing: no second compile for the new dtype

    for (name, p), q in zip(reference.model.named_parameters(), narrowed.model.parameters()):
        if name in frozen:  # the option's model holds the bf16 copy; the other model is untouched
            assert p.dtype == torch.float32 and q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16))
        else:
            assert p.dtype == q.dtype == torch.float32 and torch.equal(p, q)
    # the bus moves the same bf16 bytes either way (measured)
    assert narrowed.stats.as_dict()["bytes_by_kind"] == reference.stats.as_dict()["bytes_by_kind"]

    # host bytes for weights, counted from the tensors, are each plan's figure, and the frozen
    # elements' 6 bytes (fp32 tensor, staged bf16 copy) became 2
    for trainer in (reference, narrowed):
        needs = trainer.hm.compiled.host_memory.needs
        assert _weight_bytes_held(trainer) == needs.masters + needs.weight_copies
    frozen_elements = sum(p.numel() for name, p in narrowed.model.named_parameters() if name in frozen)
    assert _weight_bytes_held(reference) - _weight_bytes_held(narrowed) == 4 * frozen_elements
    assert reference.plan.host_bytes - narrowed.plan.host_bytes == 4 * frozen_elements

    # the trained weights load into a new fp32 model (the frozen ones rounded to bf16, as trained)
    state = narrowed.state_dict()
    fresh = lora_model()
    fresh.load_state_dict(state["model"])
    for p, q in zip(fresh.parameters(), narrowed.model.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q.float())
    narrowed.load_state_dict(state)  # and back into the trainer
    assert {p.dtype for p in narrowed.model.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_frozen_to_bf16_needs_bf16_precision():
    model = lora_model()
    with pytest.raises(ValueError, match=r"frozen_to_bf16=True .* but precision='fp32': pass precision='bf16' too"):
        harmony_fx.compile(model, (regression_batches(1)[0][0],), frozen_to_bf16=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_failed_compile_gives_the_frozen_weights_back():
    model = lora_model()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    with pytest.raises(BudgetTooSmallError):
        harmony_fx.compile(model, (regression_batches(1)[0][0],), precision="bf16", frozen_to_bf16=True,
                           memory_budget=64)
    for name, p in model.named_parameters():
        param, value = before[name]
        assert p is param and p.dtype == torch.float32 and torch.equal(p, value)
