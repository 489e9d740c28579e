"""``planner.search``: the exact packing dynamic program, the full search on presets, and its errors.

The dynamic program is checked against brute force: every contiguous packing of a small random
layer chain (all ``2**(L-1)`` of them) is enumerated, the feasible ones kept (every adjacent pair of
packs fits: a pack's need plus its neighbour's weights), and the cheapest one's cost (the packs'
``cost`` plus the first pack's ``exposed``) must be the dynamic program's.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
pytest.importorskip("hypothesis")  # a test extra: without it this module skips
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from harmony_fx.config import format_size
from harmony_fx.planner.chain import chain_schedule
from harmony_fx.planner.costs import layer_seconds
from harmony_fx.planner.presets import preset_profile
from harmony_fx.planner.profile import LayerProfile, ModelProfile
from harmony_fx.planner.host_memory import TierShare
from harmony_fx.planner.search import (BOUND_TERMS, PlanningError, PackModel, baselines, best_boundaries, host_bytes,
                                       lower_bound, search)
from harmony_fx.planner.simulate import simulate
from harmony_fx.planner.specs import DeviceSpec, HostSpec, get_spec

TOY = DeviceSpec("toy", 10**6, {"fp32": 100.0}, memory_bandwidth=1000.0, host_bandwidth=50.0, peer_bandwidth=50.0,
                 efficiency=1.0, launch_seconds=0.01)
TOY_HOST = HostSpec(update_params_per_second=100.0)


def _packs(cuts: list[int], num_layers: int) -> list[tuple[int, int]]:
    return list(zip(cuts, [*cuts[1:], num_layers]))


def _feasible(model: PackModel, cuts: list[int], num_layers: int, budget: float) -> bool:
    packs = _packs(cuts, num_layers)
    if any(model.need(a, b) > budget for a, b in packs):
        return False
    return all(model.need(a, b) + model.weights(c, d) <= budget and model.need(c, d) + model.weights(a, b) <= budget
               for (a, b), (c, d) in zip(packs, packs[1:]))


def _total(model: PackModel, cuts: list[int], num_layers: int) -> float:
    packs = _packs(cuts, num_layers)
    return sum(model.cost(a, b) for a, b in packs) + model.exposed(*packs[0])


def _every_packing(num_layers: int):
    for chosen in itertools.product((False, True), repeat=num_layers - 1):
        yield [0] + [i + 1 for i, cut in enumerate(chosen) if cut]


# (parameters, FLOPs, out bytes, saved bytes); out bytes are small or large, as a chain's are (a
# loss after the logits, a block's output after its widest activation)
_layer = st.tuples(st.integers(0, 50), st.integers(0, 100), st.one_of(st.integers(0, 4), st.integers(0, 200)),
                   st.integers(0, 30))


@st.composite
def _chains(draw):
    layers = draw(st.lists(_layer, min_size=3, max_size=9))
    profile = ModelProfile("random", tuple(
        LayerProfile(f"l{i}", n, 2 * n, float(flops), float(out), float(saved))
        for i, (n, flops, out, saved) in enumerate(layers)), 1, float(draw(st.integers(0, 50))))
    size, microbatches = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    # half of the chains with an NVMe tier taking a share of every pack's state and stash
    tier = draw(st.one_of(st.just(TierShare()), st.builds(TierShare, st.floats(0.0, 8.0), st.floats(0.0, 4.0))))
    model = PackModel(profile, size, microbatches, TOY, 1, TOY_HOST, tier)
    smallest = min(model.need(i, i + 1) + model.weights(i, i + 1) for i in range(len(layers)))
    budget = draw(st.floats(0.5, 8.0)) * smallest
    return profile, model, budget


# no shrinking: a failure is reported as found (shrinking a 9-layer chain takes minutes)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None,
          phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)
@given(_chains())
def test_best_boundaries_is_feasible_and_exactly_optimal(case) -> None:
    profile, model, budget = case
    num_layers = len(profile.layers)
    feasible = [cuts for cuts in _every_packing(num_layers) if _feasible(model, cuts, num_layers, budget)]
    got = best_boundaries(num_layers, model, budget)
    if not feasible:
        assert got is None
        return
    assert got is not None, f"a feasible packing exists, e.g. {feasible[0]}"
    assert got[0] == 0 and got == sorted(set(got)) and got[-1] < num_layers
    assert _feasible(model, got, num_layers, budget)
    best = min(_total(model, cuts, num_layers) for cuts in feasible)
    assert _total(model, got, num_layers) <= best + 1e-9 * max(best, 1.0)


def test_best_boundaries_misses_packings_whose_last_pack_ends_in_a_small_loss() -> None:
    """BUG (harmony_fx/planner/search.py, ``best_boundaries``): the dynamic program assumes a pack's
    ``need`` grows as the pack grows at either end (``break  # a longer next pack needs more still``,
    and the binary searches over ``last_need``). It does not: ``need`` counts the values live at the
    pack's two boundaries, and a pack that grows over the loss swaps the logits (large) for the loss
    (a scalar). Here every feasible packing ends with the pack [logits, loss]; the program stops
    extending [logits, k) at k = 3 (ending at the logits, it does not fit) and returns None. The
    presets have such heads: on gpt2-xl (v100-32gb, microbatch 2, a budget 40x one layer's need)
    it also returns None while feasible packings exist, and elsewhere packings up to 2% costlier
    than the optimum."""
    layers = (
        LayerProfile("embed", 10, 20, 10.0, 4.0, 4.0, backward_work_bytes=4.0),
        LayerProfile("block", 10, 20, 10.0, 4.0, 4.0, backward_work_bytes=4.0),
        LayerProfile("logits", 10, 20, 10.0, 100.0, 100.0, backward_work_bytes=100.0),   # a large output...
        LayerProfile("loss", 0, 0, 1.0, 1.0, 1.0, backward_work_bytes=1.0),  # ...that the loss reduces to a scalar
    )
    profile = ModelProfile("head", layers, 1, 4.0)
    model = PackModel(profile, 1, 1, TOY, 1, TOY_HOST)
    budget = 320.0
    assert model.need(2, 3) > model.need(2, 4)  # the premise: a longer pack needs less here
    feasible = [cuts for cuts in _every_packing(4) if _feasible(model, cuts, 4, budget)]
    assert sorted(feasible) == [[0, 1, 2], [0, 2]]
    got = best_boundaries(4, model, budget)
    assert got is not None and _feasible(model, got, 4, budget)
    assert _total(model, got, 4) == pytest.approx(min(_total(model, cuts, 4) for cuts in feasible))


def test_the_dynamic_program_charges_each_pack_the_tiers_read_and_write_of_its_share() -> None:
    """A chain with nothing to compute or copy: a pack costs its overhead, its update's exposed
    tail and, with a tier, its share read and written on the tier's lane: ``per_param`` bytes for
    each of its parameters and ``per_input_byte`` for each byte of a sample's input to it. The first
    pack's write, the iteration's last, goes on into the next forward: only its read counts."""
    layers = tuple(LayerProfile(f"l{i}", 100 * (i + 1), 0, 0.0, float(i + 1), 0.0) for i in range(4))
    profile = ModelProfile("params only", layers, 1, 8.0)
    host = HostSpec(update_params_per_second=1e9, nvme_read=50.0, nvme_write=25.0)
    share = TierShare(per_param=2.0, per_input_byte=16.0)
    spec = dataclasses.replace(TOY, host_bandwidth=1e12, launch_seconds=0.0)  # copies and tasks take no time
    plain = PackModel(profile, 1, 1, spec, 1, host)
    tiered = PackModel(profile, 1, 1, spec, 1, host, share)
    inputs = [8.0, 1.0, 2.0, 3.0]  # per sample: the model's input, then each layer's output
    for a, b in [(0, 1), (0, 4), (1, 3), (2, 4), (3, 4)]:
        params = sum(100 * (i + 1) for i in range(a, b))
        held = 2.0 * params + 16.0 * inputs[a]
        seconds = held / 50.0 + (held / 25.0 if a else 0.0)
        assert tiered.io(a, b) == pytest.approx(seconds)
        assert tiered.cost(a, b) - plain.cost(a, b) == pytest.approx(seconds)
        assert tiered.lane(a, b) == pytest.approx(seconds)  # nothing to compute: its forward takes no time
    assert plain.io(1, 3) == 0.0 and plain.lane(1, 3) == 0.0  # no tier: no share


def test_the_lower_bound_is_the_longest_of_its_four_terms_and_names_it() -> None:
    """Each term in closed form, each made the longest in turn: compute over the devices, the
    weights twice and fp32 gradients over the bus, every parameter through the host's optimizer,
    the tier's bytes read and written."""
    layers = tuple(LayerProfile(f"l{i}", 1000, 2000, 0.0, 4.0, 4.0) for i in range(4))
    profile = ModelProfile("chain", layers, 1, 4.0)
    spec = dataclasses.replace(TOY, op_seconds=0.0)
    compute = sum(sum(layer_seconds(layer, 8, spec, "fp32")) for layer in layers)  # nothing recomputed
    bus = (2 * 8000 + 4 * 4000) / spec.host_bandwidth
    cases = {
        "compute": HostSpec(update_params_per_second=1e9),
        "bus": HostSpec(update_params_per_second=1e9),
        "host optimizer": HostSpec(update_params_per_second=4000 / (10 * max(compute, bus))),
        "tier": HostSpec(update_params_per_second=1e9, nvme_read=1.0, nvme_write=1.0),
    }
    terms = {name: lower_bound(profile, 8, 1, spec, host, tier_bytes=1000) for name, host in cases.items()}
    assert terms["tier"] == (2000.0, "tier")
    assert terms["host optimizer"] == (pytest.approx(10 * max(compute, bus)), "host optimizer")
    assert terms["compute"] == (pytest.approx(max(compute, bus)), "compute" if compute >= bus else "bus")
    slow_bus = dataclasses.replace(spec, host_bandwidth=spec.host_bandwidth / 1000)
    assert lower_bound(profile, 8, 1, slow_bus, cases["bus"]) == (pytest.approx(1000 * bus), "bus")


def test_a_tier_bound_plan_is_within_its_bound_and_says_so() -> None:
    """gpt2-xl with host memory for half of its Adam state: the tier's lane binds, the bound is its
    bytes over its bandwidth, and the plan is no faster than that (the simulator's steady state
    settles within 1% of an iteration)."""
    profile, batch = _preset("gpt2-xl")
    spec = get_spec("v100-32gb")
    params_need = host_bytes(profile, [], batch, HostSpec())
    host = HostSpec(memory=params_need - 4 * profile.num_params, nvme_bytes=10**13, nvme_read=2e8, nvme_write=1e8)
    choice = search(profile, spec, host, batch_size=batch, forward_apart=False, simulate_top=1)
    assert choice.bound == "tier"
    assert choice.lower_bound <= choice.seconds * 1.01


def test_a_packing_is_simulated_once_whichever_policies_make_it(monkeypatch) -> None:
    """Baselines often are the same packing (the largest packs and Harmony's greedy), or the
    dynamic program's: each is simulated once, and every policy that makes it is compared."""
    from harmony_fx.planner import search as planner_search

    simulated = []
    original = planner_search._simulate

    def counting(profile, schedule, *args):
        simulated.append(schedule)
        return original(profile, schedule, *args)

    monkeypatch.setattr(planner_search, "_simulate", counting)
    # 12 alike layers and room for 4 beside a neighbour as big: front to back and back to front
    # cut the same packs
    profile = ModelProfile("alike", tuple(LayerProfile(f"l{i}", 10, 20, 10.0, 4.0, 4.0) for i in range(12)), 1, 4.0)
    model = PackModel(profile, 1, 1, TOY, 1, TOY_HOST)
    budget = int(model.need(0, 4) + model.weights(0, 4))
    packings = baselines(12, model, budget)
    assert packings["largest packs"] == packings["harmony greedy"] == [0, 4, 8]
    choice = search(profile, TOY, TOY_HOST, batch_size=1, microbatches=1, budget=budget, forward_apart=False)
    assert len(simulated) == len(set(simulated))
    assert choice.compared["largest packs"] == choice.compared["harmony greedy"]


def test_best_boundaries_is_none_when_one_layer_does_not_fit() -> None:
    profile = ModelProfile("toy", tuple(LayerProfile(f"l{i}", 10, 20, 1.0, 1.0, 1.0) for i in range(4)), 1, 1.0)
    model = PackModel(profile, 1, 1, TOY, 1, TOY_HOST)
    one_layer = model.need(0, 1)  # every layer alike: every one-layer pack needs as much
    assert best_boundaries(4, model, one_layer - 1) is None
    # a one-layer pack and its neighbour's weights just fit; no two-layer pack does
    assert best_boundaries(4, model, one_layer + model.weights(0, 1)) == [0, 1, 2, 3]
    roomy = best_boundaries(4, model, 10**9)
    assert roomy is not None and _feasible(model, roomy, 4, 10**9)


def test_baselines_are_packings_of_every_layer() -> None:
    profile = ModelProfile("toy", tuple(LayerProfile(f"l{i}", 10, 20, 1.0 + i, 4.0, 8.0) for i in range(6)), 1, 4.0)
    model = PackModel(profile, 1, 2, TOY, 1, TOY_HOST)
    budget = 3 * (model.need(0, 2) + model.weights(0, 2))
    found = baselines(6, model, budget)
    assert found["one layer per pack"] == list(range(6))
    assert set(found) >= {"one layer per pack", "largest packs", "harmony greedy", "harmony balanced-time"}
    for cuts in found.values():
        assert cuts[0] == 0 and cuts == sorted(set(cuts)) and cuts[-1] < 6


def test_host_bytes_counts_masters_optimizer_state_and_the_stash() -> None:
    profile = ModelProfile("toy", tuple(LayerProfile(f"l{i}", 100, 200, 1.0, 3.0, 5.0) for i in range(4)), 1, 7.0)
    host = HostSpec(optimizer_state_bytes=8)
    # fp32 master and gradient (8 B) and Adam's moments (8 B) per parameter; the inputs of packs 0 and 2
    assert host_bytes(profile, [0, 2], 10, host) == 400 * 16 + (7 + 3) * 10
    assert host_bytes(profile, [], 10, HostSpec(optimizer_state_bytes=0)) == 400 * 8


# ---------------------------------------------------------------- presets

@functools.lru_cache(maxsize=None)
def _preset(name: str) -> tuple[ModelProfile, int]:
    return preset_profile(name)


LLAMA_HOST = HostSpec(link_bandwidth=4 * 25e9, update_params_per_second=2e9)


@functools.lru_cache(maxsize=None)
def _choice(name: str, spec: str, devices: int):
    profile, batch = _preset(name)
    host = LLAMA_HOST if name == "llama-7b" else HostSpec()
    return search(profile, get_spec(spec), host, batch_size=batch, devices=devices)


CASES = [("gpt2-xl", "v100-32gb", 1), ("llama-7b", "a100-80gb", 4)]


@pytest.mark.parametrize("name, spec, devices", CASES)
def test_search_beats_every_baseline(name: str, spec: str, devices: int) -> None:
    """Each baseline packing is made and simulated here, apart from the search, at the chosen
    settings; the choice must be at least as fast as every one that fits."""
    choice = _choice(name, spec, devices)
    profile, batch = _preset(name)
    device_spec, host = get_spec(spec), (LLAMA_HOST if name == "llama-7b" else HostSpec())
    schedule = choice.schedule
    size = -(-batch // schedule.microbatches)
    per_device = schedule.microbatches if schedule.parallel == "pp" else -(-schedule.microbatches // schedule.devices)
    model = PackModel(profile, size, per_device, device_spec, schedule.devices, host)
    packings = baselines(len(profile.layers), model, device_spec.memory)
    assert set(packings) == {"one layer per pack", "largest packs", "harmony greedy", "harmony balanced-time"}
    for policy, cuts in packings.items():
        candidate = dataclasses.replace(schedule, boundaries=tuple(cuts), forward_groups=())
        programs, costs = chain_schedule(profile, candidate, batch, device_spec, host)
        simulation = simulate(programs, costs, device_spec, host, candidate.devices if candidate.parallel == "dp" else 1)
        if max(simulation.peak_bytes) <= device_spec.memory:
            assert choice.seconds <= simulation.seconds * (1 + 1e-9), policy


@pytest.mark.parametrize("name, spec, devices", CASES)
def test_search_fits_the_budget_and_the_bound(name: str, spec: str, devices: int) -> None:
    choice = _choice(name, spec, devices)
    profile, batch = _preset(name)
    assert max(choice.simulation.peak_bytes) <= get_spec(spec).memory
    assert len(choice.simulation.peak_bytes) == choice.schedule.devices <= devices
    assert choice.batch_size == batch
    assert choice.schedule.boundaries[0] == 0 and choice.schedule.boundaries[-1] < len(profile.layers)
    assert 0 < choice.lower_bound <= choice.seconds
    assert choice.bound in BOUND_TERMS
    assert choice.samples_per_second() == pytest.approx(batch / choice.seconds)


def test_search_llama_7b_on_4_a100_is_within_20_percent_of_the_lower_bound() -> None:
    """Fails today (1.24x): the dynamic program's cost model charges the host's optimizer only for
    the first pack (``PackModel.exposed``), so it favours one huge last pack (no recompute: 25 of
    the 32 blocks, 5.4B parameters). That pack's update (2.7 s at 2e9 parameters/s) can start only
    after its backward and runs past the end of the backward by ~1.5 s. The simulator itself finds
    faster schedules for the same settings: 32 microbatches, dp over 4, packs (0, 2, 4, 11) take
    10.97 s (1.11x of their bound) against the chosen (0, 1, 7) at 11.8 s."""
    choice = _choice("llama-7b", "a100-80gb", 4)
    assert choice.seconds / choice.lower_bound <= 1.2, (choice.schedule, choice.seconds, choice.lower_bound)


def test_search_reports_a_budget_too_small_for_one_layer() -> None:
    profile, batch = _preset("gpt2-xl")
    with pytest.raises(PlanningError) as error:
        search(profile, get_spec("v100-32gb"), HostSpec(), batch_size=batch, budget=2**20)
    message = str(error.value)
    assert "gpt2-xl" in message and format_size(2**20) in message
    assert "needs" in message and "more memory" in message


def test_search_reports_host_memory_too_small_with_the_amount_needed() -> None:
    profile, batch = _preset("gpt2-xl")
    host = HostSpec(memory=2**30)
    with pytest.raises(PlanningError) as error:
        search(profile, get_spec("v100-32gb"), host, batch_size=batch)
    message = str(error.value)
    assert format_size(host_bytes(profile, [], batch, host)) in message
    assert format_size(2**30) in message and "host memory" in message


@settings(max_examples=100, deadline=None, database=None, phases=[Phase.explicit, Phase.generate])
@given(_chains())
def test_forward_groups_are_whole_backward_packs_with_the_last_alone(case) -> None:
    from harmony_fx.planner.search import ForwardModel, forward_groups

    profile, model, budget = case
    boundaries = best_boundaries(len(profile.layers), model, budget)
    if boundaries is None:
        return
    groups = forward_groups(model, boundaries, budget)
    if not groups:
        return
    assert groups[0] == 0 and list(groups) == sorted(set(groups)) and groups[-1] == len(boundaries) - 1
    forward = ForwardModel(model, boundaries)
    ends = [*groups[1:-1], len(boundaries) - 1]
    grouped = sum(forward.cost(u, v) for u, v in zip(groups[:-1], ends)) + forward.exposed(groups[0], ends[0])
    alone = sum(forward.cost(u, u + 1) for u in range(len(boundaries) - 1)) + forward.exposed(0, 1)
    assert grouped <= alone + 1e-9  # exact: never worse than a pack per group


# an issue-bound chain: each task costs its ops' issuing (1 s), whatever its microbatch size, so a
# forward of fewer, larger microbatches saves whole seconds
_ISSUE_BOUND = ModelProfile("issue-bound", tuple(LayerProfile(f"l{i}", 1000, 150_000, 1.0, 4.0, 4.0, num_ops=100)
                                                 for i in range(8)), 16, 4.0, "fp32")
_ISSUE_SPEC = dataclasses.replace(TOY, op_seconds=0.01, host_bandwidth=1e6, memory_bandwidth=1e9)


@pytest.mark.parametrize("parallel, devices", [("single", 1), ("dp", 2), ("pp", 2)])
def test_the_four_way_search_runs_the_forward_on_larger_microbatches_where_that_is_faster(parallel, devices):
    host = HostSpec(update_params_per_second=1e9)
    options = dict(batch_size=16, microbatches=16, devices=devices, parallel=parallel, all_devices=True)
    two_way = search(_ISSUE_BOUND, _ISSUE_SPEC, host, forward_apart=False, **options)
    four_way = search(_ISSUE_BOUND, _ISSUE_SPEC, host, **options)
    assert two_way.schedule.forward_microbatches is None
    forward = four_way.schedule.forward_microbatches
    assert forward is not None and forward < 16 and 16 % forward == 0
    assert four_way.seconds < 0.9 * two_way.seconds
    # the winner is the simulation of the schedule it names, made here again
    programs, costs = chain_schedule(_ISSUE_BOUND, four_way.schedule, 16, _ISSUE_SPEC, host)
    again = simulate(programs, costs, _ISSUE_SPEC, host, devices if parallel == "dp" else 1)
    assert again.seconds == pytest.approx(four_way.seconds)
    assert max(again.peak_bytes) <= _ISSUE_SPEC.memory


def test_a_pipeline_is_also_simulated_handing_on_through_the_host():
    host = HostSpec(update_params_per_second=1e9)
    options = dict(batch_size=16, microbatches=16, devices=2, parallel="pp", all_devices=True)
    choice = search(_ISSUE_BOUND, _ISSUE_SPEC, host, **options)
    through_host = [policy for policy in choice.compared if policy.endswith("handing on through the host")]
    assert len(through_host) == 1
    fixed = search(_ISSUE_BOUND, _ISSUE_SPEC, host, handoff="peer", **options)
    assert not [policy for policy in fixed.compared if "through the host" in policy]
    assert fixed.schedule.handoff == "peer"


def test_one_microbatch_on_several_devices_is_searched_as_a_pipeline():
    """A batch the planner keeps whole (its samples computed together) on two devices: the devices
    take turns on it; data parallelism, which needs a microbatch each, is not among the candidates."""
    host = HostSpec(update_params_per_second=1e9)
    choice = search(_ISSUE_BOUND, _ISSUE_SPEC, host, batch_size=16, microbatches=1, devices=2, all_devices=True)
    assert choice.schedule.parallel == "pp" and choice.schedule.microbatches == 1
    with pytest.raises(PlanningError):
        search(_ISSUE_BOUND, _ISSUE_SPEC, host, batch_size=16, microbatches=1, devices=2, parallel="dp",
               all_devices=True)
