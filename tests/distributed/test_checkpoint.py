"""Checkpoint folders across processes: a rank killed mid-step, then resumed from ``latest`` at 2,
3 and 1 processes."""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.distributed import launch, scenarios


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An unbroken 2-rank run, and one whose rank 1 dies in step 3 (both save after every step)."""
    base = tmp_path_factory.mktemp("checkpoints")
    unbroken = launch.run("checkpointed", 2, base / "a", folder=str(base / "unbroken"))
    broken = launch.run("checkpointed", 2, base / "b", dying={1: 3}, folder=str(base / "broken"), die_in_step=3)
    return base, unbroken[0], broken[0]


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores; run with -m slow
def test_a_killed_rank_is_named_by_the_other_within_the_timeout(runs):
    base, _, survivor = runs
    assert survivor["step_count"] == 3  # the failed step was undone
    assert "rank(s) 1 did not report" in survivor["error"] and "step 3" in survivor["error"]
    assert survivor["seconds"] < 20  # the group's timeout: a dead peer is found well before it
    # the pointer names the last step every rank finished
    assert (base / "broken" / "latest").read_text().strip() == "step_00000003"


def test_resuming_at_two_ranks_gives_the_unbroken_losses_bitwise(runs, tmp_path):
    base, unbroken, _ = runs
    folder = tmp_path / "ck"
    shutil.copytree(base / "broken", folder)
    resumed = launch.run("checkpointed", 2, tmp_path / "out", folder=str(folder), resume=True)
    for rank in resumed:
        assert list(rank["losses"]) == [3, 4]
        assert all(torch.equal(rank["losses"][step], unbroken["losses"][step]) for step in (3, 4))


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores; run with -m slow
def test_resuming_at_three_ranks_and_in_one_process_within_1e6(runs, tmp_path):
    base, unbroken, _ = runs
    folder = tmp_path / "ck3"
    shutil.copytree(base / "broken", folder)
    three = launch.run("checkpointed", 3, tmp_path / "out", folder=str(folder), resume=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = scenarios.single_resumed(str(base / "broken"))
    finally:
        torch.set_num_threads(threads)
    for result in [*three, single]:
        assert list(result["losses"]) == [3, 4], result
        for step in (3, 4):
            torch.testing.assert_close(result["losses"][step], unbroken["losses"][step], rtol=1e-6, atol=1e-6)
