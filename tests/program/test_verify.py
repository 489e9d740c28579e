"""The verifier refuses programs that race, read freed memory or overflow: mutate a real program.

Every mutation of a compiled program that breaks it is refused with a ``ProgramError`` naming the
offending action and the pass that made it: any ``WAIT`` deleted, any ``FREE`` moved before its last
use or before the copy that reads it has finished, a ``SEND``/``RECV`` order that deadlocks the
devices or sends what is not made yet, a budget below the static peak.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch

import harmony_fx
from harmony_fx.compiler.packing import BudgetTooSmallError
from harmony_fx.models import MLPChain
from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind, Stream
from harmony_fx.program.verify import ProgramError, check_peak, verify_program
from tests.helpers import ZOO, eager_bytes

COMPUTE = (K.FWD, K.RECOMPUTE, K.BWD)


@functools.lru_cache(maxsize=None)
def _compiled(**options):
    model, inputs, _ = ZOO["mlp_chain"].build(0)
    options.setdefault("memory_budget", eager_bytes("mlp_chain") // 2)
    hm = harmony_fx.compile(model, inputs, **options)
    assert len(hm.packs) >= 3
    return hm


def _verify(actions: list[Action]) -> None:
    """Verify forward + backward as one program, as ``compile`` does."""
    hm = _compiled()
    signature, num_mb = hm.signature, hm.num_microbatches
    host_keys = [Key(KeyKind.ACT, v, mb) for v in signature.model_inputs for mb in range(num_mb)]
    host_keys += [Key(KeyKind.GRAD, v, mb) for v in signature.model_outputs for mb in range(num_mb)]
    results = [a.key for a in actions[len(hm.forward_actions):] if a.kind == K.OFFLOAD]
    verify_program(actions, host_keys, results)


@pytest.fixture
def program() -> list[Action]:
    hm = _compiled()
    return list(hm.forward_actions) + list(hm.backward_actions)


def _index(program, predicate) -> int:
    return next(i for i, action in enumerate(program) if predicate(action))


def test_the_compiled_program_verifies(program):
    _verify(program)


def test_forward_alone_verifies():
    hm = _compiled()
    host_keys = [Key(KeyKind.ACT, v, 0) for v in hm.signature.model_inputs]
    verify_program(hm.forward_actions, host_keys)


def test_missing_wait_on_the_compute_stream_is_refused(program):
    # the compute stream waits for the second pack's weights: drop that wait
    prefetch = _index(program, lambda a: a.kind == K.PREFETCH and a.key == Key(KeyKind.WEIGHTS, "p1"))
    event = program[prefetch].event
    wait = _index(program, lambda a: a.kind == K.WAIT and a.stream == Stream.COMPUTE and a.event == event)
    user = _index(program, lambda a: a.kind in COMPUTE and Key(KeyKind.WEIGHTS, "p1") in a.reads + a.consumes)
    assert prefetch < wait < user
    mutated = program[:wait] + program[wait + 1:]
    with pytest.raises(ProgramError) as info:
        _verify(mutated)
    message = str(info.value)
    assert repr(program[user]) in message  # names the action that reads too early
    assert f"e{event}" in message and "WAIT" in message
    assert "lower_program" in message  # and the pass that made it


def test_free_before_the_wait_for_its_offload_is_refused(program):
    # FREE act[...] is preceded by the compute stream's WAIT for the OFFLOAD that reads it
    for free in (i for i, a in enumerate(program) if a.kind == K.FREE and a.key.kind == KeyKind.ACT):
        key = program[free].key
        offload = max((i for i in range(free) if program[i].kind == K.OFFLOAD and program[i].key == key), default=None)
        if offload is None:
            continue
        event = program[offload].event
        waits = [i for i in range(offload, free) if program[i].kind == K.WAIT and program[i].event == event
                 and program[i].stream == Stream.COMPUTE]
        if waits:
            break
    else:
        pytest.fail("no FREE that follows a WAIT for the offload reading it")
    mutated = list(program)
    moved = mutated.pop(free)
    mutated.insert(waits[0], moved)
    with pytest.raises(ProgramError) as info:
        _verify(mutated)
    message = str(info.value)
    assert repr(moved) in message
    assert f"e{event}" in message and "released" in message


def test_deleted_prefetch_is_refused(program):
    prefetch = _index(program, lambda a: a.kind == K.PREFETCH and a.key.kind == KeyKind.ACT)
    removed = program[prefetch]
    without_copy = program[:prefetch] + program[prefetch + 1:]
    with pytest.raises(ProgramError):  # its WAITs now wait for an event nothing records
        _verify(without_copy)
    # without the copy and its waits, the task that reads the key finds it missing
    without_copy_or_waits = [a for a in without_copy if not (a.kind == K.WAIT and a.event == removed.event)]
    with pytest.raises(ProgramError, match="not on the device") as info:
        _verify(without_copy_or_waits)
    assert str(removed.key) in str(info.value)


def test_wait_for_an_unrecorded_event_is_refused(program):
    mutated = [Action(K.WAIT, Stream.COMPUTE, event=10_000)] + program
    with pytest.raises(ProgramError, match="e10000"):
        _verify(mutated)


def test_double_free_is_refused(program):
    free = _index(program, lambda a: a.kind == K.FREE)
    mutated = program[:free + 1] + [program[free]] + program[free + 1:]
    with pytest.raises(ProgramError, match="not on the device"):
        _verify(mutated)


def test_missing_host_wait_for_a_result_is_refused(program):
    hm = _compiled()
    last_wgrad = max(i for i, a in enumerate(program) if a.kind == K.OFFLOAD and a.key.kind == KeyKind.WGRAD)
    event = program[last_wgrad].event
    mutated = [a for a in program if not (a.kind == K.WAIT and a.stream == Stream.HOST and a.event == event)]
    assert len(mutated) == len(program) - 1
    assert len(hm.backward_actions) > 0
    with pytest.raises(ProgramError, match=f"e{event}"):
        _verify(mutated)


def test_check_peak():
    hm = _compiled()
    device = hm.devices[0].name
    peak = hm.plan.predicted_peak[device]
    check_peak(peak, peak, device)
    check_peak(peak, None, device)
    with pytest.raises(ProgramError) as info:
        check_peak(peak, peak - 1, device)
    assert device in str(info.value) and f"{peak:,}" in str(info.value)


# ---------------------------------------------------------------------- every mutation, as compile verifies

NAMES_ACTION = re.compile(r"action #\d+ `[^`]+` \(created by (lower_program|lower_pipeline)\)")


def _refused(verify, device_actions, what: str) -> str:
    with pytest.raises(ProgramError) as info:
        verify(device_actions)
    message = str(info.value)
    assert NAMES_ACTION.search(message), f"{what}: the error names no action and pass: {message}"
    return message


def _single(program: list[Action], num_forward: int) -> list[tuple[list[Action], list[Action]]]:
    return [(program[:num_forward], program[num_forward:])]


def _uses(action: Action, key: Key) -> bool:
    return key in action.reads + action.consumes + action.writes or (
        action.kind in (K.OFFLOAD, K.SEND) and action.key == key)


def test_deleting_any_wait_is_refused(program):
    """(a) each WAIT is needed: without it a use races its transfer, a copy or FREE races what it
    reads, or the program ends (or updates) before a copy to the host landed."""
    hm = _compiled()
    num_forward = len(hm.forward_actions)
    hm.verify(_single(program, num_forward))
    waits = [i for i, a in enumerate(program) if a.kind == K.WAIT]
    assert len(waits) > 20
    for i in waits:
        mutated = program[:i] + program[i + 1:]
        _refused(hm.verify, _single(mutated, num_forward - (i < num_forward)), f"without #{i} {program[i]!r}")


def test_moving_any_free_before_its_last_use_is_refused(program):
    """(b) the error names the FREE that moved, wherever the verifier notices it."""
    hm = _compiled()
    num_forward = len(hm.forward_actions)
    frees = [i for i, a in enumerate(program) if a.kind == K.FREE]
    assert len(frees) > 5
    for i in frees:
        free = program[i]
        last_use = max(j for j in range(i) if _uses(program[j], free.key))
        mutated = list(program)
        mutated.insert(last_use, mutated.pop(i))
        message = _refused(hm.verify, _single(mutated, num_forward), f"{free!r} before #{last_use}")
        assert repr(free) in message


def test_moving_a_free_before_the_copy_reading_it_finished_is_refused(program):
    """(b) FREE before the compute stream waited for the OFFLOAD that reads the key."""
    hm = _compiled()
    num_forward = len(hm.forward_actions)
    moved = 0
    for i, free in enumerate(program):
        if free.kind != K.FREE:
            continue
        copies = {a.event for a in program[:i] if a.kind == K.OFFLOAD and free.key in (a.reads or (a.key,))}
        waits = [j for j in range(i) if program[j].kind == K.WAIT and program[j].event in copies
                 and program[j].stream == Stream.COMPUTE]
        if not waits:
            continue
        mutated = list(program)
        mutated.insert(waits[-1], mutated.pop(i))
        message = _refused(hm.verify, _single(mutated, num_forward), f"{free!r} before its copy finished")
        assert repr(free) in message and "may still read it" in message
        moved += 1
    assert moved >= 3  # activations, weight gradients


def test_budget_below_the_static_peak_is_refused():
    """(d) the error names the action after which the program holds its peak."""
    hm = _compiled()
    boundaries = [min(pack.layers) for pack in hm.packs]
    candidate = hm.compiled.candidate
    assert list(candidate.boundaries) == boundaries
    device, peak, at = hm.devices[0].name, candidate.peaks[0], candidate.estimates[0].peak_at
    assert peak == hm.plan.predicted_peak[device]
    index, action = at
    assert action.kind in (K.PREFETCH, K.FWD, K.RECOMPUTE, K.BWD, K.RECV)  # what takes memory
    check_peak(peak, peak, device, at)
    with pytest.raises(ProgramError) as info:
        check_peak(peak, peak - 1, device, at)
    message = str(info.value)
    assert NAMES_ACTION.search(message) and repr(action) in message and f"#{index}" in message
    assert f"{peak:,}" in message and f"{peak - 1:,}" in message
    # the same packs (without the planner's larger forward packs) fetch each stash one task ahead;
    # one byte less, just in time (one microbatch's stash less on the device)
    ahead = _compiled(pack_boundaries=tuple(boundaries))
    ahead_peak = ahead.plan.predicted_peak[device]
    tighter = _compiled(memory_budget=ahead_peak - 1, pack_boundaries=tuple(boundaries))
    just_in_time = tighter.plan.predicted_peak[device]
    assert ahead.signature.stash_ahead and not tighter.signature.stash_ahead and just_in_time < ahead_peak
    assert [a.kind for a in tighter.backward_actions].count(K.PREFETCH) == \
        [a.kind for a in ahead.backward_actions].count(K.PREFETCH)  # the same copies, later
    # and one byte below that is refused, naming the budget they need
    with pytest.raises(BudgetTooSmallError) as info:
        _compiled(memory_budget=just_in_time - 1, pack_boundaries=tuple(boundaries))
    assert info.value.smallest_budget == just_in_time


# ---------------------------------------------------------------------- several devices: a pipeline


@functools.lru_cache(maxsize=None)
def _pipeline():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=6)
    hm = harmony_fx.compile(model, torch.randn(8, 16), devices=["host:0", "host:1"], parallel="pp",
                            microbatches=2, pack_boundaries=(0, 2, 4))
    assert len(hm.packs) == 3
    return hm


def _mutate(device: int, change) -> list[tuple[list[Action], list[Action]]]:
    """The pipeline's programs with device ``device``'s forward + backward replaced by
    ``change(actions)`` (same length: the forward/backward split stays)."""
    hm = _pipeline()
    programs = [(list(forward), list(backward)) for forward, backward in hm.device_actions]
    forward, backward = programs[device]
    changed = change(forward + backward)
    programs[device] = (changed[:len(forward)], changed[len(forward):])
    return programs


def _swap(i: int, j: int):
    def change(actions):
        actions = list(actions)
        actions[i], actions[j] = actions[j], actions[i]
        return actions
    return change


def test_pipeline_verifies():
    hm = _pipeline()
    hm.verify(hm.device_actions)
    kinds = {a.kind for forward, backward in hm.device_actions for a in forward + backward}
    assert {K.SEND, K.RECV} <= kinds


def test_deleting_any_wait_of_a_pipeline_is_refused():
    """(a) including a device's wait for another device's copy to the host (``WAIT e3 h2d from
    d0``), which no single device's program can check."""
    hm = _pipeline()
    cross_device = 0
    for device, (forward, backward) in enumerate(hm.device_actions):
        program = forward + backward
        for i, wait in enumerate(program):
            if wait.kind != K.WAIT:
                continue
            programs = [(list(f), list(b)) for f, b in hm.device_actions]
            mutated = program[:i] + program[i + 1:]
            cut = len(forward) - (i < len(forward))
            programs[device] = (mutated[:cut], mutated[cut:])
            message = _refused(hm.verify, programs, f"d{device} without #{i} {wait!r}")
            if wait.peer is not None and wait.stream == Stream.H2D:
                assert f"from d{wait.peer}" in message
                cross_device += 1
    assert cross_device > 0


def test_swapping_a_send_and_a_recv_into_a_cycle_is_refused():
    """(c) device 0 now waits to receive what device 1 makes from what device 0 sends only after."""
    hm = _pipeline()
    program = hm.device_actions[0][0] + hm.device_actions[0][1]
    send = next(i for i, a in enumerate(program) if a.kind == K.SEND)
    # the first RECV whose key device 1 can only make from what this SEND hands it: the next pack's output
    recv = next(i for i, a in enumerate(program) if a.kind == K.RECV and a.key.mb == program[send].key.mb
                and a.key.kind == KeyKind.ACT)
    assert send < recv

    def recv_first(actions):  # the RECV moves up to just before the SEND; their waits stay where they were
        actions = list(actions)
        actions.insert(send, actions.pop(recv))
        return actions

    message = _refused(hm.verify, _mutate(0, recv_first), "RECV before SEND")
    assert "cycle" in message and repr(program[recv]) in message


def test_swapping_two_sends_is_refused():
    """(c) the earlier SEND now hands over a value its device has not made yet."""
    hm = _pipeline()
    program = hm.device_actions[0][0] + hm.device_actions[0][1]
    first, second = [i for i, a in enumerate(program) if a.kind == K.SEND][:2]
    message = _refused(hm.verify, _mutate(0, _swap(first, second)), "two SENDs swapped")
    assert repr(program[second]) in message and "not on the device" in message


def test_a_send_to_the_wrong_device_is_refused():
    """(c) the pairing breaks: the SEND has no RECV on its new peer, nor its RECV a SEND."""
    hm = _pipeline()
    program = hm.device_actions[0][0] + hm.device_actions[0][1]
    index = next(i for i, a in enumerate(program) if a.kind == K.SEND)
    send = program[index]

    def retarget(actions):
        actions = list(actions)
        actions[index] = Action(K.SEND, Stream.PEER, key=send.key, event=send.event, peer=0,
                                created_by=send.created_by, reads=send.reads)
        return actions

    message = _refused(hm.verify, _mutate(0, retarget), "SEND retargeted")
    assert "no matching" in message


# ---------------------------------------------------------------------- packs (the graph after split_packs)


def test_packs_of_a_compiled_model_verify():
    from harmony_fx.program.verify import verify_packs
    model, inputs, _ = ZOO["residual_mlp"].build(0)
    hm = harmony_fx.compile(model, inputs, pack_boundaries=(0, 3, 6), microbatches=1)
    verify_packs(hm.captured.gm)


def test_a_node_moved_into_an_earlier_pack_is_refused_naming_it_and_the_pass():
    from harmony_fx.ir import meta
    from harmony_fx.program.verify import verify_packs
    model, inputs, _ = ZOO["residual_mlp"].build(0)
    hm = harmony_fx.compile(model, inputs, pack_boundaries=(0, 3, 6), microbatches=1)
    gm = hm.captured.gm
    victim = next(n for n in gm.graph.nodes if n.meta.get(meta.PACK) == 2
                  and any(a.meta.get(meta.PACK) == 2 for a in n.all_input_nodes))
    victim.meta[meta.PACK] = 0  # reads a value of pack 2 from pack 0
    with pytest.raises(ProgramError, match=rf"{victim.name}.*not convex.*split_packs"):
        verify_packs(gm)


# ---------------------------------------------------------------------- updates on the host


def _mlp_chain_trainer(microbatches):
    """A Trainer of a 6-layer MLP chain in four fixed packs (closed: only its programs are read)."""
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=6)
    x, target = torch.randn(8, 16), torch.randint(0, 10, (8,))
    trainer = harmony_fx.Trainer(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                                 (x, target), microbatches=microbatches, pack_boundaries=(0, 2, 4, 6))
    trainer.close()
    return trainer


@functools.lru_cache(maxsize=None)
def _trainer_programs():
    trainer = _mlp_chain_trainer(2)
    hm = trainer.hm
    programs = [list(hm.forward_actions), list(hm.backward_actions)]
    update_packs = frozenset(a.pack for a in programs[0] + programs[1] if a.kind == K.UPDATE)
    return hm, programs, update_packs


def test_an_update_that_leaves_out_a_gradient_copy_is_refused():
    """Its worker would step parameters whose gradients are still on their way to the host."""
    hm, (forward, backward), update_packs = _trainer_programs()
    hm.verify([(forward, backward)], update_packs)
    named = [(i, a) for i, a in enumerate(backward) if a.kind == K.UPDATE and a.after]
    assert len(named) >= 2
    for i, update in named:
        for left_out in update.after:
            mutated = list(backward)
            mutated[i] = Action(K.UPDATE, Stream.HOST, pack=update.pack, device=update.device,
                                created_by=update.created_by, after=tuple(e for e in update.after if e != left_out))
            message = _refused(hm.verify, [(forward, mutated)], f"{update!r} without e{left_out}")
            assert f"e{left_out}" in message and "landed" in message


def test_the_issuing_thread_never_waits_on_the_host_between_two_backward_tasks():
    """The weight-gradient copies are the update worker's to wait for: between the first and the
    last compute task of the backward, no host wait stops the thread that issues the GPU's work."""
    hm, (forward, backward), _ = _trainer_programs()
    computes = [i for i, a in enumerate(backward) if a.kind in (K.RECOMPUTE, K.BWD)]
    between = [a for a in backward[computes[0]:computes[-1]] if a.kind == K.WAIT and a.stream == Stream.HOST]
    assert not between, between
    assert sum(a.kind == K.UPDATE for a in backward) >= 2  # and the updates still run during the backward


# ---------------------------------------------------------------------- larger forward microbatches


@functools.lru_cache(maxsize=None)
def _split_programs():
    trainer = _mlp_chain_trainer({"forward": 1, "backward": 4})
    return trainer.hm, [list(trainer.hm.forward_actions), list(trainer.hm.backward_actions)]


def test_the_split_programs_verify():
    hm, (forward, backward) = _split_programs()
    assert any(a.kind == K.SPLIT for a in forward)
    hm.verify([(forward, backward)])


def test_a_split_before_its_copy_landed_is_refused():
    hm, (forward, backward) = _split_programs()
    split = _index(forward, lambda a: a.kind == K.SPLIT)
    source = next(a.event for a in forward if a.kind == K.OFFLOAD and a.key == forward[split].key)
    mutated = [a for a in forward if not (a.kind == K.WAIT and a.event == source and a.stream == Stream.HOST)]
    message = _refused(hm.verify, [(mutated, backward)], "the host wait before a SPLIT deleted")
    assert "SPLIT" in message and "landed" in message


def test_a_prefetch_of_a_part_nobody_split_is_refused():
    hm, (forward, backward) = _split_programs()
    split = _index(forward, lambda a: a.kind == K.SPLIT)
    mutated = forward[:split] + forward[split + 1:]
    message = _refused(hm.verify, [(mutated, backward)], "a SPLIT deleted")
    assert "is not on the host" in message


# ---------------------------------------------------------------------- the NVMe tier (READ/WRITE S[pk])

TIER_NAMES_ACTION = re.compile(r"action #\d+ `[^`]+` \(created by (lower_program|insert_tier_io)\)")


@pytest.fixture(scope="module")
def tier_programs(tmp_path_factory):
    """A Trainer's programs with every pack's AdamW state on the tier: ``(hm, program, num_forward,
    update_packs)``, forward + backward as one list."""
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=6)
    x, target = torch.randn(8, 16), torch.randint(0, 10, (8,))
    trainer = harmony_fx.Trainer(model, torch.nn.functional.cross_entropy, torch.optim.AdamW(model.parameters()),
                                 (x, target), microbatches=2, pack_boundaries=(0, 2, 4, 6),
                                 nvme_path=tmp_path_factory.mktemp("nvme"))
    trainer.close()
    assert trainer.plan.tier_packs == (0, 1, 2, 3)
    (forward, backward), = trainer.hm.device_actions
    program = list(forward) + list(backward)
    return trainer.hm, program, len(forward), frozenset(a.pack for a in program if a.kind == K.UPDATE)


def _tier_refused(tier_programs, program: list[Action], num_forward: int, what: str) -> str:
    hm, _, _, update_packs = tier_programs
    with pytest.raises(ProgramError) as info:
        hm.verify(_single(program, num_forward), update_packs)
    message = str(info.value)
    assert TIER_NAMES_ACTION.search(message), f"{what}: the error names no action and pass: {message}"
    return message


def _tier_action(program: list[Action], kind: K, pack: int) -> int:
    return _index(program, lambda a: a.kind == kind and a.key == Key(KeyKind.STATE, f"p{pack}"))


def _update(program: list[Action], pack: int) -> int:
    return _index(program, lambda a: a.kind == K.UPDATE and a.pack == pack)


def test_the_tier_programs_verify(tier_programs):
    hm, program, num_forward, update_packs = tier_programs
    hm.verify(_single(program, num_forward), update_packs)
    assert {a.kind for a in program} >= {K.READ, K.WRITE}


def test_an_update_that_does_not_name_its_read_is_refused(tier_programs):
    """Its worker would step the pack before its state is back from the tier."""
    _, program, num_forward, _ = tier_programs
    for pack in range(4):
        i, read = _update(program, pack), program[_tier_action(program, K.READ, pack)]
        update = program[i]
        assert read.event in update.after
        mutated = list(program)
        mutated[i] = Action(K.UPDATE, Stream.HOST, pack=pack, device=update.device, created_by=update.created_by,
                            after=tuple(e for e in update.after if e != read.event))
        message = _tier_refused(tier_programs, mutated, num_forward, f"UPDATE p{pack} without e{read.event}")
        assert repr(mutated[i]) in message and "(created by lower_program)" in message
        assert f"steps p{pack} without waiting for its state: name the READ's e{read.event}" in message


def test_a_write_before_its_update_is_refused(tier_programs):
    """The write would store the state before the step changed it. p3 updates in the forward,
    whose write is at the backward's start: moved into the forward, it is refused there."""
    _, program, num_forward, _ = tier_programs
    for pack in range(4):
        write, update = _tier_action(program, K.WRITE, pack), _update(program, pack)
        assert update < write
        mutated = list(program)
        moved = mutated.pop(write)
        mutated.insert(update, moved)
        forward = num_forward + (write >= num_forward > update)  # it crossed into the forward
        message = _tier_refused(tier_programs, mutated, forward, f"{moved!r} before UPDATE p{pack}")
        assert repr(moved) in message and "(created by insert_tier_io)" in message
        assert f"writes S[p{pack}] back before it was read and its UPDATE p{pack} stepped it" in message


def test_a_second_read_of_the_same_state_is_refused(tier_programs):
    _, program, num_forward, _ = tier_programs
    for pack in range(4):
        first = _tier_action(program, K.READ, pack)
        read = program[first]
        again = Action(K.READ, Stream.IO, key=read.key, event=10_000 + pack, device=read.device,
                       created_by=read.created_by)
        mutated = program[:first + 1] + [again] + program[first + 1:]
        message = _tier_refused(tier_programs, mutated, num_forward + (first < num_forward), f"{read.key} twice")
        assert repr(again) in message
        assert f"reads S[p{pack}] a second time (first at action #{first} `{read!r}`" in message
