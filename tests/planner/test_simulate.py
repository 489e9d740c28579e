"""``planner.simulate``: iteration time, memory, bytes and trace of device programs.

Most programs here are written by hand (``repr`` lines parsed by ``parse_action``) with a fake
``Costs`` whose figures are round numbers: a 100-byte key crosses a 100 B/s link in 1 s, a forward
takes 2 s and a backward 3 s. Every expected time is then a sum the comment next to it spells out.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from harmony_fx.planner.chain import Schedule, chain_schedule
from harmony_fx.planner.profile import LayerProfile, ModelProfile
from harmony_fx.planner.simulate import Simulation, SimulationDeadlock, simulate
from harmony_fx.planner.specs import DeviceSpec, HostSpec
from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind, parse_action, parse_key
from harmony_fx.program.traffic import bytes_moved

# host link 100 B/s per direction, peer link 50 B/s
SPEC = DeviceSpec("toy", 10**6, {"fp32": 1.0}, memory_bandwidth=1.0, host_bandwidth=100.0, peer_bandwidth=50.0,
                  efficiency=1.0, launch_seconds=0.0)
SIZES = {KeyKind.WEIGHTS: 100, KeyKind.WGRAD: 100, KeyKind.ACT: 10, KeyKind.GRAD: 10, KeyKind.GRAPH: 50}
SECONDS = {K.FWD: 2.0, K.RECOMPUTE: 2.0, K.BWD: 3.0}


class FakeCosts:
    """Fixed bytes per key kind (or per key), fixed seconds per task kind (or per task ``repr``); a
    task's peak is its new keys plus ``work`` bytes."""

    def __init__(self, sizes: dict | None = None, seconds: dict | None = None, work: int = 0,
                 update: float = 0.5) -> None:
        self.sizes = {**SIZES, **(sizes or {})}
        self.seconds = {**SECONDS, **(seconds or {})}
        self.work, self.update = work, update

    def key_bytes(self, key: Key) -> int:
        return self.sizes.get(str(key), self.sizes[key.kind])

    def compute_seconds(self, action: Action) -> float:
        return self.seconds.get(repr(action).split(" -> ")[0], self.seconds[action.kind])

    def task_peak(self, action: Action, allocated: int = 0) -> int:
        return allocated + self.work

    def update_seconds(self, pack: int) -> float:
        return self.update

    def pack_params(self, pack: int) -> int:
        return 1000

    def nvme_bytes(self, pack: int) -> int:
        return 0


def program(*lines: str, device: int = 0, **effects: tuple[tuple[str, ...], tuple[str, ...]]) -> list[Action]:
    """Actions from their ``repr``; ``effects["FWD p0@0"] = (writes, consumes)`` as key strings."""
    actions = []
    for line in lines:
        action = dataclasses.replace(parse_action(line), device=device)
        label = line.split(" -> ")[0]
        if label in effects:
            writes, consumes = effects[label]
            action = dataclasses.replace(action, writes=tuple(map(parse_key, writes)),
                                         consumes=tuple(map(parse_key, consumes)))
        actions.append(action)
    return actions


def spans_of(sim: Simulation, device: int = 0) -> dict[str, tuple[float, float]]:
    return {label: (start, end) for d, _, label, start, end in sim.spans if d == device}


# ---------------------------------------------------------------- critical paths

ONE_PACK = program(
    "PREFETCH W[p0] h2d -> e0",     # 100 B: 0 .. 1
    "PREFETCH act[x@0] h2d -> e1",  # 10 B: 1 .. 1.1
    "WAIT e0 compute",
    "WAIT e1 compute",
    "FWD p0@0 -> e2",               # 1.1 .. 3.1
    "BWD p0@0 -> e3",               # 3.1 .. 6.1
    "WAIT e3 d2h",
    "OFFLOAD dW[p0] d2h -> e4",     # 100 B: 6.1 .. 7.1
    "WAIT e4 compute",
    "FREE dW[p0]",
    "FREE W[p0]",
    "WAIT e4 host",
    "UPDATE p0",                    # 7.1 .. 7.6
    **{"FWD p0@0": (("graph[p0@0]", "act[y@0]"), ("act[x@0]",)),
       "BWD p0@0": (("dW[p0]",), ("graph[p0@0]", "act[y@0]"))},
)


def test_one_pack_iteration_is_its_critical_path() -> None:
    sim = simulate([ONE_PACK], FakeCosts(), SPEC)
    weights_in, input_in, forward, backward, grads_out, update = 1.0, 0.1, 2.0, 3.0, 1.0, 0.5
    assert sim.seconds == pytest.approx(weights_in + input_in + forward + backward + grads_out + update)
    spans = spans_of(sim)
    assert spans["FWD p0@0"] == pytest.approx((1.1, 3.1))
    assert spans["BWD p0@0"] == pytest.approx((3.1, 6.1))
    assert spans["OFFLOAD dW[p0] d2h"] == pytest.approx((6.1, 7.1))
    assert spans["UPDATE p0"] == pytest.approx((7.1, 7.6))
    assert sim.busy[(0, "compute")] == pytest.approx(5.0)
    assert sim.busy[(0, "h2d")] == pytest.approx(1.1)
    assert sim.busy[(0, "host")] == pytest.approx(0.5)


def test_one_pack_peak_memory_is_hand_computed() -> None:
    sim = simulate([ONE_PACK], FakeCosts(work=7), SPEC)
    # in the backward: weights 100 + graph 50 + y 10 + weight gradients 100 + the task's work 7
    assert sim.peak_bytes == [100 + 50 + 10 + 100 + 7]
    levels = [b for _, b in sim.memory[0]]
    # W, x, FWD at its peak (graph, y and work), FWD done (x consumed), BWD at its peak (dW and
    # work), BWD done (graph and y consumed), FREE dW, FREE W
    assert levels == [0, 100, 110, 177, 160, 267, 200, 100, 0]
    times = [t for t, _ in sim.memory[0]]
    assert times == sorted(times)


def _two_packs(second_weights_seconds: float) -> tuple[list[Action], FakeCosts]:
    actions = program(
        "PREFETCH W[p0] h2d -> e0",   # 0 .. 1
        "WAIT e0 compute",
        "PREFETCH W[p1] h2d -> e1",   # 1 .. 1 + t1, while FWD p0 runs
        "FWD p0@0 -> e2",             # 1 .. 3
        "FREE W[p0]",
        "WAIT e1 compute",
        "FWD p1@0 -> e3",             # max(3, 1 + t1) .. +2
        "WAIT e3 h2d",
        "PREFETCH W[p0] h2d -> e5",   # issued before BWD p1: after FWD p1, 1 s, while BWD p1 runs
        "BWD p1@0 -> e4",             # .. +3
        "WAIT e5 compute",
        "RECOMPUTE p0@0 -> e6",       # .. +2
        "BWD p0@0 -> e7",             # .. +3
    )
    return actions, FakeCosts(sizes={"W[p1]": int(100 * second_weights_seconds)})


def test_two_packs_a_prefetch_hidden_behind_compute() -> None:
    actions, costs = _two_packs(1.0)
    sim = simulate([actions], costs, SPEC)
    # the first copy, then compute only: FWD p0, FWD p1, BWD p1, RECOMPUTE p0, BWD p0
    assert sim.seconds == pytest.approx(1.0 + 2 + 2 + 3 + 2 + 3)
    spans = spans_of(sim)
    assert spans["PREFETCH W[p1] h2d"] == pytest.approx((1.0, 2.0))
    assert spans["FWD p0@0"] == pytest.approx((1.0, 3.0))
    assert spans["FWD p1@0"] == pytest.approx((3.0, 5.0))
    assert spans["PREFETCH W[p0] h2d"] == pytest.approx((5.0, 6.0))  # overlaps BWD p1 (5 .. 8)


def test_two_packs_a_prefetch_longer_than_compute_is_exposed() -> None:
    actions, costs = _two_packs(3.0)  # W[p1] takes 3 s, FWD p0 only 2
    sim = simulate([actions], costs, SPEC)
    assert sim.seconds == pytest.approx(1.0 + 3.0 + 2 + 3 + 2 + 3)
    assert spans_of(sim)["FWD p1@0"] == pytest.approx((4.0, 6.0))


def test_an_inline_device_overlaps_nothing() -> None:
    """A HostDevice runs each op as it is issued: the iteration is the sum of every op."""
    actions, costs = _two_packs(1.0)
    sim = simulate([actions], costs, dataclasses.replace(SPEC, inline=True))
    assert sim.seconds == pytest.approx(1.0 + 1.0 + 2 + 2 + 3 + 1.0 + 2 + 3)
    assert sim.seconds == pytest.approx(sum(end - start for *_, start, end in sim.spans))


def test_every_copy_pays_the_specs_fixed_cost_before_its_bytes() -> None:
    """``copy_seconds`` (a HostDevice's measured cost of issuing a copy): inline, each of the
    program's three copies takes that much longer, and so does the iteration; overlapped, the
    first copy's delays the forward and the hidden one's stays hidden."""
    copy_seconds = 0.25
    actions, costs = _two_packs(1.0)
    copies = sum(a.kind in (K.PREFETCH, K.OFFLOAD) for a in actions)
    inline = dataclasses.replace(SPEC, inline=True)
    before = simulate([actions], costs, inline)
    after = simulate([actions], costs, dataclasses.replace(inline, copy_seconds=copy_seconds))
    assert copies == 3
    assert after.seconds == pytest.approx(before.seconds + copies * copy_seconds)
    assert spans_of(after)["PREFETCH W[p1] h2d"] == pytest.approx((1.25, 1.25 + 0.25 + 1.0))  # right after W[p0]
    overlapped = simulate([actions], costs, dataclasses.replace(SPEC, copy_seconds=copy_seconds))
    assert overlapped.seconds == pytest.approx(1.25 + 2 + 2 + 3 + 2 + 3)  # only W[p0]'s first copy is exposed


def test_chain_program_of_one_pack_is_its_critical_path() -> None:
    """The lowering's own program (``lower_program`` via ``chain_schedule``) for one pack."""
    profile = ModelProfile("toy", tuple(LayerProfile(f"l{i}", 1, 4, 1.0, 1.0, 1.0) for i in range(3)), 1, 1.0)
    programs, _ = chain_schedule(profile, Schedule((0,), 1, "single", 1), 1, SPEC, HostSpec())
    sim = simulate(programs, FakeCosts(), SPEC)
    # W in, x in, FWD, the output out (BWD takes it over), BWD, dW out, the update
    assert sim.seconds == pytest.approx(1.0 + 0.1 + 2.0 + 0.1 + 3.0 + 1.0 + 0.5)


# ---------------------------------------------------------------- the shared host link

def _copy_then_compute(device: int, weights: str = "W[p0]", first_event: int = 0, direction: str = "h2d") -> list[Action]:
    kind = "PREFETCH" if direction == "h2d" else "OFFLOAD"
    e0, e1 = first_event, first_event + 1
    return program(f"{kind} {weights} {direction} -> e{e0}", f"WAIT e{e0} compute", f"FWD p0@{device} -> e{e1}",
                   device=device)


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_devices_sharing_the_host_link_slow_each_others_copies_by_the_sharing_factor(devices: int) -> None:
    programs = [_copy_then_compute(d, first_event=10 * d) for d in range(devices)]
    host = HostSpec(link_bandwidth=100.0)  # one device's link: every extra device divides it
    sim = simulate(programs, FakeCosts(), SPEC, host)
    for d in range(devices):
        start, end = spans_of(sim, d)["PREFETCH W[p0] h2d"]
        assert (start, end) == pytest.approx((0.0, 1.0 * devices))
    assert sim.seconds == pytest.approx(devices * 1.0 + 2.0)


def test_a_link_wide_enough_for_every_device_does_not_slow_them() -> None:
    programs = [_copy_then_compute(d, first_event=10 * d) for d in range(2)]
    for host in (HostSpec(), HostSpec(link_bandwidth=200.0)):
        sim = simulate(programs, FakeCosts(), SPEC, host)
        assert sim.seconds == pytest.approx(1.0 + 2.0)


def test_the_link_is_shared_fairly_at_every_instant() -> None:
    programs = [_copy_then_compute(0), _copy_then_compute(1, weights="W[p1]", first_event=10)]
    costs = FakeCosts(sizes={"W[p1]": 300})
    sim = simulate(programs, costs, SPEC, HostSpec(link_bandwidth=100.0))
    # both at 50 B/s until d0's 100 B are in (t = 2), then d1 alone at 100 B/s: 200 B more
    assert spans_of(sim, 0)["PREFETCH W[p0] h2d"] == pytest.approx((0.0, 2.0))
    assert spans_of(sim, 1)["PREFETCH W[p1] h2d"] == pytest.approx((0.0, 4.0))


def test_the_two_directions_do_not_share_a_lane() -> None:
    programs = [_copy_then_compute(0), _copy_then_compute(1, weights="act[a@1]", first_event=10, direction="d2h")]
    sim = simulate(programs, FakeCosts(sizes={"act[a@1]": 100}), SPEC, HostSpec(link_bandwidth=100.0))
    assert spans_of(sim, 0)["PREFETCH W[p0] h2d"] == pytest.approx((0.0, 1.0))
    assert spans_of(sim, 1)["OFFLOAD act[a@1] d2h"] == pytest.approx((0.0, 1.0))


def test_peer_copies_use_the_peer_link() -> None:
    sender = program("FWD p0@0 -> e0", "WAIT e0 peer", "SEND act[x1@0] -> d1 -> e1",
                     **{"FWD p0@0": (("act[x1@0]",), ())})
    receiver = program("RECV act[x1@0] <- d0 -> e2", "WAIT e2 compute", "FWD p1@0 -> e3", device=1,
                       **{"FWD p1@0": ((), ("act[x1@0]",))})
    sim = simulate([sender, receiver], FakeCosts(), SPEC, HostSpec(link_bandwidth=1.0))
    # FWD p0 0 .. 2, 10 B at 50 B/s (the host link's cap does not apply), FWD p1 2.2 .. 4.2
    assert spans_of(sim, 1)["FWD p1@0"] == pytest.approx((2.2, 4.2))
    assert sim.bytes_moved == {("peer", "act"): 10}
    assert sim.bytes_by_device[1] == {"peer": 10}
    assert sim.memory[1][-1][1] == 0


# ---------------------------------------------------------------- host updates

def _forward_then_update(device: int, first_event: int, pack: int = 0) -> list[Action]:
    return program(f"FWD p0@{device} -> e{first_event}", f"WAIT e{first_event} host", f"UPDATE p{pack}",
                   device=device)


def _updates(sim: Simulation) -> list[float]:
    """(start, end) of every update in time order, flattened (``pytest.approx`` takes flat lists)."""
    return [t for span in sorted((start, end) for _, stream, _, start, end in sim.spans if stream == "host")
            for t in span]


def test_an_update_waits_for_every_device_to_arrive() -> None:
    programs = [_forward_then_update(0, 0), _forward_then_update(1, 10)]
    costs = FakeCosts(seconds={"FWD p0@1": 3.0})  # d0 arrives at 2, d1 at 3
    sim = simulate(programs, costs, SPEC, HostSpec(), update_arrivals=2)
    assert _updates(sim) == pytest.approx([3.0, 3.5])  # once, when the last arrives
    assert sim.seconds == pytest.approx(3.5)


def test_without_arrivals_to_wait_for_each_pack_updates_as_issued() -> None:
    programs = [_forward_then_update(0, 0), _forward_then_update(1, 10, pack=1)]
    sim = simulate(programs, FakeCosts(seconds={"FWD p0@1": 3.0}), SPEC, HostSpec(), update_arrivals=1)
    assert _updates(sim) == pytest.approx([2.0, 2.5, 3.0, 3.5])


@pytest.mark.parametrize("workers, expected", [(1, [(2.0, 2.5), (2.5, 3.0)]), (2, [(2.0, 2.5), (2.0, 2.5)])])
def test_updates_queue_for_the_host_workers(workers: int, expected: list) -> None:
    programs = [_forward_then_update(0, 0), _forward_then_update(1, 10, pack=1)]
    sim = simulate(programs, FakeCosts(), SPEC, HostSpec(update_workers=workers), update_arrivals=1)
    assert _updates(sim) == pytest.approx([t for span in expected for t in span])
    assert sim.seconds == pytest.approx(expected[-1][1])


def test_an_update_does_not_block_the_controller() -> None:
    actions = program("FWD p0@0 -> e0", "WAIT e0 host", "UPDATE p0", "FWD p1@0 -> e1")
    sim = simulate([actions], FakeCosts(update=10.0), SPEC)
    assert spans_of(sim)["FWD p1@0"] == pytest.approx((2.0, 4.0))
    assert sim.seconds == pytest.approx(12.0)  # the iteration ends with the update


# ---------------------------------------------------------------- deadlock

@pytest.mark.parametrize("stream", ["compute", "host", "h2d"])
def test_a_wait_nobody_records_is_a_deadlock(stream: str) -> None:
    actions = program("PREFETCH W[p0] h2d -> e0", f"WAIT e99 {stream}", "FWD p0@0 -> e1")
    with pytest.raises(SimulationDeadlock, match="e99"):
        simulate([actions], FakeCosts(), SPEC)


def test_a_recv_without_a_send_is_a_deadlock() -> None:
    with pytest.raises(SimulationDeadlock, match="RECV"):
        simulate([[], program("RECV act[x@0] <- d0 -> e0", device=1)], FakeCosts(), SPEC)


# ---------------------------------------------------------------- chain programs

def _profile(num_layers: int = 4) -> ModelProfile:
    layers = tuple(LayerProfile(f"l{i}", 1000 * (i + 1), 4000 * (i + 1), 1e9 * (i + 1), 5e4, 2e5)
                   for i in range(num_layers))
    return ModelProfile("toy", layers, 1, 3e4)


CHAIN_SPEC = DeviceSpec("chain", 2**30, {"fp32": 1e12}, memory_bandwidth=1e11, host_bandwidth=1e9,
                        peer_bandwidth=1e10)

SCHEDULES = [
    Schedule((0,), 1, "single", 1),
    Schedule((0, 2), 2, "single", 1),
    Schedule((0, 1, 3), 4, "dp", 2),
    Schedule((0, 1, 2, 3), 4, "pp", 2),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.describe())
def test_bytes_moved_equals_the_schedule_count(schedule: Schedule) -> None:
    programs, costs = chain_schedule(_profile(), schedule, 8, CHAIN_SPEC, HostSpec())
    arrivals = schedule.devices if schedule.parallel == "dp" else 1
    sim = simulate(programs, costs, CHAIN_SPEC, HostSpec(), arrivals)
    expected = bytes_moved([a for p in programs for a in p], costs.key_bytes)
    assert sim.bytes_moved == expected
    for device, actions in enumerate(programs):
        per_direction: dict[str, int] = {}
        for (direction, _), n in bytes_moved(actions, costs.key_bytes).items():
            per_direction[direction] = per_direction.get(direction, 0) + n
        assert sim.bytes_by_device[device] == per_direction


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.describe())
def test_memory_never_goes_negative_and_ends_empty(schedule: Schedule) -> None:
    programs, costs = chain_schedule(_profile(), schedule, 8, CHAIN_SPEC, HostSpec())
    sim = simulate(programs, costs, CHAIN_SPEC, HostSpec(), schedule.devices if schedule.parallel == "dp" else 1)
    assert len(sim.memory) == len(sim.peak_bytes) == schedule.devices
    for timeline, peak in zip(sim.memory, sim.peak_bytes, strict=True):
        assert all(b >= 0 for _, b in timeline)
        assert peak == max(b for _, b in timeline) > 0
        assert timeline[-1][1] == 0
    # weights of two packs at once at least: a pack's and its neighbour's
    assert max(sim.peak_bytes) >= costs.key_bytes(Key(KeyKind.WEIGHTS, "p0"))
    assert sim.seconds > 0


def test_trace_events_cover_every_stream_used_and_are_json() -> None:
    programs, costs = chain_schedule(_profile(), Schedule((0, 1, 3), 4, "dp", 2), 8, CHAIN_SPEC, HostSpec())
    sim = simulate(programs, costs, CHAIN_SPEC, HostSpec(), update_arrivals=2)
    events = json.loads(json.dumps(sim.trace_events()))
    slices = [e for e in events if e["ph"] == "X"]
    used = {(device, stream) for device, stream, *_ in sim.spans}
    assert {(e["pid"], e["cat"]) for e in slices} == used
    assert {stream for _, stream in used} == {"compute", "h2d", "d2h", "host"}
    assert len(slices) == len(sim.spans)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(sim.seconds * 1e6)
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {0, 1}


def _renumbered(programs: list[list[Action]], offset: int = 1000) -> list[list[Action]]:
    """The same programs with each device's events moved to a range of its own."""
    return [[dataclasses.replace(a, event=None if a.event is None else a.event + offset * device,
                                 after=tuple(e + offset * device for e in a.after)) for a in actions]
            for device, actions in enumerate(programs)]


@pytest.mark.parametrize("microbatches", [2, 3])
def test_data_parallel_devices_do_not_see_each_others_events(microbatches: int) -> None:
    """BUG (harmony_fx/planner/simulate.py) for 3 microbatches: in data-parallel, ``chain_schedule``
    lowers each device's program on its own (``lower_program``), so every program numbers its events
    from e0, and the runtime keeps a device's events to itself. The simulator records events in one
    dict for all devices (``done_events[event]``), so a device's ``WAIT eN`` is met by *another*
    device's eN. With an even split the programs are alike and nothing shows (2 microbatches); with
    3 on 2 devices they differ, and device 1 starts ``OFFLOAD act[x3@2]`` at 8.1 ms instead of
    24.1 ms, before the forward that makes it. Renumbering must not change the simulation."""
    programs, costs = chain_schedule(_profile(), Schedule((0, 1, 3), microbatches, "dp", 2), 2 * microbatches,
                                     CHAIN_SPEC, HostSpec())
    shared = simulate(programs, costs, CHAIN_SPEC, HostSpec(), update_arrivals=2)
    distinct = simulate(_renumbered(programs), costs, CHAIN_SPEC, HostSpec(), update_arrivals=2)
    starts = lambda sim: sorted((d, label, start) for d, _, label, start, _ in sim.spans)  # noqa: E731
    assert starts(shared) == starts(distinct)
    assert shared.seconds == distinct.seconds
    assert shared.peak_bytes == distinct.peak_bytes


def test_a_copy_onto_the_device_waits_for_the_compute_issued_before_it() -> None:
    """As on a GPU (its memory is allocated in compute-stream order): a prefetch issued after a
    task starts when that task ends, one issued before it overlaps it."""
    after = program(
        "PREFETCH W[p0] h2d -> e0",     # 0 .. 1
        "WAIT e0 compute",
        "FWD p0@0 -> e1",               # 1 .. 3
        "PREFETCH act[x@1] h2d -> e2",  # issued after FWD: 3 .. 3.1
    )
    before = program(
        "PREFETCH W[p0] h2d -> e0",
        "WAIT e0 compute",
        "PREFETCH act[x@1] h2d -> e2",  # issued before FWD: 1 .. 1.1, while it runs
        "FWD p0@0 -> e1",
    )
    assert spans_of(simulate([after], FakeCosts(), SPEC))["PREFETCH act[x@1] h2d"] == pytest.approx((3.0, 3.1))
    assert spans_of(simulate([before], FakeCosts(), SPEC))["PREFETCH act[x@1] h2d"] == pytest.approx((1.0, 1.1))


# ---------------------------------------------------------------- other servers


@pytest.mark.parametrize("sharded", [True, False])
def test_an_update_across_servers_waits_for_the_network_and_counts_its_bytes(sharded: bool) -> None:
    """The chain program of one pack: its update is the gradients over the network, then 1/N of the
    update when sharded (the whole when not), then, sharded, the weights gathered back."""
    from harmony_fx.planner.specs import ClusterSpec

    profile = ModelProfile("toy", tuple(LayerProfile(f"l{i}", 1, 4, 1.0, 1.0, 1.0) for i in range(3)), 1, 1.0)
    programs, _ = chain_schedule(profile, Schedule((0,), 1, "single", 1), 1, SPEC, HostSpec())
    alone = simulate(programs, FakeCosts(), SPEC).seconds
    cluster = ClusterSpec(nodes=4, network_bandwidth=1000.0, latency=0.01, shard_optimizer=sharded)
    sim = simulate(programs, FakeCosts(), SPEC, HostSpec(cluster=cluster))
    gradients = 4 * 1000  # fp32, FakeCosts' 1000 parameters
    # a ring over 4 servers: all-reduce (and gloo's reduce-scatter) send 2 * 3/4 of it in 6 steps,
    # an all-gather 3/4 of it in 3 steps
    reduce = 2 * 0.75 * gradients / 1000.0 + 6 * 0.01
    gather = 0.75 * gradients / 1000.0 + 3 * 0.01
    update = 0.5 / 4 if sharded else 0.5
    expected = alone - 0.5 + reduce + update + (gather if sharded else 0.0)
    assert sim.seconds == pytest.approx(expected)
    sent = {kind: n for (lane, kind), n in sim.bytes_moved.items() if lane == "net"}
    assert sent == ({"reduce_scatter": 6000, "all_gather": 3000} if sharded else {"all_reduce": 6000})
