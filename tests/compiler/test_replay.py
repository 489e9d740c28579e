"""compiler.replay: a planning run that replays the compute tasks it met before holds what the run
that executes every task holds: the same peak, each task's net and peak bytes, the same action
first at the peak. On one device over uneven microbatches, data-parallel and a pipeline, across
packings of one model that share their records, and on GPT-2's repeated blocks; a replay that
leaves other bytes than its record makes the run start again without replays; packs that draw
random numbers replay like the others."""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.compiler import replay
from harmony_fx.compiler.estimate import estimate_device
from harmony_fx.compiler.replay import TaskRecords
from harmony_fx.models import MLPChain

TWO = ["host:0", "host:1"]


def _estimates(hm: harmony_fx.HarmonyModule, records: TaskRecords | None) -> list:
    compiled = hm.compiled
    layout = compiled.layout
    found = []
    for device, (forward, backward) in enumerate(compiled.device_actions):
        microbatches = layout.device_microbatches[device] + tuple(f for f, _ in layout.device_forward_parts(device))
        estimate = estimate_device(forward, backward, microbatches, compiled.packs_by_size, compiled.shapes,
                                   compiled.candidate.signature, compiled.devices[device].torch_device, records)
        found.append((estimate.peak, estimate.task_memory, estimate.peak_at))
    return found


def _compiled(model: nn.Module, x: torch.Tensor, **options) -> harmony_fx.HarmonyModule:
    return harmony_fx.compile(model, (x,), **options)


@pytest.mark.parametrize("options", [
    dict(microbatches=3),  # 4, 3, 3 samples
    dict(microbatches=4, devices=TWO, parallel="dp"),
    dict(microbatches=3, devices=TWO, parallel="pp"),
], ids=["uneven", "dp", "pp"])
def test_replayed_runs_hold_what_running_every_task_holds(options):
    torch.manual_seed(0)
    model, x = MLPChain(width=16, depth=6), torch.randn(10, 16)
    records = TaskRecords()
    for boundaries in [(0, 2, 4), tuple(range(7))]:  # the second packing replays the first one's blocks
        hm = _compiled(model, x, pack_boundaries=boundaries, **options)
        executed = _estimates(hm, None)
        for _ in range(2):  # the second time round, every task replays
            assert _estimates(hm, records) == executed
    assert records.replayed > records.ran


def test_gpt2_blocks_run_once_and_replay_after():
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    model, batch = build_hf_model("gpt2", num_layers=4), hf_batch("gpt2")
    hm = harmony_fx.compile(model, (), example_kwargs=batch, microbatches=2, devices=["host:0"])
    layers = len(hm.compiled.variants[hm.mb_sizes[0]].layers)
    hm = harmony_fx.compile(model, (), example_kwargs=batch, microbatches=2, devices=["host:0"],
                            pack_boundaries=tuple(range(layers)))
    records = TaskRecords()
    assert _estimates(hm, records) == _estimates(hm, None)
    # each of the blocks 1-3 replays its forward, recompute and backward on both microbatches
    # (what block 0 ran), and so does every pack's second microbatch
    assert records.replayed >= 3 * 3 * 2


def test_a_replay_leaving_other_bytes_runs_again_without_replays(monkeypatch):
    torch.manual_seed(0)
    hm = _compiled(MLPChain(width=16, depth=6), torch.randn(10, 16), pack_boundaries=tuple(range(7)), microbatches=2)
    records = TaskRecords()
    _estimates(hm, records)
    for signature, record in list(records._records.items()):  # every record now one byte off
        if record is not None:
            records._records[signature] = replay._Record(record.transient, record.net + 1, record.storages,
                                                         record.writes, record.kept, record.grads)
    runs = []
    original = replay.ReplayingProbe.__init__

    def counting(self, *args, **kwargs):
        runs.append(kwargs.get("records"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(replay.ReplayingProbe, "__init__", counting)
    assert _estimates(hm, records) == _estimates(hm, None)
    assert len(runs) == 1  # the replaying run, given up for one without replays


def test_packs_that_draw_random_numbers_replay_like_the_others():
    """A dropout's mask has its input's size whatever numbers it draws (and a planning run, on
    FakeTensors, draws none): a random pack's tasks replay, and the run holds what one that runs
    every task holds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    hm = _compiled(model, torch.randn(8, 16), pack_boundaries=(0, 1, 2, 3, 4), microbatches=2)
    random_packs = [index for index, pack in enumerate(hm.packs) if pack.random]
    assert random_packs and len(hm.packs) - 1 not in random_packs  # the last pack always runs
    records = TaskRecords()
    executed = _estimates(hm, None)
    assert _estimates(hm, records) == executed
    replayed = records.replayed
    assert _estimates(hm, records) == executed
    # the second time round, every task of every pack but the last replays: the random ones' too
    assert records.replayed - replayed == 3 * 2 * (len(hm.packs) - 1)


def test_a_backward_that_hands_on_no_gradient_replays_as_none():
    """A pipeline's pack whose outputs' gradients all come from the other device: run alone in the
    planning run, its backward gets none and writes its input's gradient as None, which the SEND
    after it hands on. The replay left the key out, and the SEND raised KeyError (4 microbatches:
    the third replays the second's record)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    trainer = harmony_fx.Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.0), (x, y),
                                 devices=["host:0", "host:1"], parallel="pp", microbatches=4,
                                 pack_boundaries=[0, 5, 6, 7])
    try:
        loss = trainer.step((x, y))
    finally:
        trainer.close()
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_the_holders_of_each_storage_are_counted_as_values_come_and_go():
    """``_held_elsewhere`` asks at every task whether another key holds a storage of the task's values:
    counted as the device's values change (a scan of every value made the planning run of n
    microbatches O(n^2)), the count is what a scan finds, after every kind of change."""
    from hypothesis import given, settings, strategies as st

    from harmony_fx.compiler.replay import _Holders, _storages
    from harmony_fx.ir.tracking import storage_key
    from harmony_fx.program.actions import Key, KeyKind

    bases = [torch.zeros(8) for _ in range(3)]
    # values: a tensor, a view of another's storage, a tuple of two, None
    kinds = [lambda b: bases[b], lambda b: bases[b][2:], lambda b: (bases[b], bases[(b + 1) % 3][:1]), lambda b: None]
    keys = [Key(KeyKind.ACT, f"v{i}", 0) for i in range(4)]
    operation = st.tuples(st.sampled_from(["set", "pop", "del", "update", "setdefault", "clear"]),
                          st.integers(0, 3), st.integers(0, 3), st.integers(0, 2))

    @settings(max_examples=60, deadline=None)
    @given(st.lists(operation, max_size=12))
    def check(operations):
        values = _Holders({})
        for name, key, kind, base in operations:
            key, value = keys[key], kinds[kind](base)
            if name == "set":
                values[key] = value
            elif name == "pop":
                values.pop(key, None)
            elif name == "del" and key in values:
                del values[key]
            elif name == "update":
                values.update({key: value})
            elif name == "setdefault":
                values.setdefault(key, value)
            elif name == "clear":
                values.clear()
            scanned = collections.Counter(storage for value in values.values() for storage in _storages(value))
            assert +values.holders == scanned
        for key in keys:  # held elsewhere: by a key other than this one
            mine = _storages(values.get(key))
            scan = any(storage_key(leaf) in mine for other, value in values.items() if other != key
                       for leaf in replay._tensors(value))
            assert any(values.holders[storage] > 1 for storage in mine) == scan

    check()


def test_a_later_microbatch_leaves_each_weight_grad_the_tensor_the_real_run_leaves(monkeypatch):
    """Autograd adds a later microbatch's weight gradients into ``.grad`` in place: the real run's
    ``.grad`` stays one tensor across a pack's microbatches, and a replayed backward keeps it
    (not a new alias of its storage, which costs a tensor and a ``.grad`` set per weight and
    microbatch). Seen per pack and microbatch: whether each weight's ``.grad`` is the tensor the
    pack's previous microbatch left."""
    from harmony_fx.runtime.executor import Runtime

    torch.manual_seed(0)
    hm = _compiled(MLPChain(width=16, depth=6), torch.randn(12, 16), pack_boundaries=tuple(range(7)), microbatches=4)
    kept = []
    original = Runtime.bwd

    def noting(self, pack_index, mb):
        weights = self.device_values[replay.Key(replay.KeyKind.WEIGHTS, self.packs_for_mb[mb][pack_index].name)]
        before = [weight.grad for weight in weights]
        event = original(self, pack_index, mb)
        kept.append((pack_index, mb, tuple(weight.grad is grad for weight, grad in zip(weights, before))))
        return event

    monkeypatch.setattr(Runtime, "bwd", noting)
    _estimates(hm, None)
    executed, kept[:] = list(kept), []
    records = TaskRecords()
    _estimates(hm, records)
    _estimates(hm, records)  # every task but the last pack's replays
    assert records.replayed > records.ran
    assert kept[len(kept) // 2:] == executed
    assert any(all(same) and same for _, mb, same in executed if mb > 0)  # the pattern is not vacuous
