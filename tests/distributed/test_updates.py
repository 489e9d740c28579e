"""Training across processes (gloo on 127.0.0.1): N ranks with one HostDevice each train like one
process with N HostDevices data-parallel on the same global batch. Where gradients live is checked
on a gloo group of one process too (``one_rank_group``): the replicated path, in seconds."""
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


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores (which run has it: tests/tiers.py)
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


@pytest.mark.parametrize("shard_optimizer", [False, True])
def test_a_rank_whose_batch_is_cut_into_other_packs_updates_as_every_rank(tmp_path, one_thread, shard_optimizer):
    """Rank 1's second batch is twice as large and its plan cuts the model into other packs than the
    example's. Replicated, rank 1 updated the packs the example lacks with its own gradient, then
    again with the summed one: the replicas differed from the second step, silently. Its gradients
    now land as its packs complete and update in the example's packs, in every rank's order."""
    ranks = launch.run("other_packs", 2, tmp_path, shard_optimizer=shard_optimizer, timeout=30)
    assert ranks[1]["packs"][1] != ranks[1]["example packs"]  # the case: rank 1's second step, other packs
    eager = scenarios.other_packs_eager()
    for rank in ranks:
        for step, (params, expected) in enumerate(zip(rank["params"], eager), 1):
            torch.testing.assert_close(params, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"][-1], ranks[1]["params"][-1]))


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


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone (the Trainer takes it as ``process_group``: the replicated
    path, collectives and all, in a test of a few seconds)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("devices", [["host:0"], ["host:0", "host:1"]], ids=["one device", "two devices"])
def test_replicated_gradients_land_in_one_buffer_per_pack_that_is_all_reduced_in_place(one_rank_group, devices):
    """HostDevices that copy gradients to the host, as a GPU does (the tests' track_memory). Each
    ``.grad`` is a view of its pack's buffer, the same memory every step, which the all-reduce is
    handed; with one device the gradients land in those views, so one set of gradient memory is
    alive at every all-reduce. Two devices: each gradient is the sum of two shares (and the tied
    head's of two packs), one of which landed elsewhere. Gradients and weights equal the same
    training without processes, bit for bit."""
    import harmony_fx

    def trainer_of(**across):
        model, batches = scenarios.model_and_batches(1, steps=3)
        trainer = harmony_fx.Trainer(model, scenarios.loss_fn, scenarios.optimizer_of(model), batches[0],
                                     devices=devices, parallel="dp" if len(devices) > 1 else "auto",
                                     microbatches=scenarios.MICROBATCHES * len(devices),
                                     pack_boundaries=scenarios.PACKS, **across)
        return trainer, batches

    trainer, batches = trainer_of(process_group=one_rank_group, shard_optimizer=False)
    watch = scenarios.GradientWatch(trainer)
    reference, _ = trainer_of()
    first_grads = None
    for step, batch in enumerate(batches):
        assert torch.equal(trainer.step(batch), reference.step(batch))
        watch.step_ended()
        for param, theirs in zip(watch.params, reference.model.parameters()):
            assert torch.equal(param.grad, theirs.grad) and torch.equal(param, theirs)
        if first_grads is None:
            first_grads = [p.grad for p in watch.params]  # held: a new buffer could not reuse their memory
        assert [p.grad.data_ptr() for p in watch.params] == [g.data_ptr() for g in first_grads], f"step {step}"
    # per step, one all-reduce per pack with parameters, handed all its gradients, the same memory every step
    per_step = len(watch.packs)
    assert len(watch.handed) == 3 * per_step
    assert watch.handed[:per_step] == watch.handed[per_step:2 * per_step] == watch.handed[2 * per_step:]
    assert sorted(numel for _, numel in watch.handed[:per_step]) == sorted(
        sum(watch.params[i].numel() for i in indices) for indices in watch.packs.values())
    for pointer, numel in watch.handed[:per_step]:  # each .grad inside the buffer handed to the all-reduce
        inside = [pointer <= p.grad.data_ptr() < pointer + 4 * numel for p in watch.params]
        assert sum(p.numel() for p, yes in zip(watch.params, inside) if yes) == numel
    if len(devices) == 1:
        assert watch.landed_in_grad and all(watch.landed_in_grad)  # no copy between landing and the all-reduce
        # from the second step on, when every .grad is set (the first step's packs have none before their turn)
        assert set(watch.alive_bytes[per_step:]) == {watch.one_set_bytes()}



@pytest.mark.slow  # two processes (~15 s); the one-rank test above keeps the property in the default suite
def test_two_ranks_keep_one_set_of_host_gradients(tmp_path):
    """2 gloo ranks, replicated, a HostDevice copying its gradients as a GPU does: each lands in
    its ``.grad``, the same memory every step, and one set of gradient memory is alive at every
    all-reduce from the second step on."""
    for rank in launch.run("grad_memory", 2, tmp_path):
        per_step = len(rank["packs"])
        assert rank["grads"][0] == rank["grads"][1] == rank["grads"][2]
        assert rank["landed_in_grad"] and all(rank["landed_in_grad"])
        assert set(rank["alive_bytes"][per_step:]) == {rank["one_set_bytes"]}

class _HalfBf16(torch.nn.Module):
    """An fp32 layer, then a bf16 one: the second's gradients are bf16, which an fp32 buffer cannot
    take as they land."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 4).to(torch.bfloat16)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)).bfloat16()).float()


def test_bf16_parameters_are_summed_in_fp32_and_get_a_bf16_grad(one_rank_group):
    import harmony_fx

    batch = (torch.randn(4, 8), torch.randn(4, 4))
    runs = []
    for across in ({}, {"process_group": one_rank_group, "shard_optimizer": False}):
        torch.manual_seed(0)
        model = _HalfBf16()
        trainer = harmony_fx.Trainer(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                                     batch, devices=["host:0"], pack_boundaries=(0, 2), **across)
        losses = [trainer.step(batch) for _ in range(2)]
        runs.append((losses, list(model.parameters()), trainer))
    (losses, params, _), (cross_losses, cross_params, trainer) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses, cross_losses))
    assert [p.grad.dtype for p in cross_params] == [torch.float32] * 2 + [torch.bfloat16] * 2
    for mine, theirs in zip(cross_params, params):
        assert torch.equal(mine.grad, theirs.grad) and torch.equal(mine, theirs)
    flats = [flat.data_ptr() for flat in trainer._cross.flats.values()]
    assert [p.grad.untyped_storage().data_ptr() in flats for p in cross_params] == [True, True, False, False]



def test_the_buffers_the_forward_updates_are_rank_0s_on_every_rank(tmp_path, one_thread):
    """Each rank updated BatchNorm's running statistics from its own share, and the replicas drifted
    apart (0.136 after one step): after each step every rank holds rank 0's, as under DDP's
    broadcast_buffers."""
    ranks = launch.run("batch_norm", 2, tmp_path)
    for step in range(2):
        for buffer, other in zip(ranks[0]["buffers"][step], ranks[1]["buffers"][step]):
            torch.testing.assert_close(buffer, other, msg=f"step {step}")
    # after the first step, rank 0's statistics: its first share through the initial weights
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
    reference(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)))
    for buffer, expected in zip(ranks[0]["buffers"][0], reference.buffers()):
        torch.testing.assert_close(buffer, expected)
    assert int(ranks[0]["buffers"][1][2]) == 2  # num_batches_tracked: one update a step


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_is_refused_with_sharded_state_and_runs_replicated(one_rank_group, kind):
    """Sharded, each rank holds a chunk of the summed gradient and the optimizer steps the chunks: a
    hook on the parameter has no whole gradient to run on, and was skipped, silently (a pruning mask
    not applied). It is refused, naming the parameter; replicated, it runs on the summed gradient,
    as in one process (here it zeroes the head's gradient, so SGD leaves the head as it was)."""
    import harmony_fx

    def trainer_of(**across):
        model, batches = scenarios.model_and_batches(1, steps=2)
        head = model.h[1].mlp[2].weight
        if kind == "register_hook":
            head.register_hook(torch.zeros_like)
        else:
            head.register_post_accumulate_grad_hook(lambda p: p.grad.zero_())
        trainer = harmony_fx.Trainer(model, scenarios.loss_fn, torch.optim.SGD(model.parameters(), lr=0.5),
                                     batches[0], devices=["host:0"], pack_boundaries=scenarios.PACKS, **across)
        return trainer, batches, head

    trainer, batches, head = trainer_of(process_group=one_rank_group, shard_optimizer=True)
    before = head.detach().clone()
    with pytest.raises(ValueError, match=r"'h.1.mlp.2.weight' has a gradient hook .*shard_optimizer=False"):
        trainer.step(batches[0])
    assert torch.equal(head, before)
    trainer, batches, head = trainer_of(process_group=one_rank_group, shard_optimizer=False)
    before = head.detach().clone()
    for batch in batches:
        trainer.step(batch)
    assert torch.equal(head, before)
