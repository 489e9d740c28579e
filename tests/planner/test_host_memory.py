"""``planner.host_memory``: what of each pack's host state the NVMe tier takes, and the simulator and
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
from harmony_fx.planner.host_memory import TierShare, plan_host_memory, tier_share

# 12 layers of 1,000 parameters in packs of 4, 6 and 2 layers: each pack streams its state through
# its update, so host memory holds only a few layers' worth of it
PARAMS = [1000] * 12
PROFILE = ModelProfile("chain", tuple(LayerProfile(f"l{i}", n, 2 * n, 1.0, 4.0, 4.0) for i, n in enumerate(PARAMS)),
                       16, 4.0, "bf16")
BOUNDARIES = (0, 4, 10)  # packs of 4000, 6000 and 2000 parameters
STASH = (4.0 + 4.0 + 4.0) * 16  # each pack's input, per sample, times the batch
STAGED = 6 * 1000  # parameters in flight at most (one device): six of the largest layer, as a bound


def _host(memory=None, nvme=None, **rest):
    return HostSpec(memory=memory, nvme_bytes=nvme, optimizer_state_bytes=8, **rest)


def test_without_a_shortage_nothing_moves():
    levels = plan_host_memory(PROFILE, BOUNDARIES, 16, _host(memory=10**9, nvme=10**9))
    # fp32 master and gradient, Adam's two moments, and the bf16 copy the devices read (PROFILE is bf16)
    assert levels.host_bytes == 18 * sum(PARAMS) + STASH and levels.nvme_bytes == 0
    assert levels.pack_nvme_bytes == (0, 0, 0)


def test_the_largest_state_moves_first_until_the_host_fits():
    """The middle pack's 48,000 B of state alone saves no more than its staging takes (six layers'
    state, 48,000 B); with the first pack's 32,000 B too, the host fits."""
    whole = int(18 * sum(PARAMS) + STASH)
    levels = plan_host_memory(PROFILE, BOUNDARIES, 16, _host(memory=whole - 1, nvme=10**9))
    assert levels.state_on_nvme == (0, 1) and levels.masters_on_nvme == ()
    assert levels.pack_nvme_bytes == (8 * 4000, 8 * 6000, 0)
    assert levels.host_bytes == whole - 8 * 10000 + 8 * STAGED


def test_masters_follow_the_state_in_bf16_only():
    least = plan_host_memory(PROFILE, BOUNDARIES, 16, _host(memory=1, nvme=10**9))  # nothing is enough
    assert least.state_on_nvme == (0, 1, 2) and least.masters_on_nvme == (0, 1, 2)
    assert least.pack_nvme_bytes == (12 * 4000, 12 * 6000, 12 * 2000)
    # every state and master moved; the host keeps gradients (4 B), a bf16 copy (2 B), the stash,
    # and the stream's layers' state and master (12 B each)
    assert least.host_bytes == int(6 * sum(PARAMS) + STASH + 12 * STAGED)
    fp32 = plan_host_memory(dataclasses.replace(PROFILE, precision="fp32"), BOUNDARIES, 16, _host(memory=1, nvme=10**9))
    assert fp32.masters_on_nvme == () and fp32.state_on_nvme == (0, 1, 2)


def test_the_tier_share_is_what_the_parameters_and_the_stash_overflow():
    """The dynamic program's share of the tier, in closed form: without a stash the parameters need
    18 B each (fp32 master and gradient, Adam's moments, the bf16 copy); what passes host memory is
    spread over them, and the most stash (every layer's output, 48 B a sample) adds its overflowing
    part per byte, times the batch."""
    need, stash = 18 * sum(PARAMS), 16 * 48.0
    assert tier_share(PROFILE, 16, _host(memory=need - 12_000)) == TierShare()  # no tier: nothing
    assert tier_share(PROFILE, 16, _host(memory=10**9, nvme=10**9)) == TierShare()  # no shortage
    assert tier_share(PROFILE, 16, _host(memory=need - 12_000, nvme=10**9)) == TierShare(1.0, 16.0)
    share = tier_share(PROFILE, 16, _host(memory=need + 400, nvme=10**9))
    assert share.per_param == 0.0 and share.per_input_byte == pytest.approx(16 * (stash - 400) / stash)


def test_the_tier_holds_no_more_than_its_size():
    levels = plan_host_memory(PROFILE, BOUNDARIES, 16, _host(memory=1, nvme=8 * 6000 + 8 * 4000))
    assert levels.nvme_bytes <= 8 * 6000 + 8 * 4000
    assert levels.state_on_nvme == (0, 1)  # the last pack's state would not fit beside them


def test_the_program_reads_and_writes_each_tiered_pack_around_its_update():
    """The chain's programs carry the runtime's READ/WRITE (``insert_tier_io``): each tiered pack's
    state read before its update and written after it, on one I/O lane at the tier's bandwidth;
    bytes are the plan's, both ways; a slow tier makes the iteration longer."""
    spec = DeviceSpec("toy", 10**9, {"bf16": 1e6, "fp32": 1e6}, memory_bandwidth=1e9, host_bandwidth=1e9, peer_bandwidth=1e9,
                      efficiency=1.0, launch_seconds=0.0)
    host = _host(memory=1, nvme=10**9, update_params_per_second=1e9, nvme_read=8000.0, nvme_write=4000.0)
    schedule = Schedule(BOUNDARIES, 2, "single", 1)
    programs, costs = chain_schedule(PROFILE, schedule, 16, spec, host)
    simulation = simulate(programs, costs, spec, host)
    levels = plan_host_memory(PROFILE, BOUNDARIES, 16, host)
    assert simulation.bytes_moved[("nvme", "read")] == simulation.bytes_moved[("nvme", "write")] == levels.nvme_bytes
    spans = {label: (start, end) for _, lane, label, start, end in simulation.spans if lane in ("io", "host")}
    for pack, nbytes in enumerate(levels.pack_nvme_bytes):
        read, update, write = spans[f"READ S[p{pack}] io"], spans[f"UPDATE p{pack}"], spans[f"WRITE S[p{pack}] io"]
        assert read[1] - read[0] == pytest.approx(nbytes / 8000.0)
        assert write[1] - write[0] == pytest.approx(nbytes / 4000.0)
        assert read[1] <= update[0] + 1e-12 and update[1] <= write[0] + 1e-12
    io = sorted(span for label, span in spans.items() if label.endswith(" io"))
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(io, io[1:]))  # one read or write at a time
    without = simulate(*chain_schedule(PROFILE, schedule, 16, spec, _host(update_params_per_second=1e9)), spec,
                       _host(update_params_per_second=1e9))
    assert simulation.seconds > without.seconds


def _toy_simulation(read: float, write: float, tier: bool = True):
    spec = DeviceSpec("toy", 10**9, {"bf16": 1e6, "fp32": 1e6}, memory_bandwidth=1e9, host_bandwidth=1e9,
                      peer_bandwidth=1e9, efficiency=1.0, launch_seconds=0.0)
    host = _host(memory=1 if tier else None, nvme=10**9 if tier else None, update_params_per_second=1e9,
                 nvme_read=read, nvme_write=write)
    return simulate(*chain_schedule(PROFILE, Schedule(BOUNDARIES, 2, "single", 1), 16, spec, host), spec, host)


def test_an_iterations_last_writes_go_on_into_the_next():
    """No program waits for a write: the iteration ends with its last action but the writes, and
    the next one's reads queue behind what they carry over (the steady state). With a drive that
    keeps up, the tier costs no time at all; with one that does not, the drive's work sets the pace."""
    fast = _toy_simulation(8e8, 4e8)
    spans = [(label, start, end) for _, _, label, start, end in fast.spans]
    core = max(end for label, _, end in spans if not label.startswith("WRITE"))
    last_write = max(end for label, _, end in spans if label.startswith("WRITE"))
    assert fast.seconds == pytest.approx(core) and last_write > core
    assert fast.io_carried == pytest.approx(last_write - core, rel=0.02)  # carried in as much as it carries out
    assert min(start for label, start, _ in spans if label.endswith(" io")) >= fast.io_carried - 1e-12
    assert fast.seconds == pytest.approx(_toy_simulation(8e8, 4e8, tier=False).seconds)

    slow = _toy_simulation(8e3, 4e3)
    lane = sum(end - start for _, lane, _, start, end in slow.spans if lane == "io")
    assert slow.seconds == pytest.approx(lane) and slow.seconds > 100 * fast.seconds


def test_plan_with_an_nvme_tier_fits_host_memory_and_reports_the_traffic(capsys):
    code = main(["plan", "gpt2-xl", "--host-memory", "24GB", "--nvme", "1TB", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    nvme = report["nvme"]
    assert report["host_bytes"] <= 24 * 10**9
    assert 0 < nvme["bytes_on_tier"] <= 10**12 and nvme["optimizer_state_of_packs"]
    assert nvme["read_bytes_per_iteration"] == nvme["write_bytes_per_iteration"] == nvme["bytes_on_tier"]
    assert report["bytes_moved"]["nvme/read"] == nvme["read_bytes_per_iteration"]
    assert nvme["busy_seconds"] == pytest.approx(nvme["bytes_on_tier"] / 6e9 + nvme["bytes_on_tier"] / 3e9)


def test_plan_says_how_much_host_memory_even_the_tier_leaves_needed(capsys):
    code = main(["plan", "gpt2-xl", "--host-memory", "4GB", "--nvme", "1TB"])
    _, err = capsys.readouterr()
    assert code == 2 and "NVMe tier" in err and "host memory" in err
