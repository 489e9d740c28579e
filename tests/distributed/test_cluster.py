"""A peer that hangs: the others raise within the group's timeout, naming it, instead of waiting."""
from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import launch


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores (which run has it: tests/tiers.py)
def test_a_hung_rank_is_named_after_the_timeout(tmp_path):
    timeout = 4
    processes = launch.start("hanging", 2, tmp_path, timeout=30, hang_in_step=1)
    # (the scenario's own collective_timeout is 4 s; the process group's default timeout above is
    # only for its start)
    survivor, hung = processes
    result = launch.finish([survivor], tmp_path, timeout=120)[0]
    hung.kill()
    hung.wait()
    assert "rank(s) 1 did not report" in result["error"] and "step 1" in result["error"]
    # the collective gives up after the timeout; the report window adds at most 5 s
    assert timeout <= result["seconds"] < timeout + 15


def test_shard_optimizer_without_processes_is_refused():
    import torch

    import harmony_fx

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="trains alone"):
        harmony_fx.Trainer(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                           (torch.randn(2, 4), torch.randn(2, 4)), shard_optimizer=True)


@pytest.mark.slow  # two processes to show a refusal: the default suite keeps test_tier's
def test_ranks_that_cut_the_model_differently_are_refused(tmp_path):
    for rank in launch.run("different_packs", 2, tmp_path):
        assert rank["error"].startswith("Trainer: rank(s) 1 differ from rank 0 in how the model is cut into packs")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads by their names in /proc")
def test_close_destroys_the_groups_the_trainer_made(tmp_path):
    """Their gloo threads are joined at ``close``, or when an unclosed Trainer is collected, not
    whenever the interpreter's exit gets to them (a checkpoint's mesh keeps none alive); the caller's
    own group stays, and closing twice, or after ``destroy_process_group()``, is fine."""
    for rank in launch.run("closed", 2, tmp_path):
        callers, collected_threads, open_threads, closed_threads = rank.pop("threads")
        assert rank == {"before": [True, True], "after": [False, False], "world_kept": True}
        assert open_threads > callers > 0 and closed_threads == callers == collected_threads


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads by their names in /proc")
def test_a_trainer_left_open_has_its_groups_ended_before_the_interpreter_finalizes(tmp_path):
    """A gloo thread still alive when the interpreter finalizes can abort the process as it lets go
    of a tensor (``harmony_fx.distributed.cluster``): the Trainer's own exit hook joins its groups'
    threads first, and it holds no reference to the caller's group, which is gone once destroyed."""
    for rank, result in enumerate(launch.run("left_open", 2, tmp_path)):
        assert result["open"] > result["callers"] > 0
        assert torch.load(tmp_path / f"exit{rank}.pt") == 0


def test_every_rank_starts_from_rank_0s_model(tmp_path):
    """As DDP's constructor: a rank whose parameters or buffers differ takes rank 0's (a head each
    process initialised with its own seed would otherwise train as a different replica per rank)."""
    from tests.distributed import scenarios

    model, _ = scenarios.model_and_batches(2)
    rank0 = {**model.state_dict(), "seen": torch.zeros(3, dtype=torch.int64)}
    ranks = launch.run("different_start", 2, tmp_path)
    for rank in ranks:
        assert rank["start"].keys() == rank0.keys()
        for name, value in rank0.items():
            torch.testing.assert_close(rank["start"][name], value, rtol=0, atol=0, msg=name)
    for ours, theirs in zip(ranks[0]["params"] + ranks[0]["losses"], ranks[1]["params"] + ranks[1]["losses"]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
