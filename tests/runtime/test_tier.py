"""``runtime.tier.StateTier``, the NVMe store, on its own: a pack's optimizer state in a file between
its updates.

Against an AdamW stepped in host memory on identical parameters: the state stored, read back,
streamed through an update and committed is bitwise the same; the files written are the manifest's
(sizes and CRC-32 checked here, not by the store's reader) and no other; a step aborted, or one
whose write fails, leaves the manifest and the files as before it; a changed byte is refused; the
state in flight stays within the policy's bound; fp32 masters on the tier come back as they went.
"""
from __future__ import annotations

import json
import os
import zlib

import pytest
import torch
from torch import nn

from harmony_fx.runtime import tier as tier_module
from harmony_fx.runtime.tier import StateTier, TierCorrupted
from harmony_fx.tier_policy import staged_params
from harmony_fx.training.updates import step_subset

# two packs' parameters: pack 0 has more of them than the tier may hold in flight at once
SHAPES = {0: [(6, 5)] * 9 + [(6,), (4, 6)], 1: [(3, 4), (3,)]}


def _params() -> dict[int, list[nn.Parameter]]:
    generator = torch.Generator().manual_seed(0)
    return {pack: [nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
            for pack, shapes in SHAPES.items()}


def _grads(packs: dict[int, list[nn.Parameter]], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for params in packs.values():
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)


class Pair:
    """A store over one set of parameters, and a reference AdamW in host memory over a copy."""

    def __init__(self, path, **tier_options) -> None:
        self.packs, self.reference_packs = _params(), _params()
        flat = [p for params in self.packs.values() for p in params]
        self.optimizer = torch.optim.AdamW(flat, lr=0.1)
        self.reference = torch.optim.AdamW([p for ps in self.reference_packs.values() for p in ps], lr=0.1)
        names = {id(p): f"p{pack}.{i}" for pack, params in self.packs.items() for i, p in enumerate(params)}
        # one step in host memory on both, so there is state to store
        for packs, optimizer in ((self.packs, self.optimizer), (self.reference_packs, self.reference)):
            _grads(packs, 0)
            optimizer.step()
        self.tier = StateTier(path, self.optimizer, self.packs, names, **tier_options)
        self.tier.store_all(1)
        self.steps = 1

    def step(self) -> None:
        """One step through the tier: every pack read, streamed through its update and written."""
        self.steps += 1
        _grads(self.packs, self.steps)
        self.tier.begin(self.steps)
        for pack in self.packs:
            self.tier.read(pack).result()
            self.tier.update(pack, lambda params: step_subset(self.optimizer, params))
            self.tier.write(pack)
        self.tier.wait_written()
        self.tier.finish()
        self.tier.wait_committed()

    def reference_step(self) -> None:
        _grads(self.reference_packs, self.steps)
        self.reference.step()

    def assert_same(self) -> None:
        for pack, params in self.packs.items():
            for param, twin in zip(params, self.reference_packs[pack]):
                assert torch.equal(param, twin)
                stored, expected = self.tier.stored(param), self.reference.state[twin]
                assert stored.keys() == {"exp_avg", "exp_avg_sq"}
                assert all(torch.equal(stored[key], expected[key]) for key in stored)
                assert torch.equal(self.optimizer.state[param]["step"], expected["step"])  # scalars stay


def _files(path) -> dict:
    """The manifest, after checking each file it names against its size and every tensor against
    its CRC-32, and that no other state file is there."""
    manifest = json.loads((path / tier_module.MANIFEST).read_text())
    for entry in manifest["packs"].values():
        data = (path / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"] and len(data) % 4096 == 0  # whole pages (O_DIRECT)
        for *_, offset, nbytes, crc in entry["tensors"]:
            assert offset % 64 == 0 and zlib.crc32(data[offset:offset + nbytes]) == crc
    assert {f for f in os.listdir(path) if f.endswith(".state")} == {e["file"] for e in manifest["packs"].values()}
    return manifest


def test_store_all_moves_the_tensor_state_to_files_and_keeps_the_scalars(tmp_path):
    pair = Pair(tmp_path)
    manifest = _files(tmp_path)
    assert sorted(map(int, manifest["packs"])) == [0, 1] and manifest["step"] == 1
    for params in pair.packs.values():
        for param in params:
            assert set(pair.optimizer.state[param]) == {"step"}  # the moments left host memory
    pair.assert_same()


def test_steps_through_the_tier_equal_host_memory_bitwise_and_replace_their_files(tmp_path):
    pair = Pair(tmp_path)
    before = _files(tmp_path)
    for _ in range(3):
        pair.step()
        pair.reference_step()
        pair.assert_same()
    after = _files(tmp_path)
    assert after["step"] == 4 and after["generation"] > before["generation"]
    assert not {e["file"] for e in before["packs"].values()} & {e["file"] for e in after["packs"].values()}


def test_the_state_in_flight_stays_within_the_policys_bound(tmp_path):
    pair = Pair(tmp_path)
    pair.tier.begin(2)
    _grads(pair.packs, 2)
    for pack in pair.packs:
        pair.tier.read(pack).result()
        pair.tier.update(pack, lambda params: step_subset(pair.optimizer, params))
    pair.tier.wait_written()
    io = pair.tier.finish()
    pair.tier.wait_committed()
    largest = max(2 * p.numel() * p.element_size() for params in pair.packs.values() for p in params)
    assert 0 < io.peak_staged <= staged_params(1) * largest
    assert io.bytes["read"] == io.bytes["write"] == sum(
        2 * p.numel() * p.element_size() for params in pair.packs.values() for p in params)


def test_an_aborted_step_leaves_the_files_and_the_state_as_before(tmp_path):
    pair = Pair(tmp_path)
    before = _files(tmp_path)
    pair.tier.begin(2)
    _grads(pair.packs, 2)
    pair.tier.read(0).result()
    pair.tier.update(0, lambda params: step_subset(pair.optimizer, params))
    pair.tier.abort()
    assert _files(tmp_path) == before
    for params in pair.packs.values():
        for param in params:
            assert "exp_avg" not in pair.optimizer.state[param]  # what it read left host memory
    for pack, params in pair.packs.items():  # the files hold the state of before the step
        for param, twin in zip(params, pair.reference_packs[pack]):
            stored = pair.tier.stored(param)
            assert torch.equal(stored["exp_avg"], pair.reference.state[twin]["exp_avg"])


def test_a_failed_write_undoes_the_step(tmp_path, monkeypatch):
    pair = Pair(tmp_path)
    before = _files(tmp_path)

    def full_disk(self, io, pack):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StateTier, "_finish_file", full_disk)
    pair.tier.begin(2)
    _grads(pair.packs, 2)
    with pytest.raises(OSError, match="No space left"):
        for pack in pair.packs:
            pair.tier.read(pack).result()
            pair.tier.update(pack, lambda params: step_subset(pair.optimizer, params))
        pair.tier.wait_written()
    pair.tier.abort()
    assert _files(tmp_path) == before  # the step's partial files deleted
    monkeypatch.undo()
    pair.step()  # the tier works on from the state before the failed step
    assert _files(tmp_path)["step"] == 2


def test_a_commit_that_fails_after_the_step_returned_is_undone(tmp_path, monkeypatch):
    pair = Pair(tmp_path)
    before = _files(tmp_path)

    def failing_commit(io):
        raise OSError("the manifest could not be replaced")

    monkeypatch.setattr(pair.tier, "_commit", failing_commit)
    with pytest.raises(OSError, match="manifest could not be replaced"):
        pair.step()  # waits for the commit
    monkeypatch.undo()
    pair.tier.abort_pending()
    manifest = _files(tmp_path)
    assert manifest["packs"] == before["packs"] and manifest["step"] == before["step"]


def test_a_changed_byte_is_refused(tmp_path):
    pair = Pair(tmp_path)
    entry = _files(tmp_path)["packs"]["0"]
    path = tmp_path / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["tensors"][0][4]] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(TierCorrupted, match="CRC-32"):
        pair.tier.stored(pair.packs[0][0])


def test_fp32_masters_on_the_tier_leave_bf16_copies_and_come_back(tmp_path):
    pair = Pair(tmp_path, master_packs=[1], compute_dtype=torch.bfloat16)
    for param, twin in zip(pair.packs[1], pair.reference_packs[1]):
        assert param.dtype == torch.bfloat16 and torch.equal(param, twin.to(torch.bfloat16))
        assert torch.equal(pair.tier.stored_master(param), twin)
    assert all(p.dtype == torch.float32 for p in pair.packs[0])  # pack 0's masters stay in host memory
    pair.tier.masters_to_host()
    for param, twin in zip(pair.packs[1], pair.reference_packs[1]):
        assert param.dtype == torch.float32 and torch.equal(param, twin)
