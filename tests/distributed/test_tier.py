"""``Trainer(nvme_path=...)`` across processes (gloo on 127.0.0.1): each rank keeps its whole
(replicated) optimizer state on its own tier, ``nvme_path/rank<r>``, and the ranks train like one
process in host memory, bit for bit; a write failing on one rank undoes the step on every rank."""
from __future__ import annotations

import json

import pytest
import torch

from harmony_fx.runtime import tier
from tests.distributed import launch, scenarios


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (see test_updates.py)
    try:
        yield scenarios.one_process(2)
    finally:
        torch.set_num_threads(threads)


def _same(rank: dict, reference: dict) -> None:
    assert all(torch.equal(a, b) for a, b in zip(rank["losses"], reference["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(rank["params"], reference["params"]))
    for index, state in reference["state"].items():
        assert all(torch.equal(rank["state"][index][key], value) for key, value in state.items())


def test_two_ranks_each_with_a_tier_equal_one_process_bitwise(tmp_path, reference):
    ranks = launch.run("train", 2, tmp_path, shard_optimizer=False, nvme=True)
    for number, rank in enumerate(ranks):
        _same(rank, reference)
        # what host memory holds for optimizer state, measured, is lower by the plan's bytes on the tier
        assert rank["state_bytes"] == reference["state_bytes"] - rank["tier_bytes"] and rank["tier_bytes"] > 0
        manifest = json.loads((tmp_path / "tier" / f"rank{number}" / tier.MANIFEST).read_text())
        assert manifest["step"] == scenarios.STEPS - 1 and manifest["packs"]


@pytest.mark.parametrize("failing_file", [pytest.param(1, id="first"),
                                         pytest.param(3, id="last", marks=pytest.mark.slow)])
def test_a_write_failing_on_one_rank_undoes_the_step_on_every_rank(tmp_path, reference, failing_file):
    """The first pack's file fails while the step updates the others; the last one's after every
    update: the ranks agree on a step only once each has its files on its drive."""
    ranks = launch.run("tier_write_fails", 2, tmp_path, failing_file=failing_file)
    assert ranks[1]["errors"] == ["OSError: [Errno 28] No space left on device (injected)"]
    assert ranks[0]["errors"] == ["StepFailedElsewhere: Trainer.step: step 2 failed on rank(s) 1; it was undone here too"]
    for rank in ranks:
        _same(rank, reference)


def test_what_it_refuses_across_processes_says_what_to_do(tmp_path):
    (refused, _) = [rank["refused"] for rank in launch.run("tier_refusals", 2, tmp_path)]
    assert "pass shard_optimizer=False" in refused["sharded"] and refused["sharded by default"] is False
    assert "max_grad_norm" in refused["clipping"] and "train in one process" in refused["clipping"]
    assert "drop_last=True" in refused["smaller batch"]


def test_resume_from_a_checkpoint_folder_is_bit_identical(tmp_path):
    for rank in launch.run("tier_resumed", 2, tmp_path):
        assert all(torch.equal(a, b) for a, b in zip(rank["later"], rank["again"]))
        assert all(torch.equal(a, b) for a, b in zip(*rank["params"]))
        for index, state in rank["first"].items():
            assert all(torch.equal(rank["resumed"][index][key], value) for key, value in state.items())
