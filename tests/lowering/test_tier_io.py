"""insert_tier_io: where the NVMe tier's READ/WRITE S[pk] and the host's waits for them go.

On a Trainer's programs (five Linear layers in four packs, ``nvme_path`` a temporary directory):
each tiered pack is read once and written once, by the program that updates it; its UPDATE names
the read; the write follows the update; each read goes one tiered pack ahead (the first at the
start of the program that updates it, each next one right after the update before it, or at the
backward's start); no program waits for a write (the last ones overlap the next step's forward);
and nothing else in the programs changes. The same holds for the pass applied to some of the packs, the code prints
the tier's calls, a pack nobody updates is refused, and in data-parallel only the first device
that updates a pack moves its state.
"""
from __future__ import annotations

import pytest

import harmony_fx
from harmony_fx.lowering.tier_io import insert_tier_io, state_key
from harmony_fx.program.actions import Action, ActionKind as K, Stream
from tests.helpers import four_pack_trainer

TIER = (K.READ, K.WRITE)


def _closed_trainer(**options) -> harmony_fx.Trainer:
    """``four_pack_trainer``, closed: only its programs are read."""
    trainer = four_pack_trainer(**options)
    trainer.close()
    return trainer


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> harmony_fx.Trainer:
    trainer = _closed_trainer(nvme_path=tmp_path_factory.mktemp("nvme"))
    assert trainer.plan.tier_packs == (0, 1, 2, 3) and trainer.plan.tier_bytes > 0
    return trainer


@pytest.fixture(scope="module")
def untiered() -> harmony_fx.Trainer:
    trainer = _closed_trainer()
    assert trainer.plan.tier_packs == ()
    return trainer


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory) -> harmony_fx.Trainer:
    return _closed_trainer(nvme_path=tmp_path_factory.mktemp("nvme_dp"), devices=["host:0", "host:1"], parallel="dp")


def _programs(trainer: harmony_fx.Trainer) -> list[tuple[list[Action], list[Action]]]:
    return [(list(forward), list(backward)) for forward, backward in trainer.hm.device_actions]


def _update_packs(device_actions) -> frozenset[int]:
    return frozenset(a.pack for pair in device_actions for actions in pair for a in actions if a.kind == K.UPDATE)


def _without_tier(device_actions, tier_events: set[int]):
    """The programs less the tier's actions, and each UPDATE less the read it names."""
    def strip(actions):
        kept = [a for a in actions if a.kind not in TIER and not (a.kind == K.WAIT and a.event in tier_events)]
        return [Action(K.UPDATE, a.stream, pack=a.pack, device=a.device, created_by=a.created_by,
                       after=tuple(e for e in a.after if e not in tier_events)) if a.kind == K.UPDATE else a
                for a in kept]
    return [(strip(forward), strip(backward)) for forward, backward in device_actions]


def _check_placement(device_actions, tier_packs, untiered_actions) -> None:
    """Every rule of ``insert_tier_io``'s docstring, on ``device_actions`` (the untiered
    programs ``untiered_actions`` with the tier's actions for ``tier_packs``)."""
    tier_events = {a.event for pair in device_actions for actions in pair for a in actions if a.kind in TIER}
    hosts = {pack: next(d for d, (f, b) in enumerate(device_actions)
                        if any(a.kind == K.UPDATE and a.pack == pack for a in f + b)) for pack in tier_packs}
    for device, (forward, backward) in enumerate(device_actions):
        program = forward + backward

        def phase(index: int) -> int:  # 0: the forward, 1: the backward
            return 0 if index < len(forward) else 1

        def only(kind, pack):
            found = [i for i, a in enumerate(program) if a.kind == kind and a.key == state_key(pack)]
            assert all(program[i].stream == Stream.IO and program[i].created_by == "insert_tier_io" for i in found)
            return found

        hosted = [a.pack for a in program if a.kind == K.UPDATE and hosts.get(a.pack) == device]
        for pack in range(max(tier_packs | {0}) + 2):  # no other pack, and no pack hosted elsewhere, moves here
            if pack not in hosted:
                assert only(K.READ, pack) == [] and only(K.WRITE, pack) == [], (device, pack)
        writes = []
        previous = None
        for pack in hosted:
            (read,), (write,) = only(K.READ, pack), only(K.WRITE, pack)
            (update,) = [i for i, a in enumerate(program) if a.kind == K.UPDATE and a.pack == pack]
            assert program[read].event in program[update].after, f"UPDATE p{pack} does not name its READ"
            assert read < update < write, pack
            assert phase(read) == phase(update), "a program's events are its own"
            assert phase(write) == 1, "the writes go on in the backward"
            if previous is None:  # the first one: at the start of the program that updates it
                assert read == (0 if phase(update) == 0 else len(forward)), pack
            elif phase(previous) == phase(update):  # right after the update of the tiered pack before
                assert read == previous + 1, pack
            else:  # that update is in the forward's: at the backward's start
                assert phase(previous) == 0 and read == len(forward), pack
            # the write right after the update (and the next read), or at the backward's start
            between = program[update + 1:write]
            if phase(update) == 1:
                assert all(a.kind == K.READ for a in between), (pack, between)
            else:
                assert all(a.kind in TIER for a in program[len(forward):write]), pack
            writes.append(program[write].event)
            previous = update
        # nothing waits for a write: the tier commits the step once they are done, during the next forward
        assert not any(a.kind == K.WAIT and a.event in writes for a in program)
    assert set(hosts) == set(tier_packs)
    # nothing else changed; the tier's events are new ones
    assert _without_tier(device_actions, tier_events) == [(list(f), list(b)) for f, b in untiered_actions]
    untiered_events = {a.event for pair in untiered_actions for actions in pair for a in actions}
    assert not tier_events & untiered_events


def test_the_trainers_programs_read_and_write_each_tiered_pack_once_around_its_update(tiered, untiered):
    programs = _programs(tiered)
    _check_placement(programs, frozenset(tiered.plan.tier_packs), _programs(untiered))
    forward, backward = programs[0]
    # the last pack updates in the forward (it runs forward, loss and backward in one task): its
    # state is read at the forward's start, written at the backward's
    assert forward[0].kind == K.READ and forward[0].key == state_key(3)
    assert backward[0].kind == K.READ and backward[0].key == state_key(2)
    assert backward[1].kind == K.WRITE and backward[1].key == state_key(3)
    reads = [a.key for a in forward + backward if a.kind == K.READ]
    assert reads == [state_key(p) for p in (3, 2, 1, 0)]  # in the order of the updates
    tiered.hm.verify(programs, _update_packs(programs))


def test_the_trainers_programs_are_the_pass_applied(tiered, untiered):
    assert insert_tier_io(_programs(untiered), frozenset(tiered.plan.tier_packs)) == _programs(tiered)


@pytest.mark.parametrize("packs", [{0, 2}, {1, 3}, {3}, {0}], ids=str)
def test_some_packs_on_the_tier(untiered, packs):
    """The pass on a part of the packs: each read goes one *tiered* pack ahead, the rest unchanged."""
    before = _programs(untiered)
    after = insert_tier_io(before, frozenset(packs))
    _check_placement(after, frozenset(packs), before)
    untiered.hm.verify(after, _update_packs(after))
    # the first tiered pack's read at the start of the program that updates it
    forward, backward = after[0]
    first = max(packs)
    assert (forward if first == 3 else backward)[0].key == state_key(first)


def test_an_empty_tier_changes_nothing(untiered):
    assert insert_tier_io(_programs(untiered), frozenset()) == _programs(untiered)


def test_the_code_calls_the_tier(tiered, untiered):
    code = tiered.code
    read, write = code.index("rt.read('S[p2]')"), code.index("rt.write('S[p2]')")
    assert read < write
    for pack in tiered.plan.tier_packs:
        assert code.count(f"rt.read('S[p{pack}]')") == code.count(f"rt.write('S[p{pack}]')") == 1
    assert "rt.read(" not in untiered.code and "rt.write(" not in untiered.code


def test_a_tiered_pack_that_no_program_updates_is_refused(untiered):
    programs = _programs(untiered)
    with pytest.raises(ValueError, match=r"insert_tier_io: pack\(s\) p7 .*no program updates them"):
        insert_tier_io(programs, frozenset({1, 7}))
    # a pack whose UPDATE is gone
    dropped = [([a for a in f if not (a.kind == K.UPDATE and a.pack == 2)],
                [a for a in b if not (a.kind == K.UPDATE and a.pack == 2)]) for f, b in programs]
    assert sum(len(f) + len(b) for f, b in dropped) == sum(len(f) + len(b) for f, b in programs) - 1
    with pytest.raises(ValueError, match=r"p2 .*no program updates them"):
        insert_tier_io(dropped, frozenset({2}))
    insert_tier_io(dropped, frozenset({1, 3}))  # the others are fine


def test_data_parallel_moves_each_packs_state_on_the_first_device_that_updates_it(data_parallel):
    programs = _programs(data_parallel)
    assert len(programs) == 2 and data_parallel.plan.tier_packs == (0, 1, 2, 3)
    for pack in data_parallel.plan.tier_packs:
        updating = [d for d, (f, b) in enumerate(programs) if any(a.kind == K.UPDATE and a.pack == pack for a in f + b)]
        assert len(updating) == 2  # every device hands its gradients to the update
        for kind in TIER:
            movers = [d for d, (f, b) in enumerate(programs)
                      if any(a.kind == kind and a.key == state_key(pack) for a in f + b)]
            assert movers == updating[:1], (kind, pack)
    untiered = _closed_trainer(devices=["host:0", "host:1"], parallel="dp")
    _check_placement(programs, frozenset(data_parallel.plan.tier_packs), _programs(untiered))
    data_parallel.hm.verify(programs, _update_packs(programs))
