"""Training across processes (gloo on 127.0.0.1): N ranks with one HostDevice each train like one
process with N HostDevices data-parallel on the same global batch."""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import launch, scenarios


@pytest.fixture
def one_thread():
    """The ranks run one thread each (OMP_NUM_THREADS=1, as torchrun sets it): so does the
    reference, since a reduction's result depends on how many threads split it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _shards(numels, world):
    """Bytes of one rank's padded chunks of every parameter (fp32)."""
    return sum(4 * math.ceil(n / world) for n in numels)


# replicated state is the sharded path less the shards: slow, so the default suite stays under 8 minutes
@pytest.mark.parametrize("shard_optimizer", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_two_ranks_equal_one_process_bitwise(tmp_path, one_thread, shard_optimizer):
    ranks = launch.run("train", 2, tmp_path, shard_optimizer=shard_optimizer)
    reference = scenarios.one_process(2)
    for rank in ranks:
        assert all(torch.equal(a, b) for a, b in zip(rank["losses"], reference["losses"]))
        assert all(torch.equal(a, b) for a, b in zip(rank["params"], reference["params"]))
        for index, state in reference["state"].items():
            assert all(torch.equal(rank["state"][index][key], value) for key, value in state.items())
    # optimizer state held per rank, measured: half of one process's when sharded
    expected = reference["state_bytes"] // 2 if shard_optimizer else reference["state_bytes"]
    assert [rank["state_bytes"] for rank in ranks] == [expected, expected]


@pytest.mark.slow  # 14 s; two ranks against one process stay in the default suite
@pytest.mark.parametrize("shard_optimizer", [True, False])
def test_three_ranks_within_1e6_and_send_what_the_formula_says(tmp_path, one_thread, shard_optimizer):
    ranks = launch.run("train", 3, tmp_path, shard_optimizer=shard_optimizer)
    reference = scenarios.one_process(3)
    model, _ = scenarios.model_and_batches(3, steps=0)
    names = [name for name, _ in model.named_parameters()]
    width = model.wte.weight.shape[1]
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-6, atol=1e-6)
        for name, mine, theirs in zip(names, rank["params"], reference["params"]):
            if name.endswith("qkv.bias"):
                # the key bias's gradient is exactly zero (softmax ignores a shift shared by a row's
                # scores), so what reaches Adam is rounding noise, which it scales up to ~lr: another
                # summation order (3 ranks' ring vs 3 devices' arrival order) moves it by up to lr a step
                keys = slice(width, 2 * width)
                torch.testing.assert_close(mine[keys], theirs[keys], rtol=0, atol=2 * scenarios.LR * scenarios.STEPS)
                mine, theirs = torch.cat([mine[:width], mine[2 * width:]]), torch.cat([theirs[:width], theirs[2 * width:]])
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6, msg=name)
    # bytes per rank: G the gradients (fp32) as the collectives carry them; a ring all-reduce sends
    # 2(N-1)/N G, gloo's reduce-scatter as much, an all-gather of the weights (N-1)/N G
    numels, world = ranks[0]["numels"], 3
    padded = world * _shards(numels, world)
    if shard_optimizer:
        expected = {"reduce_scatter": 2 * padded * (world - 1) // world, "all_gather": padded * (world - 1) // world}
    else:
        expected = {"all_reduce": 2 * 4 * sum(numels) * (world - 1) // world}
    for rank in ranks:
        assert sum(rank["network_bytes"].values()) == pytest.approx(sum(expected.values()), abs=8 * len(numels))
        assert rank["network_bytes"].keys() == expected.keys()
    state_per_rank = [rank["state_bytes"] for rank in ranks]
    if shard_optimizer:  # Adam's two moments of each rank's chunks
        assert sum(state_per_rank) == reference["state_bytes"]
        assert max(state_per_rank) <= 2 * _shards(numels, world)


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores; run with -m slow
def test_a_step_failing_on_one_rank_is_undone_on_every_rank(tmp_path, one_thread):
    """Rank 1's backward fails in step 2: rank 1 raises its error, rank 0 ``StepFailedElsewhere``,
    both put the step back and retry it; the run ends as one that never failed."""
    ranks = launch.run("one_rank_fails", 2, tmp_path)
    unbroken = launch.run("train", 2, tmp_path / "unbroken")
    assert ranks[0]["errors"] == ["StepFailedElsewhere: Trainer.step: step 2 failed on rank(s) 1; it was undone here too"]
    assert ranks[1]["errors"] == ["RuntimeError: a task failed on rank 1"]
    for rank in ranks:
        assert rank["undone"]
        assert all(torch.equal(a, b) for a, b in zip(rank["losses"], unbroken[0]["losses"]))
        assert all(torch.equal(a, b) for a, b in zip(rank["params"], unbroken[0]["params"]))


@pytest.mark.slow  # 12 s; even shares across ranks stay in the default suite
def test_uneven_shares_weigh_by_their_sizes(tmp_path, one_thread):
    """A last, short batch: rank 0 has 4 samples, rank 1 has 2; the step equals one process on the
    6 samples."""
    ranks = launch.run("uneven", 2, tmp_path)
    reference = scenarios.uneven_one_process()
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rank["params"], reference["params"], rtol=1e-6, atol=1e-6)


def test_a_packs_gradients_travel_while_earlier_packs_run_their_backward(tmp_path):
    for rank in launch.run("overlap", 2, tmp_path):
        assert rank["overlapped"]  # the first pack's collective started before an earlier pack's backward
        assert rank["reduces"] == rank["order"] == sorted(rank["order"], reverse=True)


@pytest.mark.parametrize("shard_optimizer", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_clipping_by_the_global_norm_across_ranks(tmp_path, one_thread, shard_optimizer):
    """``max_grad_norm``: the norm of every rank's summed gradients (small enough to clip every step)."""
    ranks = launch.run("train", 2, tmp_path, shard_optimizer=shard_optimizer, max_grad_norm=0.05)
    reference = scenarios.one_process(2, max_grad_norm=0.05)
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rank["params"], reference["params"], rtol=1e-5, atol=1e-6)
