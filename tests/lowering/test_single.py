"""lower_program: the structure of the forward and backward programs (input-batch grouping, stash, recompute)."""
from __future__ import annotations

import collections
import functools

import pytest

import harmony_fx
from harmony_fx.program.actions import ActionKind as K, Key, KeyKind, Stream
from tests.helpers import ZOO, cached_train_step, eager_bytes

COMPUTE = (K.FWD, K.RECOMPUTE, K.BWD)


@functools.lru_cache(maxsize=None)
def _compiled(name: str, fraction: float, microbatches: int):
    if microbatches == 1:
        return cached_train_step(name, fraction).hm  # shared with test_api: compiled once
    model, inputs, _ = ZOO[name].build(0)
    return harmony_fx.compile(model, inputs, memory_budget=int(eager_bytes(name) * fraction),
                              microbatches=microbatches)


PROGRAMS = [
    pytest.param(("mlp_chain", 0.5, 1), id="mlp_chain"),
    pytest.param(("mlp_chain", 0.5, 4), id="mlp_chain-4mb"),
    pytest.param(("residual_mlp", 0.25, 1), id="residual_mlp"),
    pytest.param(("small_cnn", 0.5, 1), id="small_cnn"),
]


@pytest.fixture(params=PROGRAMS)
def hm(request):
    hm = _compiled(*request.param)
    assert len(hm.packs) >= 3, "these tests need a program of several packs"
    return hm


def _weights(p: int) -> Key:
    return Key(KeyKind.WEIGHTS, f"p{p}")


def test_forward_prefetches_each_packs_weights_once(hm):
    """Input-batch grouping: one PREFETCH W[p] per pack, whatever the number of microbatches."""
    prefetched = collections.Counter(a.key for a in hm.forward_actions
                                     if a.kind == K.PREFETCH and a.key.kind == KeyKind.WEIGHTS)
    assert prefetched == {_weights(p): 1 for p in range(len(hm.packs))}


def test_forward_runs_every_microbatch_of_a_pack_before_the_next_pack(hm):
    tasks = [(a.pack, a.mb) for a in hm.forward_actions if a.kind in COMPUTE]
    assert all(a.kind not in (K.RECOMPUTE, K.BWD) for a in hm.forward_actions)
    assert tasks == [(p, mb) for p in range(len(hm.packs)) for mb in range(hm.num_microbatches)]


def test_next_packs_weights_are_prefetched_while_this_pack_computes(hm):
    index = {(a.kind, a.key, a.pack, a.mb): i for i, a in enumerate(hm.forward_actions)}
    for p in range(len(hm.packs) - 1):
        prefetch_next = index[(K.PREFETCH, _weights(p + 1), None, None)]
        first_forward = index[(K.FWD, None, p, 0)]
        assert prefetch_next < first_forward


def test_backward_recomputes_every_pack_but_the_last(hm):
    last = len(hm.packs) - 1
    recomputed = [(a.pack, a.mb) for a in hm.backward_actions if a.kind == K.RECOMPUTE]
    backward = [(a.pack, a.mb) for a in hm.backward_actions if a.kind == K.BWD]
    mbs = range(hm.num_microbatches)
    assert sorted(recomputed) == [(p, mb) for p in range(last) for mb in mbs]
    assert backward == [(p, mb) for p in reversed(range(last + 1)) for mb in mbs]
    assert all(a.kind != K.FWD for a in hm.backward_actions)
    # each recompute comes right before the backward of its pack and microbatch
    tasks = [(a.kind, a.pack, a.mb) for a in hm.backward_actions if a.kind in COMPUTE]
    for position, (kind, p, mb) in enumerate(tasks):
        if kind == K.RECOMPUTE:
            assert tasks[position + 1] == (K.BWD, p, mb)


def test_every_prefetched_key_is_waited_on_compute_before_use(hm):
    made_by_copy: dict[Key, int] = {}
    waited_on_compute: set[int] = set()
    checked = 0
    for index, action in enumerate(hm.forward_actions + hm.backward_actions):
        if action.kind == K.PREFETCH:
            made_by_copy[action.key] = action.event
        elif action.kind == K.WAIT and action.stream == Stream.COMPUTE:
            waited_on_compute.add(action.event)
        elif action.kind in COMPUTE:
            for key in action.reads + action.consumes:
                if key in made_by_copy:
                    assert made_by_copy[key] in waited_on_compute, (
                        f"#{index} {action!r} reads {key} before the compute stream waits for its copy")
                    checked += 1
            for key in action.consumes + action.writes:
                made_by_copy.pop(key, None)
        elif action.kind == K.FREE:
            made_by_copy.pop(action.key, None)
    assert checked >= 2 * len(hm.packs)


def test_forward_returns_after_every_copy_landed(hm):
    offloads = {a.event for a in hm.forward_actions if a.kind == K.OFFLOAD}
    waited_on_host = {a.event for a in hm.forward_actions if a.kind == K.WAIT and a.stream == Stream.HOST}
    assert offloads and offloads <= waited_on_host


def test_program_leaves_nothing_on_the_device(hm):
    resident: set[Key] = set()
    for action in hm.forward_actions + hm.backward_actions:
        if action.kind == K.PREFETCH:
            resident.add(action.key)
        elif action.kind == K.FREE:
            assert action.key in resident, f"{action!r} frees a key that is not resident"
            resident.remove(action.key)
        elif action.kind in COMPUTE:
            resident -= set(action.consumes)
            resident |= set(action.writes)
    assert not resident


def test_skip_value_waits_on_the_host_between_its_packs():
    model, inputs, _ = ZOO["residual_mlp"].build(0)  # one microbatch, the fewest balanced packs that fit
    hm = harmony_fx.compile(model, inputs, memory_budget=int(eager_bytes("residual_mlp") * 0.25), microbatches=1)
    last = hm.packs[-1]
    far_inputs = [v for v in last.act_inputs if v not in hm.packs[-2].outputs]
    assert far_inputs, "the last pack reads no value from before the previous pack"
    skip = Key(KeyKind.ACT, far_inputs[0], 0)
    kinds = [a.kind for a in hm.forward_actions if a.key == skip]
    assert kinds == [K.OFFLOAD, K.FREE, K.PREFETCH]  # stashed, dropped, brought back for the far pack


def test_buffers_go_back_to_the_host_once_per_forward():
    hm = _compiled("small_cnn", 0.5, 1)
    out = [a.key for a in hm.forward_actions if a.kind == K.OFFLOAD and a.key.kind == KeyKind.BUFFERS]
    assert out == [Key(KeyKind.BUFFERS, pack.name) for pack in hm.packs if pack.mutated_buffers]
    assert out
    # recompute runs BatchNorm again on the device; those statistics never reach the host
    assert not [a for a in hm.backward_actions if a.kind == K.OFFLOAD and a.key.kind == KeyKind.BUFFERS]


def test_backward_fetches_each_stash_one_task_ahead(hm):
    """A copy onto the device waits for the compute issued before it: each recompute's stashed
    inputs are fetched before the task before it is issued, so the copy overlaps that task."""
    backward = hm.backward_actions
    computes = [i for i, a in enumerate(backward) if a.kind in (K.RECOMPUTE, K.BWD)]
    recomputes = [i for i in computes if backward[i].kind == K.RECOMPUTE]
    assert hm.signature.stash_ahead and recomputes
    checked = 0
    for i in recomputes:
        task = backward[i]
        before = [j for j in computes if j < i]
        if not before:
            continue
        previous = (backward[before[-1]].pack, backward[before[-1]].mb)
        previous_task_start = min(j for j in before if (backward[j].pack, backward[j].mb) == previous)
        # a stashed value the previous task read too (a skip connection over both packs) was resident
        # when this one's were fetched, and the previous recompute took it into its graph: it comes
        # again just in time (a known cost: the runtime's recompute takes over all of its inputs)
        previous_inputs = set(hm.packs[previous[0]].act_inputs) if previous[1] == task.mb else set()
        copies = [j for j, a in enumerate(backward[:i]) if a.kind == K.PREFETCH and a.key.kind == KeyKind.ACT
                  and a.key.mb == task.mb and a.key.name in hm.packs[task.pack].act_inputs
                  and a.key.name not in previous_inputs]
        if set(hm.packs[task.pack].act_inputs) - previous_inputs:
            assert copies and max(copies) < previous_task_start, f"{task!r} fetched its stash just in time"
        checked += 1
    assert checked >= len(recomputes) - 1
