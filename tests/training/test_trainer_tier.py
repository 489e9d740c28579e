"""``Trainer(nvme_path=...)``: the optimizer state on an NVMe tier (a temporary directory here).

Checked against a trainer that keeps everything in host memory: bitwise equal losses, weights and
optimizer state; host memory held for optimizer state lower by what the plan says, counted here;
a failed write leaves the step undone and the tier's files as before; a checkpoint resumes bit for
bit.
"""
from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.calibrate import spec_for
from harmony_fx.planner.module import simulate_module
from harmony_fx.runtime import tier as tier_module
from tests.helpers import (
    four_pack_model, four_pack_trainer, optimizer_states, regression_batches, saved_checkpoint, tier_files_check,
)


def _held_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer's state holds in host memory, counted here."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _assert_same(a: harmony_fx.Trainer, b: harmony_fx.Trainer) -> None:
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    for x, y in zip(optimizer_states(a), optimizer_states(b)):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def test_five_adamw_steps_equal_host_memory_bitwise_and_hold_less(tmp_path):
    reference, tiered = four_pack_trainer(), four_pack_trainer(nvme_path=tmp_path)
    assert tiered.plan.tier_packs == (0, 1, 2, 3)
    for batch in regression_batches(5):
        assert torch.equal(reference.step(batch), tiered.step(batch))
    _assert_same(reference, tiered)
    # what host memory holds for optimizer state between steps: lower by the plan's bytes on the tier
    dropped = _held_state_bytes(reference.optimizer) - _held_state_bytes(tiered.optimizer)
    assert dropped == tiered.plan.tier_bytes > 0
    manifest = tier_files_check(tmp_path)
    assert sorted(map(int, manifest["packs"])) == [0, 1, 2, 3]
    # every pack's state read and written once a step: the runtime's count, the files' layout and the
    # plan (sized before the first step) agree, and so does the simulation of the program
    stored = sum(t[5] for entry in manifest["packs"].values() for t in entry["tensors"])
    assert tiered.stats.tier_bytes == {"read": stored, "write": stored} and stored == tiered.plan.tier_bytes
    simulated = simulate_module(tiered.hm, spec_for(tiered.hm.devices[0])).bytes_moved
    assert simulated[("nvme", "read")] == simulated[("nvme", "write")] == stored
    # what was in flight at once, as the tier counted it, within the plan's staging
    assert 0 < tiered.stats.tier_staged_peak <= tiered.hm.compiled.host_memory.needs.staging


def test_a_pack_streams_its_state_a_parameter_at_a_time(tmp_path):
    """One pack of 12 layers: its state never all in host memory at once, within the plan's staging
    (a few parameters' worth), and the training still equals host memory's."""
    def trainer(**options):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(12)], nn.Linear(32, 4))
        return harmony_fx.Trainer(model, nn.functional.mse_loss, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  regression_batches(1)[0], microbatches=2, pack_boundaries=(0, 12), **options)

    reference, tiered = trainer(), trainer(nvme_path=tmp_path)
    for batch in regression_batches(2):
        assert torch.equal(reference.step(batch), tiered.step(batch))
    _assert_same(reference, tiered)
    pack_state = tiered.hm.compiled.host_memory.pack_state_bytes[0]
    assert 0 < tiered.stats.tier_staged_peak <= tiered.hm.compiled.host_memory.needs.staging < pack_state


def test_host_memory_moves_only_what_does_not_fit(tmp_path):
    everything = four_pack_trainer(nvme_path=tmp_path / "all")
    # room for about two packs' state (and their undo copies) more than with all of it on the tier
    limit = everything.plan.host_bytes + 20_000
    partial = four_pack_trainer(nvme_path=tmp_path / "part", host_memory=limit)
    assert 0 < len(partial.plan.tier_packs) < 4 and partial.plan.host_bytes <= limit
    reference = four_pack_trainer()
    for batch in regression_batches(3):
        assert torch.equal(reference.step(batch), partial.step(batch))
    _assert_same(reference, partial)
    assert _held_state_bytes(reference.optimizer) - _held_state_bytes(partial.optimizer) == partial.plan.tier_bytes


def test_a_failed_write_undoes_the_step_and_keeps_the_files(tmp_path, monkeypatch):
    reference, tiered = four_pack_trainer(), four_pack_trainer(nvme_path=tmp_path)
    batches = regression_batches(4)
    for batch in batches[:2]:
        reference.step(batch)
        tiered.step(batch)
    tiered.flush()  # the second step's last writes may still be going on
    before = tier_files_check(tmp_path)
    weights = [p.detach().clone() for p in tiered.model.parameters()]
    held = _held_state_bytes(tiered.optimizer)
    real_finish, calls = tier_module._FileWriter.finish, []

    def failing(file):
        calls.append(file.path)
        if len(calls) == 3:  # the third pack's file of the step
            raise OSError(28, "No space left on device (injected)")
        return real_finish(file)

    monkeypatch.setattr(tier_module._FileWriter, "finish", failing)
    with pytest.raises(OSError, match="injected"):  # in the step, or once its writes are waited for
        tiered.step(batches[2])
        tiered.flush()
    monkeypatch.setattr(tier_module._FileWriter, "finish", real_finish)
    assert len(calls) == 3  # nothing written after the failure
    assert tier_files_check(tmp_path) == before  # the manifest and its files as before; the step's files gone
    assert all(torch.equal(p, w) for p, w in zip(tiered.model.parameters(), weights))
    assert _held_state_bytes(tiered.optimizer) == held  # what the step read left host memory again
    assert tiered.step_count == 2
    # nothing of the failed step stays: the next steps equal a trainer that never failed
    for batch in batches[2:]:
        assert torch.equal(reference.step(batch), tiered.step(batch))
    _assert_same(reference, tiered)


def test_a_write_failing_after_the_step_returned_undoes_that_step_at_the_next(tmp_path, monkeypatch):
    """The last pack's file is written while the next step runs its forward: if that write fails,
    the step that returned is undone when the next one finds out, and the next one too."""
    reference, tiered = four_pack_trainer(), four_pack_trainer(nvme_path=tmp_path)
    batches = regression_batches(4)
    reference.step(batches[0])
    tiered.step(batches[0])
    tiered.flush()
    before = tier_files_check(tmp_path)
    weights = [p.detach().clone() for p in tiered.model.parameters()]
    real_finish, calls = tier_module._FileWriter.finish, []

    def failing(file):
        calls.append(file.path)
        if len(calls) == 4:  # the step's last file: nothing in the step waits for it
            raise OSError(5, "Input/output error (injected)")
        return real_finish(file)

    monkeypatch.setattr(tier_module._FileWriter, "finish", failing)
    tiered.step(batches[1])  # returns: its last write has not failed yet, or it has and nothing waited
    assert tiered.step_count == 2
    with pytest.raises(OSError, match="injected") as raised:  # the patch stays: the write may not have run yet
        tiered.step(batches[2])
    monkeypatch.setattr(tier_module._FileWriter, "finish", real_finish)
    assert len(calls) == 4
    assert "step 1 could not be written to the NVMe tier, so that step was undone" in "\n".join(raised.value.__notes__)
    assert tiered.step_count == 1
    assert tier_files_check(tmp_path) == before
    assert all(torch.equal(p, w) for p, w in zip(tiered.model.parameters(), weights))
    for batch in batches[1:]:
        assert torch.equal(reference.step(batch), tiered.step(batch))
    _assert_same(reference, tiered)


def test_a_corrupted_file_is_refused_and_the_step_undone(tmp_path):
    tiered = four_pack_trainer(nvme_path=tmp_path)
    tiered.step(regression_batches(1)[0])
    tiered.flush()
    entry = json.loads((tmp_path / tier_module.MANIFEST).read_text())["packs"]["1"]
    with open(tmp_path / entry["file"], "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xff\xff\xff")
    weights = [p.detach().clone() for p in tiered.model.parameters()]
    with pytest.raises(tier_module.TierCorrupted, match="CRC-32"):
        tiered.step(regression_batches(2)[1])
    assert all(torch.equal(p, w) for p, w in zip(tiered.model.parameters(), weights))


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_resume_from_save_is_bit_identical(tmp_path, folder):
    batches = regression_batches(5)
    first = four_pack_trainer(nvme_path=tmp_path / "tier-a")
    for batch in batches[:2]:
        first.step(batch)
    path = saved_checkpoint(first, tmp_path, folder)
    # the checkpoint holds the whole optimizer state, tier included, as a trainer without one saves it
    if not folder:
        saved = torch.load(path, weights_only=True)["optimizer"]["state"]
        assert all("exp_avg" in state for state in saved.values())
    later = [first.step(batch) for batch in batches[2:]]
    resumed = four_pack_trainer(nvme_path=tmp_path / "tier-b")
    resumed.load(path)
    assert _held_state_bytes(resumed.optimizer) < _held_state_bytes(first.optimizer) + 1  # back on the tier
    assert [resumed.step(batch) for batch in batches[2:]] == later
    _assert_same(first, resumed)


def test_the_optimizers_own_state_dict_holds_the_tiers_state(tmp_path):
    """A user's checkpoint code (``torch.save(optimizer.state_dict())``, transformers' ``optimizer.pt``)
    got host memory's state alone: the tier's packs without their moments, silently. It is the whole
    state now, as a trainer without a tier gives it, read after the last step's writes; the optimizer
    keeps in host memory what it kept. Loading into it, which the tier's next reads would ignore, is
    refused naming the trainer's own load, until the trainer is closed."""
    reference, tiered = four_pack_trainer(), four_pack_trainer(nvme_path=tmp_path)
    for batch in regression_batches(2):
        reference.step(batch)
        tiered.step(batch)  # its last writes still under way
    held = _held_state_bytes(tiered.optimizer)
    ours, theirs = tiered.optimizer.state_dict(), reference.optimizer.state_dict()
    assert ours["state"].keys() == theirs["state"].keys() and len(theirs["state"]) == len(list(tiered.model.parameters()))
    for index, state in theirs["state"].items():
        assert ours["state"][index].keys() == state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(ours["state"][index][key], value) for key, value in state.items())
    assert _held_state_bytes(tiered.optimizer) == held < _held_state_bytes(reference.optimizer)
    for load in (lambda: tiered.optimizer.load_state_dict(theirs), lambda: tiered.model.load_state_dict({})):
        with pytest.raises(ValueError, match=r"NVMe tier: .*Load with trainer.load\(path\)"):
            load()
    tiered.close()
    tiered.optimizer.load_state_dict(theirs)


def test_close_gives_the_optimizer_its_state_back(tmp_path):
    """After ``close`` the optimizer steps on its own (or in a new trainer, as HarmonyTrainer's next
    ``train()`` makes one): its state was the tier's files' alone, the moments gone from it."""
    reference, tiered = four_pack_trainer(), four_pack_trainer(nvme_path=tmp_path)
    for batch in regression_batches(2):
        reference.step(batch)
        tiered.step(batch)
    tiered.close()
    tiered.close()  # twice: nothing more
    for p, q in zip(reference.model.parameters(), tiered.model.parameters()):
        ours, theirs = tiered.optimizer.state[q], reference.optimizer.state[p]
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_close_returns_after_the_tiers_threads_have_ended(tmp_path):
    """A step's reader and writer threads end once its state is committed; ``close`` (and every
    ``flush``) waits for them, so nothing of the trainer runs after it returns."""
    tiered = four_pack_trainer(nvme_path=tmp_path)
    for batch in regression_batches(3):
        tiered.step(batch)
    tiered.close()
    assert [t.name for t in threading.enumerate() if t.name.startswith("harmony-io")] == []


@pytest.mark.parametrize("optimizer, options", [
    (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), {}),
    (lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True, foreach=True), {}),
    (lambda params: torch.optim.AdamW(params, lr=1e-2), {"precision": "bf16"}),
    # torch's own, whose module is torch.optim itself (it was refused as "not one of torch.optim's"),
    # and which steps matrices only (sizing its state on a vector failed)
    (lambda params: torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-2), {}),
], ids=["sgd-momentum", "adam-amsgrad-foreach", "adamw-bf16", "muon"])
def test_other_optimizers_and_bf16_equal_host_memory(tmp_path, optimizer, options):
    """Each state the optimizer keeps per parameter (a momentum buffer, Adam's third moment) goes to
    the tier and is sized by the plan before it exists; stepping a parameter at a time, even with
    ``foreach``, computes what stepping the pack does."""
    reference = four_pack_trainer(optimizer, **options)
    tiered = four_pack_trainer(optimizer, nvme_path=tmp_path, **options)
    for batch in regression_batches(2):
        assert torch.equal(reference.step(batch), tiered.step(batch))
    _assert_same(reference, tiered)
    assert _held_state_bytes(reference.optimizer) - _held_state_bytes(tiered.optimizer) == tiered.plan.tier_bytes > 0


@pytest.mark.parametrize("parallel", ["dp", "pp"])
def test_two_devices_equal_host_memory(tmp_path, parallel):
    options = dict(devices=2, parallel=parallel)
    reference, tiered = four_pack_trainer(**options), four_pack_trainer(nvme_path=tmp_path, **options)
    for batch in regression_batches(2):
        assert torch.equal(reference.step(batch), tiered.step(batch))
    _assert_same(reference, tiered)
    # one process, one I/O worker: each pack's state is read and written by one device's program
    moves = [(a.kind.name, a.key) for forward, backward in tiered.hm.device_actions for a in forward + backward
             if a.stream.name == "IO"]
    assert sorted(moves) == sorted((kind, key) for kind in ("READ", "WRITE") for key in {key for _, key in moves})
    assert len(moves) == 8


def test_clipping_streams_the_tier_through_the_final_update(tmp_path):
    """With ``max_grad_norm`` the programs update nothing (the norm needs every gradient first), so
    no program reads or writes the tier: the trainer's final update streams each pack through it."""
    reference, tiered = four_pack_trainer(max_grad_norm=0.1), four_pack_trainer(nvme_path=tmp_path, max_grad_norm=0.1)
    assert tiered.plan.tier_packs == (0, 1, 2, 3)
    assert not [a for forward, backward in tiered.hm.device_actions for a in forward + backward if a.stream.name == "IO"]
    for batch in regression_batches(3):
        assert torch.equal(reference.step(batch), tiered.step(batch))
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in tiered.model.parameters()]))
    assert clipped == pytest.approx(0.1, rel=1e-4)  # the gradients were clipped, not merely small
    _assert_same(reference, tiered)
    assert _held_state_bytes(reference.optimizer) - _held_state_bytes(tiered.optimizer) == tiered.plan.tier_bytes
    tiered.flush()
    stored = sum(t[5] for entry in tier_files_check(tmp_path)["packs"].values() for t in entry["tensors"])
    assert tiered.stats.tier_bytes == {"read": stored, "write": stored} and stored == tiered.plan.tier_bytes


def test_a_batch_of_another_size_streams_the_tier_through_its_final_update(tmp_path):
    """A smaller batch (a DataLoader's last) is cut into other packs than the tier's files: its
    programs update nothing, and the step's final update streams each tiered pack in turn."""
    reference, tiered = four_pack_trainer(), four_pack_trainer(nvme_path=tmp_path)
    batches = regression_batches(3)
    small = tuple(t[:12] for t in batches[1])
    for batch in [batches[0], small, batches[2], small]:
        assert torch.equal(reference.step(batch), tiered.step(batch))
    moves = [a.kind.name for forward, backward in tiered._last_hm.device_actions for a in forward + backward]
    assert tiered._last_hm is not tiered.hm and "UPDATE" not in moves and "READ" not in moves
    _assert_same(reference, tiered)
    tiered.flush()
    assert _held_state_bytes(reference.optimizer) - _held_state_bytes(tiered.optimizer) == tiered.plan.tier_bytes
    tier_files_check(tmp_path)


def test_refusals_say_what_to_do(tmp_path):
    model = four_pack_model()
    with pytest.raises(ValueError, match="options of harmony_fx.Trainer"):
        harmony_fx.compile(model, (torch.randn(4, 32),), nvme_path=tmp_path)
    with pytest.raises(ValueError, match="nvme_path="):
        four_pack_trainer(host_memory="10KiB")
    with pytest.raises(ValueError, match="raise host_memory to at least"):
        four_pack_trainer(nvme_path=tmp_path, host_memory="10KiB")
