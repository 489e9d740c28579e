"""The planner: plan quality against the baselines and the lower bound on the presets, and how its
time grows with the number of layers. Run: ``python -m pytest benchmarks/test_planner.py -s``.

Quality is simulated time (the planner's own simulator, the same for every packing), so the
ratios compare packings, not the simulator against hardware.
"""
from __future__ import annotations

import time

import pytest

from harmony_fx.planner.presets import preset_profile
from harmony_fx.planner.profile import LayerProfile, ModelProfile
from harmony_fx.planner.search import search
from harmony_fx.planner.specs import HostSpec, get_spec

BASELINES = ("one layer per pack", "largest packs", "harmony greedy", "harmony balanced-time")
CASES = [  # (preset, devices, spec, host memory)
    ("gpt2-xl", 1, "v100-32gb", None),
    ("bert-large", 4, "a100-40gb", None),
    ("llama-7b", 4, "a100-80gb", None),
    ("gpt3-175b", 8, "a100-80gb", 4 * 10**12),
]


@pytest.mark.parametrize("preset, devices, spec_name, host_memory", CASES)
def test_plan_quality(benchmark, preset, devices, spec_name, host_memory):
    spec = get_spec(spec_name)
    host = HostSpec(memory=host_memory, link_bandwidth=4 * spec.host_bandwidth, update_params_per_second=2e9)
    profile, batch = preset_profile(preset)
    choice = benchmark.pedantic(lambda: search(profile, spec, host, batch_size=batch, devices=devices),
                                rounds=1, iterations=1)
    best_baseline = min(v for k, v in choice.compared.items() if k in BASELINES)
    # one set of packs and one microbatch size for forward and backward, against Harmony's four-way
    two_way = min(v for k, v in choice.compared.items() if "+ forward" not in k)
    _report(benchmark, f"{preset} on {devices} x {spec_name}", {
        "choice": choice.schedule.describe(),
        "packing": choice.policy,
        "iteration s": round(choice.seconds, 3),
        "two-way s": round(two_way, 3),
        "four-way / two-way": round(choice.seconds / two_way, 4),
        "vs lower bound": round(choice.seconds / choice.lower_bound, 3),
        "bound": choice.bound,
        "dynamic programming / best baseline": round(choice.compared["dynamic programming"] / best_baseline, 3),
        **{f"{k} s": round(v, 3) for k, v in choice.compared.items()},
    })
    assert choice.seconds <= best_baseline


def _report(benchmark, title: str, figures: dict) -> None:
    benchmark.extra_info.update(figures)
    print(f"\n{title}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))


def _chain(num_layers: int) -> ModelProfile:
    layers = tuple(LayerProfile(f"l{i}", 1_000_000, 2_000_000, 2e9, 1e6, 8e6) for i in range(num_layers))
    return ModelProfile(f"chain{num_layers}", layers, 1, 1e6, "bf16")


@pytest.mark.parametrize("num_layers", [100, 300, 1000])
def test_planner_time(benchmark, num_layers):
    spec = get_spec("a100-40gb")
    profile = _chain(num_layers)
    started = time.perf_counter()
    choice = benchmark.pedantic(lambda: search(profile, spec, HostSpec(link_bandwidth=100e9), batch_size=64,
                                               devices=1, budget=2 * 10**9), rounds=1, iterations=1)
    _report(benchmark, f"{num_layers}-layer chain", {
        "seconds": round(time.perf_counter() - started, 2), "packs": len(choice.schedule.boundaries),
        "microbatches": choice.schedule.microbatches,
    })
