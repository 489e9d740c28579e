"""``calibrate``: this machine measured (FLOP/s, copies, the runtime's cost per task and per op in
each mode), kept in a cache file with each figure's spread and load, checked before it is used, and
handed to the planner as a spec.

The tests that check the cache replace the two measurements (``measure_host``, ``quick_probe``) by
fixed figures: what they check is which figures are used, stored or measured again, never how fast
this machine is."""
from __future__ import annotations

import json
import math
import os
import time
import types

import pytest
import torch

from harmony_fx import calibrate
from harmony_fx.calibrate import Calibration
from harmony_fx.planner.specs import PRESETS
from tests.helpers import POISONED, QUIET, calibration

def test_measure_local_is_this_machine_as_a_host_device(machine) -> None:
    spec = calibrate.measure_local()
    assert spec.name == "host"
    assert spec.flops == {"fp32": QUIET["fp32"], "bf16": QUIET["bf16"]}
    assert spec.memory_bandwidth == spec.host_bandwidth == spec.peer_bandwidth == QUIET["copy"]
    assert spec.memory == 2**40  # default: not limited
    assert spec.efficiency == QUIET["linear"] / QUIET["fp32"]  # the share of peak a training step's matmuls reach
    assert spec.copy_seconds == QUIET["copy_action"]
    assert spec.inline  # a HostDevice runs each op as it is issued
    assert calibrate.get_spec("host") is spec  # one spec per process
    assert calibrate.measure_local("1GiB").memory == 2**30


def test_get_spec_names_a_preset_or_the_host() -> None:
    assert calibrate.get_spec("A100-80GB") is PRESETS["a100-80gb"]
    with pytest.raises(ValueError) as error:
        calibrate.get_spec("tpu-v9")
    assert all(name in str(error.value) for name in ["'tpu-v9'", "host", *PRESETS])


def test_a_host_device_is_predicted_with_this_machine_measured_in_the_runs_mode(machine) -> None:
    host = types.SimpleNamespace(torch_device=torch.device("cpu"))
    untracked = calibrate.spec_for(host, budget=2**20)
    assert untracked is calibrate.measure_local()
    assert (untracked.launch_seconds, untracked.op_seconds) == (QUIET["task"], QUIET["op"])
    tracked = calibrate.spec_for(host, tracked=True)
    assert tracked.op_seconds == pytest.approx(QUIET["op"] + QUIET["track_op"])
    assert tracked.launch_seconds == QUIET["task"]
    both = calibrate.spec_for(host, tracked=True, recorded=True)
    assert both.launch_seconds == pytest.approx(QUIET["task"] + QUIET["record_task"])
    assert both.op_seconds == tracked.op_seconds


def test_figures_are_measured_once_then_read_from_the_cache_file(machine) -> None:
    assert calibrate.host_figures() == QUIET and machine.calls == 1
    stored = json.loads(machine.path.read_text())
    (key,) = stored
    assert key == calibrate.cache_key() and key.startswith(f"{calibrate.CACHE_VERSION}-torch{torch.__version__}-")
    assert f"-cpus{os.cpu_count()}-threads{torch.get_num_threads()}" in key
    assert stored[key]["figures"] == QUIET and set(stored[key]["spread"]) == set(stored[key]["load"]) == set(QUIET)
    calibrate._forget()  # another process
    assert calibrate.host_figures() == QUIET and machine.calls == 1  # read and checked, not measured again


def test_a_poisoned_calibration_is_detected_and_measured_again_before_a_plan_uses_it(machine, capsys) -> None:
    """The cache holds figures taken while the machine was busy, 40x off, but plausible on their own
    (small spread, quiet load): the quick re-measure finds matmuls and copies far faster than they
    say, so they are measured again and replaced before ``harmony-fx plan --device-spec host`` plans
    with them."""
    machine.store(calibration(POISONED))
    assert calibrate.review(calibration(POISONED)) == [
        "fp32 measures 41x faster now than stored (8.7e+10 vs 2.1e+09)",
        "copy measures 30x faster now than stored (1.9e+10 vs 6.3e+08)"]

    from harmony_fx.cli import main
    plan = ["plan", "bert-large", "--device-spec", "host", "--batch-size", "8", "--json"]
    assert main(plan) == 0
    report = json.loads(capsys.readouterr().out)
    assert machine.calls == 1 and machine.stored().figures == QUIET  # measured again, and stored
    assert calibrate.measure_local().flops["fp32"] == QUIET["fp32"]

    machine.store(calibration(QUIET))  # the plan is the one a quiet calibration gives
    calibrate._forget()
    assert main(plan) == 0
    assert json.loads(capsys.readouterr().out)["iteration_seconds"] == report["iteration_seconds"]
    assert machine.calls == 1


def test_a_busy_remeasure_does_not_undo_a_quiet_calibration_but_a_quiet_one_replaces_it(machine) -> None:
    """Measured again while the machine is busy (doubtful, or more than 2x slower), each figure keeps
    the stored one: a busy moment slows a measurement, it never speeds one up. Measured again quiet,
    the new figures replace the stored ones, slower or faster: keeping the fastest ever seen would
    ratchet every outlier in."""
    old = calibration(QUIET, measured_at=time.time() - 100)
    busy = calibration({name: (v / 10 if name in calibrate.RATES else v * 10) for name, v in QUIET.items()},
                       spread=3.0, load=4.0)
    merged = old.merged(busy)
    assert merged.figures == QUIET and merged.spread == old.spread and merged.load == old.load
    assert merged.measured_at == busy.measured_at
    assert old.merged(calibration(POISONED)).figures == QUIET  # plausible-looking, but 40x slower
    drifted = {**QUIET, "copy": QUIET["copy"] / 1.5, "fp32": QUIET["fp32"] * 1.5, "task": QUIET["task"] * 1.5}
    merged = old.merged(calibration(drifted, spread=1.3))
    assert merged.figures == drifted and merged.spread["copy"] == 1.3
    doubtful_old = calibration(QUIET, spread=3.0)
    assert doubtful_old.merged(calibration(POISONED)).figures == POISONED  # plausible beats doubtful


def test_a_figure_is_the_median_of_its_fastest_trials_not_its_one_best() -> None:
    """One lucky trial (a copy that stayed in cache, a turbo burst) does not set a figure; a few
    slow ones (the machine busy for a moment) do not either."""
    trials = [(100.0, 1.0)] * 6 + [(100.0, 0.25)] + [(100.0, 10.0)] * 2
    assert calibrate._rate(trials) == 100.0
    trials = [(100.0, 1.0), (100.0, 0.5), (100.0, 0.5), (100.0, 0.5), (100.0, 5.0), (100.0, 5.0)]
    assert calibrate._rate(trials) == 200.0


@pytest.mark.parametrize("doubt, expected", [
    (dict(spread=5.0), "trials were 5.0x apart"),
    (dict(load=3.0), "under a load of 3.0 per core"),
    (dict(measured_at=0.0), "before this torch build"),
])
def test_an_implausible_calibration_is_measured_again(machine, doubt: dict, expected: str) -> None:
    doubtful = calibration(QUIET, **doubt)
    assert any(expected in problem for problem in doubtful.problems(calibrate.torch_built_at()))
    machine.store(doubtful)
    machine.measured = [calibration({**QUIET, "fp32": 9e10})]
    assert calibrate.host_figures()["fp32"] == 9e10 and machine.calls == 1
    assert machine.stored().problems(calibrate.torch_built_at()) == []


def test_figures_out_of_any_machines_range_are_not_used(machine) -> None:
    broken = calibration({**QUIET, "task": -1.0, "fp32": math.inf})
    problems = broken.problems()
    assert any(p.startswith("task = -1.0") for p in problems) and any(p.startswith("fp32 = inf") for p in problems)
    machine.store(broken)
    assert calibrate.host_figures() == QUIET and machine.calls == 1
    assert Calibration.from_json({"figures": "edited by hand"}) is None


def test_a_calibration_still_doubtful_after_measuring_again_is_used_with_a_warning(machine) -> None:
    machine.measured = [calibration(QUIET, spread=4.0)]
    with pytest.warns(UserWarning, match=r"calibration is doubtful \(fp32's trials were 4\.0x apart.*; and 12 more\)"
                                         r".*`--refresh` on a quiet machine"):
        assert calibrate.host_figures() == QUIET


def test_an_unreadable_cache_is_measured_again_and_a_read_only_one_is_left_alone(machine, tmp_path,
                                                                                 monkeypatch) -> None:
    machine.path.write_text("{not json")
    assert calibrate.host_figures() == QUIET
    assert json.loads(machine.path.read_text()) != {}
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setenv("HARMONY_FX_CACHE", str(blocked))
    calibrate._forget()
    assert calibrate.host_figures() == QUIET  # nothing stored: measured again next time
    assert machine.calls == 2


def test_a_run_more_than_a_quarter_off_its_prediction_measures_again_once(machine) -> None:
    machine.measured = [calibration(POISONED), calibration(QUIET)]
    assert calibrate.host_figures() == POISONED  # nothing stored: measured (while busy)
    assert not calibrate.check_prediction(0.15, 0.18)  # within 25%: nothing to check
    assert machine.calls == 1
    assert calibrate.check_prediction(0.15, 6.0)  # 40x off: measured again, and the figures changed
    assert machine.calls == 2 and calibrate.host_figures() == QUIET and machine.stored().figures == QUIET
    assert calibrate.measure_local().launch_seconds == QUIET["task"]
    assert not calibrate.check_prediction(0.15, 6.0) and machine.calls == 2  # once per process


def test_runtime_figures_taken_in_a_busy_moment_the_checks_missed_are_replaced_by_the_next_run(machine) -> None:
    """The runtime's cost per task and per op, 1.5x high (the demo's plot once said 190.9 ms
    predicted against 133.1 measured): no quick probe re-measures them, but the run disagrees by more
    than 25%, so they are measured again, and the quiet measurement replaces them."""
    busy = {**QUIET, "task": 1.5 * QUIET["task"], "op": 1.5 * QUIET["op"], "track_op": 1.5 * QUIET["track_op"]}
    machine.measured = [calibration(busy), calibration(QUIET)]
    assert calibrate.host_figures() == busy
    assert calibrate.check_prediction(0.1331, 0.1909)
    assert calibrate.host_figures() == QUIET and machine.stored().figures == QUIET


def test_recalibrate_replaces_the_entry_or_merges_with_it(machine) -> None:
    machine.store(calibration(QUIET))
    machine.measured = [calibration(POISONED)]
    assert calibrate.recalibrate().figures == QUIET  # merged: a measurement 40x slower changes nothing
    assert calibrate.recalibrate(merge=False).figures == POISONED and machine.stored().figures == POISONED


def test_measuring_gives_every_figure_and_leaves_the_callers_random_numbers_and_grad_mode_alone() -> None:
    state = torch.get_rng_state()
    with torch.no_grad():  # the runtime is timed forward and backward whatever the caller's mode
        measured = calibrate.measure_host()  # seeds its own models, inside fork_rng
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), state)
    assert set(measured.figures) == set(measured.spread) == set(measured.load) == set(calibrate.FIGURES)
    assert min(measured.figures[name] for name in calibrate.RATES) > 0
    assert min(measured.figures.values()) >= 0 and min(measured.spread.values()) >= 1.0
    assert measured.measured_at <= time.time()


def test_the_host_optimizers_cost_per_call_is_measured_apart_from_its_cost_per_tensor(monkeypatch) -> None:
    """Timings faked: a clock that only AdamW's step moves, by 50 us a call, 20 us a tensor and 2 ns
    a parameter; the measurement finds those three back (a Trainer steps once per pack: what one
    call costs is paid per pack), and the host spec carries them to the simulator."""
    clock = [0.0]
    real_step = torch.optim.AdamW.step

    def step(optimizer, *args, **kwargs):
        params = optimizer.param_groups[0]["params"]
        clock[0] += 50e-6 + 20e-6 * len(params) + 2e-9 * sum(p.numel() for p in params)
        return real_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time))
    figures, spread = calibrate._update_costs()
    assert figures["update_call"] == pytest.approx(50e-6)
    assert figures["update_tensor"] == pytest.approx(20e-6)
    assert figures["update"] == pytest.approx(2e-9)
    assert spread == pytest.approx(1.0)


def test_a_copys_fixed_cost_is_read_from_the_recorded_copies(monkeypatch) -> None:
    """Every span of the recorded timeline lasts exactly one second (``TickingStreams``), so the
    copies' fixed cost the runtime's timing reads from its copy spans is one second; the tasks'
    and ops' share is what is left once the copies are paid (here: every copy is worth more than
    the whole iteration, so nothing is)."""
    from harmony_fx.runtime import devices
    from tests.helpers import TickingStreams

    monkeypatch.setattr(devices, "HostStreams", TickingStreams)
    figures, _ = calibrate._runtime_overheads(1e11, 1e10)
    assert figures["copy_action"] == 1.0
    assert figures["task"] == figures["op"] == 0.0


def test_solve_finds_the_costs_behind_the_rows_and_leaves_out_a_negative_share() -> None:
    rows = [(52, 566), (10, 436), (4, 426)]
    times = [52 * 1e-4 + 566 * 5e-6, 10 * 1e-4 + 436 * 5e-6, 4 * 1e-4 + 426 * 5e-6]
    assert calibrate._solve(rows, times) == pytest.approx((1e-4, 5e-6))
    # times that only a negative cost per op could fit: the ops' share is left out, the tasks take it all
    # (the second row has more ops and took less time): least squares without it, 1.5 s a task
    assert calibrate._solve([(1, 10), (1, 20)], [2.0, 1.0]) == pytest.approx((1.5, 0.0))


def test_a_backwards_and_a_recomputes_ops_are_weighed_from_the_recorded_spans() -> None:
    """Spans made by 20 us a task and 10 us a forward op, 13 us a recompute's, 15 us a backward's:
    a recompute's op is 1.3 forward ops, a backward's 1.5; without backward spans, the defaults."""
    cost = {"FWD": 10e-6, "RECOMPUTE": 13e-6, "BWD": 15e-6}
    points = [(kind, ops, 20e-6 + ops * cost[kind]) for kind in cost for ops in (1, 5, 32, 71)]
    assert calibrate._op_factors(points) == pytest.approx({"FWD": 1.0, "RECOMPUTE": 1.3, "BWD": 1.5})
    forward_only = [point for point in points if point[0] != "BWD"]
    assert calibrate._op_factors(forward_only) == {"FWD": 1.0, "RECOMPUTE": 1.0, "BWD": 2.0}
