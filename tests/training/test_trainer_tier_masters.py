"""``Trainer(nvme_path=..., host_memory=..., precision="bf16")``: fp32 masters on the NVMe tier too.

When every pack's optimizer state is on the tier and a step still does not fit ``host_memory``,
the fp32 masters follow: each parameter holds its bf16 copy between steps (what the devices read),
its gradient stays fp32, and its update reads the master with the state. Checked against a bf16
trainer in host memory: bitwise equal losses, masters, gradients and optimizer state; host memory
held for weights as the plan says, counted here from the tensors; a failed write leaves the step
undone; a checkpoint holds the fp32 masters and resumes bit for bit; ``close`` gives the model its
fp32 parameters back.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.runtime import tier as tier_module
from tests.helpers import four_pack_trainer, optimizer_states, regression_batches, saved_checkpoint, tier_files_check


def _bf16_trainer(**options) -> harmony_fx.Trainer:
    """``four_pack_trainer`` computing in bf16 (fp32 masters on the host, or on the tier)."""
    return four_pack_trainer(precision="bf16", **options)


def _least_host_memory(tmp_path, build=_bf16_trainer, **options) -> int:
    """The smallest ``host_memory`` the refusal of a smaller one names (rounded up to whole KiB), for
    the trainer ``build`` makes."""
    with pytest.raises(ValueError, match="raise host_memory to at least") as refused:
        build(nvme_path=tmp_path / "refused", host_memory="1KiB", **options)
    return int(float(re.search(r"at least ([\d.]+) KiB", str(refused.value)).group(1)) + 1) * 1024


def _masters(trainer: harmony_fx.Trainer) -> dict[str, torch.Tensor]:
    return trainer.state_dict()["model"]


def _weight_bytes_held(trainer: harmony_fx.Trainer) -> int:
    """Host bytes of the model's parameters as they are now and of the bf16 copies the devices staged."""
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    return params + sum(device.staging.nbytes for device in trainer.hm.devices)


def _assert_same(reference: harmony_fx.Trainer, tiered: harmony_fx.Trainer) -> None:
    """fp32 masters, gradients and optimizer state equal; the parameters hold the masters' bf16 copies."""
    expected, got = _masters(reference), _masters(tiered)
    assert all(got[name].dtype == torch.float32 and torch.equal(got[name], expected[name]) for name in expected)
    for p, q in zip(reference.model.parameters(), tiered.model.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16))
        assert q.grad.dtype == torch.float32 and torch.equal(q.grad, p.grad)
    for x, y in zip(optimizer_states(reference), optimizer_states(tiered)):
        assert x.keys() == y.keys() and all(torch.equal(x[key], y[key]) for key in x)


def test_masters_follow_the_state_and_train_like_host_memory_bitwise(tmp_path):
    least = _least_host_memory(tmp_path)
    state_only = _bf16_trainer(nvme_path=tmp_path / "state")  # no limit: the optimizer state alone moves
    assert state_only.plan.tier_packs == (0, 1, 2, 3) and state_only.plan.tier_master_packs == ()
    tiered = _bf16_trainer(nvme_path=tmp_path / "masters", host_memory=least)
    assert tiered.plan.tier_master_packs == (0, 1, 2, 3) and tiered.plan.host_bytes <= least
    assert "fp32 masters of p0 p1 p2 p3" in tiered.plan.tier_line()
    reference = _bf16_trainer()
    for batch in regression_batches(5):
        assert torch.equal(reference.step(batch), tiered.step(batch))
        state_only.step(batch)
    tiered.flush()
    _assert_same(reference, tiered)
    # the model's own state_dict() (a user's checkpoint, save_pretrained) holds the fp32 masters the tier
    # keeps, as the reference's parameters are: it held their bf16 copies
    own = tiered.model.state_dict()
    assert all(own[name].dtype == torch.float32 and torch.equal(own[name], p)
               for name, p in reference.model.state_dict().items())
    # host memory held for weights between steps, counted from the tensors, is what each plan says:
    # fp32 masters and their staged bf16 copies without the masters on the tier, bf16 copies alone with
    for trainer in (state_only, tiered):
        needs = trainer.hm.compiled.host_memory.needs
        assert _weight_bytes_held(trainer) == needs.masters + needs.weight_copies
    params = sum(p.numel() for p in reference.model.parameters())
    assert _weight_bytes_held(state_only) - _weight_bytes_held(tiered) == 4 * params  # 6 B a parameter -> 2 B
    # each file holds every parameter's fp32 master beside its state, read and written once a step
    manifest = tier_files_check(tmp_path / "masters")
    stored = [t for entry in manifest["packs"].values() for t in entry["tensors"]]
    masters = [t for t in stored if t[1] == tier_module.MASTER_KEY]
    assert len(masters) == len(list(reference.model.parameters())) and {t[2] for t in masters} == {"float32"}
    assert sum(t[5] for t in masters) == 4 * params
    total = sum(t[5] for t in stored)
    assert total == tiered.plan.tier_bytes and tiered.stats.tier_bytes == {"read": total, "write": total}


def _deep_trainer(**options) -> harmony_fx.Trainer:
    """24 small layers in 4 packs: a pack's state is many parameters' (the tier's staging, a few
    parameters' worth, is small beside it), so the tier saves host memory even without undo copies."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(23)], nn.Linear(32, 4))
    return harmony_fx.Trainer(model, nn.functional.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              regression_batches(1)[0], microbatches=2, pack_boundaries=(0, 6, 12, 18), precision="bf16",
                              **options)


@pytest.mark.parametrize("atomic", [True, False])
def test_a_failed_write_undoes_the_step_masters_and_copies_included(tmp_path, monkeypatch, atomic):
    """With ``atomic=False`` too: the committed masters restore their bf16 copies without any copy
    kept (the steps after differ then: Adam's step counts are not put back)."""
    least = _least_host_memory(tmp_path, _deep_trainer, atomic=atomic)
    reference, tiered = _deep_trainer(), _deep_trainer(nvme_path=tmp_path / "tier", host_memory=least, atomic=atomic)
    assert tiered.plan.tier_master_packs == (0, 1, 2, 3)
    batches = regression_batches(4)
    for batch in batches[:2]:
        reference.step(batch)
        tiered.step(batch)
    tiered.flush()
    before = tier_files_check(tmp_path / "tier")
    masters = _masters(tiered)
    copies = [p.detach().clone() for p in tiered.model.parameters()]
    real_finish, calls = tier_module._FileWriter.finish, []

    def failing(file):
        calls.append(file.path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device (injected)")
        return real_finish(file)

    monkeypatch.setattr(tier_module._FileWriter, "finish", failing)
    with pytest.raises(OSError, match="injected"):
        tiered.step(batches[2])
        tiered.flush()
    monkeypatch.setattr(tier_module._FileWriter, "finish", real_finish)
    assert tier_files_check(tmp_path / "tier") == before and tiered.step_count == 2
    # the packs updated before the failure got their bf16 copies back from the committed masters
    assert all(torch.equal(p, c) for p, c in zip(tiered.model.parameters(), copies))
    after = _masters(tiered)
    assert all(torch.equal(after[name], masters[name]) for name in masters)
    if not atomic:
        return
    for batch in batches[2:]:
        assert torch.equal(reference.step(batch), tiered.step(batch))
    tiered.flush()
    _assert_same(reference, tiered)


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_resume_holds_the_fp32_masters_and_is_bit_identical(tmp_path, folder):
    least = _least_host_memory(tmp_path)
    batches = regression_batches(4)
    first = _bf16_trainer(nvme_path=tmp_path / "tier-a", host_memory=least)
    for batch in batches[:2]:
        first.step(batch)
    path = saved_checkpoint(first, tmp_path, folder)
    if not folder:
        saved = torch.load(path, weights_only=True)["model"]
        assert {t.dtype for t in saved.values()} == {torch.float32}  # the masters, not their bf16 copies
    later = [first.step(batch) for batch in batches[2:]]
    resumed = _bf16_trainer(nvme_path=tmp_path / "tier-b", host_memory=least)
    resumed.load(path)
    assert {p.dtype for p in resumed.model.parameters()} == {torch.bfloat16}  # the masters back on the tier
    assert [resumed.step(batch) for batch in batches[2:]] == later
    expected, got = _masters(first), _masters(resumed)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_close_gives_the_model_its_fp32_parameters_back(tmp_path):
    reference, tiered = _bf16_trainer(), _bf16_trainer(nvme_path=tmp_path / "tier", host_memory=_least_host_memory(tmp_path))
    for batch in regression_batches(2):
        reference.step(batch)
        tiered.step(batch)
    tiered.close()
    for p, q in zip(reference.model.parameters(), tiered.model.parameters()):
        assert q.dtype == torch.float32 and torch.equal(p, q)


@pytest.mark.parametrize("parallel", ["dp", "pp"])
def test_two_devices_hold_the_weight_copies_the_plan_counts(tmp_path, parallel):
    """Data-parallel, each device stages its own bf16 copy of every weight; a pipeline, the device
    that runs the pack. With the masters on the tier, neither stages any: the parameters are the copies."""
    options = dict(devices=2, parallel=parallel)
    least = _least_host_memory(tmp_path, **options)
    reference = _bf16_trainer(**options)
    state_only = _bf16_trainer(nvme_path=tmp_path / "state", **options)
    tiered = _bf16_trainer(nvme_path=tmp_path / "masters", host_memory=least, **options)
    assert tiered.plan.tier_master_packs == (0, 1, 2, 3)
    for batch in regression_batches(2):
        assert torch.equal(reference.step(batch), tiered.step(batch))
        state_only.step(batch)
    tiered.flush()
    _assert_same(reference, tiered)
    params = sum(p.numel() for p in reference.model.parameters())
    copies = 2 if parallel == "dp" else 1
    assert _weight_bytes_held(state_only) == (4 + 2 * copies) * params
    assert _weight_bytes_held(tiered) == 2 * params
    for trainer in (state_only, tiered):
        needs = trainer.hm.compiled.host_memory.needs
        assert _weight_bytes_held(trainer) == needs.masters + needs.weight_copies


def test_clipping_with_the_masters_on_the_tier(tmp_path):
    least = _least_host_memory(tmp_path, max_grad_norm=0.1)
    reference = _bf16_trainer(max_grad_norm=0.1)
    tiered = _bf16_trainer(nvme_path=tmp_path / "tier", host_memory=least, max_grad_norm=0.1)
    assert tiered.plan.tier_master_packs == (0, 1, 2, 3)
    for batch in regression_batches(3):
        assert torch.equal(reference.step(batch), tiered.step(batch))
    tiered.flush()
    _assert_same(reference, tiered)


def test_a_smaller_batch_with_the_masters_on_the_tier(tmp_path):
    least = _least_host_memory(tmp_path)
    reference, tiered = _bf16_trainer(), _bf16_trainer(nvme_path=tmp_path / "tier", host_memory=least)
    batches = regression_batches(2)
    small = tuple(t[:12] for t in batches[1])
    for batch in [batches[0], small, batches[1]]:
        assert torch.equal(reference.step(batch), tiered.step(batch))
    tiered.flush()
    _assert_same(reference, tiered)
