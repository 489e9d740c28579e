"""Several HostDevices, data-parallel: every device runs every pack on its share of the
microbatches; gradients meet on the host; the host updates once every device has sent its share.

Models without dropout or BatchNorm must match eager (BatchNorm normalises per microbatch and
dropout draws per microbatch, so those two differ from a full-batch eager step by construction;
for them the bytes and peaks are still checked exactly). Chaos mode runs every stream on its own
thread with random delays, so a missing wait would show up as a wrong number.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.models import GPTConfig, MLPChain, TinyGPT
from harmony_fx.program.actions import ActionKind, ActionKind as K, Stream
from harmony_fx.testing.models import ResidualMLP, SmallCNN
from tests.memory_witness import DeviceMemoryWitness

torch.set_num_threads(1)

RTOL, ATOL = 1e-5, 1e-6


def _gpt_loss(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _build(name: str):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "mlp_chain":
        model, x = MLPChain(width=32, depth=8), torch.randn(16, 32, generator=generator)
        target = torch.randint(0, 10, (16,), generator=generator)
        return model, x, target, F.cross_entropy
    if name == "residual_mlp":
        model, x = ResidualMLP(width=32, depth=6), torch.randn(16, 32, generator=generator)
        target = torch.randint(0, 10, (16,), generator=generator)
        return model, x, target, F.cross_entropy
    if name == "tiny_gpt":
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_embd=32, dropout=0.0)
        model = TinyGPT(config)
        x = torch.randint(0, 64, (8, 16), generator=generator)
        return model, x, torch.roll(x, 1, dims=1), _gpt_loss
    model, x = SmallCNN(channels=8, depth=4), torch.randn(8, 3, 8, 8, generator=generator)
    return model, x, torch.randint(0, 10, (8,), generator=generator), F.cross_entropy


def _train(name: str, num_devices: int, chaos: int | None, steps: int = 3, parallel: str = "dp",
           microbatches: int | None = None, **options):
    model, x, target, loss_fn = _build(name)
    reference = copy.deepcopy(model)
    budget = int(0.35 * eager_training_bytes(model, (x,), lambda out: loss_fn(out, target)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, ((x,), target), memory_budget=budget,
                                 devices=[f"host:{i}" for i in range(num_devices)],
                                 microbatches=microbatches or 2 * num_devices, chaos=chaos, parallel=parallel,
                                 **options)
    losses, reference_losses = [], []
    try:
        with DeviceMemoryWitness() as witness:  # counts what the devices hold, apart from the runtime
            for _ in range(steps):
                losses.append(trainer.step(((x,), target)))
                reference_loss = loss_fn(reference(x), target)
                reference_loss.backward()
                reference_optimizer.step()
                reference_optimizer.zero_grad()
                reference_losses.append(reference_loss.detach())
    finally:
        trainer.close()
    witnessed = {device.name: witness.peak_of(device) for device in trainer.hm.devices}
    return trainer, model, reference, losses, reference_losses, witnessed, budget


def _train_pp(name: str, num_devices: int, microbatches: int = 4, steps: int = 3, chaos: int | None = None):
    return _train(name, num_devices, chaos, steps, parallel="pp", microbatches=microbatches)


# a second and third chaos seed, and the small GPT on three devices (12-14 s each), out of the default suite: the
# default suite under 8 minutes on 2 cores
_DP_CASES = [pytest.param(chaos, name, num_devices, id=f"{chaos_id}-{name}-{num_devices}",
                          marks=[pytest.mark.slow] if chaos in (1, 2) or (name, num_devices) == ("tiny_gpt", 3) else [])
             for chaos, chaos_id in ((None, "inline"), (0, "chaos0"), (1, "chaos1"), (2, "chaos2"))
             for name in ("mlp_chain", "residual_mlp", "tiny_gpt") for num_devices in (2, 3)]


@pytest.mark.parametrize("chaos, name, num_devices", _DP_CASES)
def test_dp_trains_like_eager(name, num_devices, chaos):
    trainer, model, reference, losses, reference_losses, witnessed, budget = _train(name, num_devices, chaos)
    for loss, reference_loss in zip(losses, reference_losses):
        torch.testing.assert_close(loss, reference_loss, rtol=RTOL, atol=ATOL)
    for (param_name, param), reference_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, reference_param, rtol=RTOL, atol=ATOL, msg=param_name)
    stats = trainer.stats
    assert set(stats.peak_bytes) == {f"host:{i}" for i in range(num_devices)}
    assert witnessed == stats.peak_bytes == trainer.plan.predicted_peak
    assert all(peak <= budget for peak in witnessed.values())
    assert stats.as_dict()["bytes_by_kind"] == trainer.plan.predicted_bytes


@pytest.mark.parametrize("chaos", [None, 5])
def test_dp_with_batchnorm_moves_the_planned_bytes(chaos):
    trainer, *_, witnessed, budget = _train("small_cnn", 2, chaos, steps=1)
    assert trainer.stats.as_dict()["bytes_by_kind"] == trainer.plan.predicted_bytes
    assert witnessed == trainer.stats.peak_bytes
    assert all(peak <= budget for peak in witnessed.values())


def test_every_device_runs_every_pack_on_its_own_microbatches():
    trainer, *_ = _train("mlp_chain", 2, None, steps=1)
    num_packs = len(trainer.hm.packs)
    for device_index, (forward, backward) in enumerate(trainer.hm.device_actions):
        tasks = [a for a in forward + backward if a.kind == ActionKind.FWD]
        assert {a.pack for a in tasks} == set(range(num_packs))
        assert {a.mb for a in tasks} == set(trainer.hm.device_microbatches[device_index])
    assert trainer.hm.device_microbatches == [(0, 1), (2, 3)]
    per_device = trainer.stats.as_dict()["bytes_by_device"]
    assert per_device["host:0 h2d/weights"] == per_device["host:1 h2d/weights"] > 0


def test_explain_prints_a_step_by_device_grid():
    trainer, *_ = _train("mlp_chain", 2, None, steps=1)
    text = trainer.explain()
    header = next(line for line in text.splitlines() if line.startswith("step"))
    assert "host:0" in header and "host:1" in header
    assert "F p0@0" in text and "F p0@2" in text and "U p0" in text


def test_busy_seconds_per_stream_are_reported():
    trainer, *_ = _train("mlp_chain", 2, None, steps=1, timeline=True)
    busy = trainer.stats.busy_seconds
    assert busy["compute"] > 0 and busy["h2d"] > 0 and busy["d2h"] > 0


def test_no_timeline_is_recorded_unless_asked(tmp_path):
    trainer, *_ = _train("mlp_chain", 2, None, steps=1)
    assert trainer.stats.spans == [] and trainer.stats.memory == {}
    with pytest.raises(ValueError, match="record_timeline"):
        trainer.save_trace(tmp_path / "trace.json")
    assert trainer.stats.bytes_h2d == trainer.plan.bytes_h2d  # the counters still count


def test_fewer_microbatches_than_devices_is_refused():
    model, x, target, loss_fn = _build("mlp_chain")
    with pytest.raises(ValueError, match="at least one microbatch per device"):
        harmony_fx.compile(model, x, devices=["host:0", "host:1"], microbatches=1, parallel="dp")


class _SoftmaxOverTheBatch(torch.nn.Module):
    """Its samples are computed together: no microbatch computes what the whole batch does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.softmax(torch.relu(self.a(x)), dim=0))))


@pytest.mark.parametrize("parallel", ["auto", "pp"])
@pytest.mark.parametrize("name", ["softmax over the batch", "batchnorm"])
def test_a_batch_kept_whole_on_several_devices_runs_as_a_pipeline_like_eager(name, parallel):
    """microbatches=None: the planner keeps such a batch whole, and the devices take turns on it.
    (It was cut into one microbatch per device, which changes the loss, every gradient and
    BatchNorm's running statistics.)"""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "batchnorm":
        model, x = SmallCNN(channels=8, depth=4), torch.randn(8, 3, 8, 8, generator=generator)
    else:
        model, x = _SoftmaxOverTheBatch(), torch.randn(8, 16, generator=generator)
    reference = copy.deepcopy(model)
    options = dict(devices=["host:0", "host:1"], parallel=parallel)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refusal:
        harmony_fx.compile(model, x, memory_budget=1, **options)
    hm = harmony_fx.compile(model, x, memory_budget=refusal.value.smallest_budget, **options)
    hm(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert hm.device_microbatches == [(0,), (0,)] and len(hm.packs) > 1
    for (param_name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=RTOL, atol=ATOL, msg=param_name)
    for buffer, expected in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(buffer, expected, rtol=RTOL, atol=ATOL)


class _ReshapedToItsBatch(torch.nn.Module):
    """A reshape to the batch's own size, written as a number: a microbatch cannot be captured."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)).reshape(8, -1))))


def test_auto_on_several_devices_runs_a_batch_it_cannot_cut_as_a_pipeline_like_eager():
    """Every cut of the batch failing (a microbatch's graph raises), parallel='auto' has the devices
    take turns on the whole batch, as 'pp' does. (It raised the CaptureError of one microbatch per
    device, advising batch_dims, which did not apply.)"""
    torch.manual_seed(0)
    model, x = _ReshapedToItsBatch(), torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    options = dict(devices=["host:0", "host:1"], parallel="auto")
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refusal:  # the pipeline's, saying the cuts failed
        harmony_fx.compile(model, x, memory_budget=1, **options)
    assert "microbatches" in str(refusal.value) and "CaptureError" in str(refusal.value)
    hm = harmony_fx.compile(model, x, memory_budget=refusal.value.smallest_budget, **options)
    hm(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert hm.device_microbatches == [(0,), (0,)] and len(hm.packs) > 1
    assert "the devices in turn on the whole batch" in hm.explain()
    for (param_name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=RTOL, atol=ATOL, msg=param_name)


@pytest.mark.parametrize("num_devices", [2, 3])
@pytest.mark.parametrize("name", ["mlp_chain", "residual_mlp", "tiny_gpt"])
@pytest.mark.parametrize("chaos", [None, 0, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["inline", "chaos0", "chaos1"])
def test_pp_trains_like_eager(name, num_devices, chaos):
    trainer, model, reference, losses, reference_losses, witnessed, budget = _train_pp(name, num_devices, chaos=chaos)
    for loss, reference_loss in zip(losses, reference_losses):
        torch.testing.assert_close(loss, reference_loss, rtol=RTOL, atol=ATOL)
    for (param_name, param), reference_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, reference_param, rtol=RTOL, atol=ATOL, msg=param_name)
    stats = trainer.stats
    assert witnessed == stats.peak_bytes == trainer.plan.predicted_peak
    assert all(peak <= budget for peak in witnessed.values())
    assert stats.as_dict()["bytes_by_kind"] == trainer.plan.predicted_bytes
    assert stats.as_dict()["bytes_by_kind"].get("peer/act", 0) > 0  # activations went device to device


@pytest.mark.parametrize("num_devices", [2, 3])
def test_pp_with_a_weight_tied_across_devices_trains_like_eager(num_devices):
    """The small GPT ties its embedding to its head; one pack per layer puts the two on different
    devices, so the tied weight's update waits, on the host, for the other device's gradient copy
    (an UPDATE names only its own program's events)."""
    trainer, model, reference, losses, reference_losses, witnessed, budget = _train(
        "tiny_gpt", num_devices, None, 3, parallel="pp", microbatches=4, pack_boundaries=list(range(14)))
    assert len(trainer.hm.packs) == 14 and trainer.hm.packs[-1].layers[-1] == 13  # the small GPT's 14 layers
    # the embedding's update (with the first pack that holds the tied weight) waits on the host
    # for the head's gradient copy from another device
    first = min(p.index for p in trainer.hm.packs if "p_model_lm_head_weight" in p.params)
    backward = next(b for _, b in trainer.hm.device_actions if any(a.kind == K.UPDATE and a.pack == first for a in b))
    update = next(i for i, a in enumerate(backward) if a.kind == K.UPDATE and a.pack == first)
    assert any(a.kind == K.WAIT and a.stream == Stream.HOST and a.peer is not None for a in backward[:update])
    for loss, reference_loss in zip(losses, reference_losses):
        torch.testing.assert_close(loss, reference_loss, rtol=RTOL, atol=ATOL)
    for (param_name, param), reference_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, reference_param, rtol=RTOL, atol=ATOL, msg=param_name)


@pytest.mark.parametrize("name, num_devices, chaos", [("mlp_chain", 2, None), ("residual_mlp", 3, None),
                                                       pytest.param("tiny_gpt", 2, None, marks=pytest.mark.slow),
                                                       ("residual_mlp", 2, 0)])
def test_pp_handing_on_through_the_host_trains_like_peer_and_frees_per_microbatch(name, num_devices, chaos):
    """``handoff="host"``: the next device reads the stash, each microbatch's values are freed as
    soon as their copy landed: the same numbers bitwise, no peer traffic, and no device's peak
    above the device-to-device hand-off's (both measured by the witness)."""
    peer = _train(name, num_devices, chaos, 2, parallel="pp", microbatches=4)
    # the same packs for both (planned apart, each hand-off could pack the budget its own way)
    boundaries = [pack.layers[0] for pack in peer[0].hm.packs]
    host = _train(name, num_devices, chaos, 2, parallel="pp", microbatches=4, handoff="host",
                  pack_boundaries=boundaries)
    trainer, model, witnessed = host[0], host[1], host[5]
    for param, expected in zip(model.parameters(), peer[1].parameters()):
        assert torch.equal(param, expected)
    assert [float(x) for x in host[3]] == [float(x) for x in peer[3]]
    assert witnessed == trainer.stats.peak_bytes == trainer.plan.predicted_peak
    assert all(witnessed[d] <= peer[5][d] for d in witnessed)
    moved = trainer.stats.as_dict()["bytes_by_kind"]
    assert moved == trainer.plan.predicted_bytes and not any(k.startswith("peer/") for k in moved)
    # every output of a pack's task is freed before the pack's next task (device to device, they
    # stay until the pack ends)
    last = len(trainer.hm.packs) - 1
    for forward, _ in trainer.hm.device_actions:
        tasks = [(i, a) for i, a in enumerate(forward) if a.kind == ActionKind.FWD and a.pack < last]
        for (i, task), (j, following) in zip(tasks, tasks[1:]):
            if following.pack == task.pack:
                freed = {a.key.name for a in forward[i:j] if a.kind == ActionKind.FREE and a.key.mb == task.mb}
                assert set(trainer.hm.packs[task.pack].outputs) <= freed, (task, freed)


def test_pp_with_batchnorm_moves_the_planned_bytes():
    trainer, *_, witnessed, budget = _train_pp("small_cnn", 2, microbatches=2, steps=1)
    assert trainer.stats.as_dict()["bytes_by_kind"] == trainer.plan.predicted_bytes
    assert witnessed == trainer.stats.peak_bytes
    assert all(peak <= budget for peak in witnessed.values())


def test_pp_places_tasks_round_the_devices():
    trainer, *_ = _train_pp("mlp_chain", 2, steps=1)
    num_packs = len(trainer.hm.packs)
    for device, (forward, backward) in enumerate(trainer.hm.device_actions):
        for action in forward + backward:
            if action.kind == ActionKind.FWD:
                assert action.pack % 2 == device
            if action.kind == ActionKind.BWD:
                assert (2 * (num_packs - 1) - action.pack) % 2 == device
    kinds = {a.kind for forward, backward in trainer.hm.device_actions for a in forward + backward}
    assert ActionKind.SEND in kinds and ActionKind.RECV in kinds


def test_verifier_refuses_a_recv_without_its_send():
    from harmony_fx.program.verify import ProgramError, verify_devices
    trainer, *_ = _train_pp("mlp_chain", 2, steps=1)
    programs = [forward + backward for forward, backward in trainer.hm.device_actions]
    verify_devices(programs)
    sender = next(d for d, program in enumerate(programs) if any(a.kind == ActionKind.SEND for a in program))
    index = next(i for i, a in enumerate(programs[sender]) if a.kind == ActionKind.SEND)
    broken = [list(program) for program in programs]
    del broken[sender][index]
    with pytest.raises(ProgramError, match="no matching SEND"):
        verify_devices(broken)


def test_verifier_refuses_devices_that_wait_for_each_other():
    from harmony_fx.program.verify import ProgramError, verify_devices
    trainer, *_ = _train_pp("mlp_chain", 2, steps=1)
    programs = [list(forward + backward) for forward, backward in trainer.hm.device_actions]
    # move device 0's first RECV to the very start: it now waits for a SEND that comes after a wait for it
    receiver = next(d for d, program in enumerate(programs) if any(a.kind == ActionKind.RECV for a in program))
    recvs = [i for i, a in enumerate(programs[receiver]) if a.kind == ActionKind.RECV]
    last_recv = programs[receiver].pop(recvs[-1])
    programs[receiver].insert(0, last_recv)
    with pytest.raises(ProgramError, match="cycle"):
        verify_devices(programs)


@pytest.mark.parametrize("chaos", [None, 0, 1, 2])
def test_data_parallel_keeps_the_first_devices_running_statistics_whatever_the_timing(chaos):
    """Each device updates its own copy of the one host master; every device wrote it back, and the
    last writer won (under chaos one microbatch's update was lost in most runs). As DDP's
    broadcast_buffers: device 0's, its microbatches in order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    expected = copy.deepcopy(model)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    for part in x[:4], x[4:8]:  # device 0's two microbatches of the four
        expected(part)
    with pytest.warns(UserWarning, match="BatchNorm in training"):
        hm = harmony_fx.compile(model, x, devices=["host:0", "host:1"], parallel="dp", microbatches=4, chaos=chaos,
                                pack_boundaries=[0, 2])
    hm(x).sum().backward()
    assert hm.device_microbatches == [(0, 1), (2, 3)]
    for buffer, want in zip(model.buffers(), expected.buffers()):
        torch.testing.assert_close(buffer, want)
