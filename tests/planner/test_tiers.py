"""``planner.tiers``: what of each pack's host state the NVMe tier takes, and the simulator and
``harmony-fx plan`` with it. Host bytes are counted here again from the parameters, apart from
the module."""
from __future__ import annotations

import dataclasses
import json

import pytest

from harmony_fx.cli import main
from harmony_fx.planner.chain import Schedule, chain_schedule
from harmony_fx.planner.profile import LayerProfile, ModelProfile
from harmony_fx.planner.simulate import simulate
from harmony_fx.planner.specs import DeviceSpec, HostSpec
from harmony_fx.planner.tiers import plan_tiers

# 8 layers, the middle two four times the others' parameters
PARAMS = [1000, 1000, 1000, 4000, 4000, 1000, 1000, 1000]
PROFILE = ModelProfile("chain", tuple(LayerProfile(f"l{i}", n, 2 * n, 1.0, 4.0, 4.0) for i, n in enumerate(PARAMS)),
                       16, 4.0, "bf16")
BOUNDARIES = (0, 3, 5)  # packs of 3000, 8000 and 3000 parameters
STASH = (4.0 + 4.0 + 4.0) * 16  # each pack's input, per sample, times the batch


def _host(memory=None, nvme=None, **rest):
    return HostSpec(memory=memory, nvme_bytes=nvme, optimizer_state_bytes=8, **rest)


def test_without_a_shortage_nothing_moves():
    tiers = plan_tiers(PROFILE, BOUNDARIES, 16, _host(memory=10**9, nvme=10**9))
    assert tiers.host_bytes == 16 * sum(PARAMS) + STASH and tiers.nvme_bytes == 0
    assert tiers.pack_nvme_bytes == (0, 0, 0)


def test_the_state_of_packs_with_small_layers_moves_first_and_the_host_fits():
    """Moving the middle pack would save its 64,000 B of state but need two 32,000 B buffers for its
    4,000-parameter layers; the first pack's 24,000 B need two of 8,000 B."""
    whole = int(16 * sum(PARAMS) + STASH)
    tiers = plan_tiers(PROFILE, BOUNDARIES, 16, _host(memory=whole - 1, nvme=10**9))
    assert tiers.state_on_nvme == (0,) and tiers.masters_on_nvme == ()
    assert tiers.pack_nvme_bytes == (8 * 3000, 0, 0)
    assert tiers.host_bytes == whole - 8 * 3000 + 2 * 8 * 1000


def test_masters_follow_the_state_in_bf16_only():
    least = plan_tiers(PROFILE, BOUNDARIES, 16, _host(memory=1, nvme=10**9))  # nothing is enough
    assert least.state_on_nvme == (0, 1, 2) and least.masters_on_nvme == (0, 1, 2)
    assert least.pack_nvme_bytes == (12 * 3000, 12 * 8000, 12 * 3000)
    # every state and master moved; the host keeps gradients (4 B), a bf16 copy (2 B), the stash,
    # and two buffers of the largest layer's state and master (12 B each)
    assert least.host_bytes == int(6 * sum(PARAMS) + STASH + 2 * 12 * 4000)
    fp32 = plan_tiers(dataclasses.replace(PROFILE, precision="fp32"), BOUNDARIES, 16, _host(memory=1, nvme=10**9))
    assert fp32.masters_on_nvme == () and fp32.state_on_nvme == (0, 1, 2)


def test_the_tier_holds_no_more_than_its_size():
    tiers = plan_tiers(PROFILE, BOUNDARIES, 16, _host(memory=1, nvme=8 * 8000 + 8 * 3000))
    assert tiers.nvme_bytes <= 8 * 8000 + 8 * 3000
    assert tiers.state_on_nvme == (0, 2)  # the middle pack's state would not fit beside them


def test_an_update_streams_its_state_through_the_tier():
    """The update of a pack on the tier takes the longer of its step and the tier's read and write
    of its state; the tier serves one pack at a time; bytes are the plan's, both ways."""
    spec = DeviceSpec("toy", 10**9, {"bf16": 1e6, "fp32": 1e6}, memory_bandwidth=1e9, host_bandwidth=1e9, peer_bandwidth=1e9,
                      efficiency=1.0, launch_seconds=0.0)
    host = _host(memory=1, nvme=10**9, update_params_per_second=1e9, nvme_read=8000.0, nvme_write=4000.0)
    schedule = Schedule(BOUNDARIES, 2, "single", 1)
    programs, costs = chain_schedule(PROFILE, schedule, 16, spec, host)
    simulation = simulate(programs, costs, spec, host)
    tiers = plan_tiers(PROFILE, BOUNDARIES, 16, host)
    assert simulation.bytes_moved[("nvme", "read")] == simulation.bytes_moved[("nvme", "write")] == tiers.nvme_bytes
    spans = {label: (start, end) for _, lane, label, start, end in simulation.spans if lane in ("nvme", "host")}
    for pack, nbytes in enumerate(tiers.pack_nvme_bytes):
        start, end = spans[f"UPDATE p{pack}"]
        assert end - start == pytest.approx(nbytes / 8000.0 + nbytes / 4000.0)  # the tier, not the step, bounds it
        assert spans[f"READ+WRITE state p{pack}"] == pytest.approx((start, end))
    ends = sorted(spans[f"READ+WRITE state p{p}"] for p in range(3))
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(ends, ends[1:]))  # one pack at a time
    without = simulate(*chain_schedule(PROFILE, schedule, 16, spec, _host(update_params_per_second=1e9)), spec,
                       _host(update_params_per_second=1e9))
    assert simulation.seconds > without.seconds


def test_plan_with_an_nvme_tier_fits_host_memory_and_reports_the_traffic(capsys):
    code = main(["plan", "gpt2-xl", "--host-memory", "20GB", "--nvme", "1TB", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    nvme = report["nvme"]
    assert report["host_bytes"] <= 20 * 10**9
    assert 0 < nvme["bytes_on_tier"] <= 10**12 and nvme["optimizer_state_of_packs"]
    assert nvme["read_bytes_per_iteration"] == nvme["write_bytes_per_iteration"] == nvme["bytes_on_tier"]
    assert report["bytes_moved"]["nvme/read"] == nvme["read_bytes_per_iteration"]
    assert nvme["busy_seconds"] == pytest.approx(nvme["bytes_on_tier"] / 6e9 + nvme["bytes_on_tier"] / 3e9)


def test_plan_says_how_much_host_memory_even_the_tier_leaves_needed(capsys):
    code = main(["plan", "gpt2-xl", "--host-memory", "4GB", "--nvme", "1TB"])
    _, err = capsys.readouterr()
    assert code == 2 and "NVMe tier" in err and "host memory" in err
