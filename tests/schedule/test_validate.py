"""The verifier refuses programs that race, read freed memory or overflow: mutate a real program."""
from __future__ import annotations

import functools

import pytest

import harmony_fx
from harmony_fx.schedule.actions import Action, ActionKind as K, Key, KeyKind, Stream
from harmony_fx.schedule.validate import ProgramError, check_peak, verify_program
from tests.helpers import ZOO, eager_bytes

COMPUTE = (K.FWD, K.RECOMPUTE, K.BWD)


@functools.lru_cache(maxsize=None)
def _compiled():
    model, inputs, _ = ZOO["mlp_chain"].build(0)
    hm = harmony_fx.compile(model, inputs, memory_budget=eager_bytes("mlp_chain") // 2)
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
    device = hm.device.name
    peak = hm.plan.predicted_peak[device]
    check_peak(peak, peak, device)
    check_peak(peak, None, device)
    with pytest.raises(ProgramError) as info:
        check_peak(peak, peak - 1, device)
    assert device in str(info.value) and str(peak) in str(info.value)
