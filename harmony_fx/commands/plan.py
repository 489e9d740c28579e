"""``harmony-fx plan MODEL``: choose packs, microbatches and parallelism for a model on hardware
that need not be at hand, and say how fast one iteration will be and what bounds it."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from typing import Any

from harmony_fx.commands.arguments import positive_float, positive_int
from harmony_fx.config import format_size, parse_size
from harmony_fx.program.format import format_table

__all__ = ["add_parser", "run"]

_OPTIMIZER_STATE = {"adam": 8, "sgd": 4, "none": 0}


def add_parser(commands) -> None:
    plan = commands.add_parser("plan", help="plan a model (a preset or file.py:function) on N devices",
                               description=__doc__)
    plan.add_argument("model", help="gpt2-xl, bert-large, llama-7b, gpt3-175b, or path/to/file.py:function "
                                    "returning (model, example_inputs)")
    plan.add_argument("--devices", type=positive_int, default=1)
    plan.add_argument("--device-spec", default="a100-80gb", help="a GPU preset, or 'host' (this machine, measured)")
    plan.add_argument("--memory-budget", help="bytes per device (default: the device's memory), e.g. 40GiB")
    plan.add_argument("--host-memory", help="host memory for masters, optimizer state and stash, e.g. 2TB")
    plan.add_argument("--nvme", help="an NVMe tier for what host memory cannot hold (optimizer state first, "
                                      "then fp32 masters), e.g. 8TB")
    plan.add_argument("--nvme-read", default="6GB", help="the tier's read bandwidth, bytes/s (default 6GB)")
    plan.add_argument("--nvme-write", default="3GB", help="the tier's write bandwidth, bytes/s (default 3GB)")
    plan.add_argument("--host-link", help="all devices' host traffic together, bytes/s per direction "
                                          "(default: 4 devices' links)")
    plan.add_argument("--optimizer", choices=sorted(_OPTIMIZER_STATE), default="adam",
                      help="sizes the optimizer state kept on the host (adam: 8 bytes per parameter)")
    plan.add_argument("--update-rate", type=positive_float, default=2e9,
                      help="host optimizer throughput, parameters/s (default: a two-socket server)")
    plan.add_argument("--batch-size", type=positive_int, help="samples per iteration (default: the preset's)")
    plan.add_argument("--microbatches", type=positive_int, help="fix the number of microbatches (default: searched)")
    plan.add_argument("--parallel", choices=["auto", "dp", "pp"], default="auto")
    plan.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    plan.add_argument("--measure", action="store_true",
                      help="file.py models: time every layer on this machine (for --device-spec host)")
    plan.add_argument("--nodes", type=positive_int, default=1,
                      help="servers training together (one process each, torchrun); --devices is per server")
    plan.add_argument("--network", default="100Gbit",
                      help="each server's network link, each way: 100Gbit, 400Gbit, 25GB (bytes/s)")
    plan.add_argument("--network-latency", type=float, default=20e-6, help="seconds per collective step")
    plan.add_argument("--shard-optimizer", choices=["auto", "on", "off"], default="auto",
                      help="optimizer state 1/N per server (on), whole on each (off), or the faster that fits")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--trace", help="write the simulated iteration as a Chrome trace (JSON) here")


def run(args: argparse.Namespace) -> int:
    from harmony_fx.calibrate import get_spec
    from harmony_fx.planner.presets import PRESETS, load_profile, preset_profile
    from harmony_fx.planner.search import PlanningError, search
    from harmony_fx.planner.specs import ClusterSpec, HostSpec
    from harmony_fx.trace import write_trace

    started = time.perf_counter()
    log = (lambda message: print(message, file=sys.stderr)) if args.json else print
    try:
        spec = get_spec(args.device_spec)
        if args.model in PRESETS and args.measure:
            raise ValueError("--measure needs a model you can run: presets are built on the meta device")
        if args.measure and args.device_spec != "host":
            raise ValueError(f"--measure times every layer on this machine, which is not a {args.device_spec}: "
                             "use it with --device-spec host, or leave it out to predict from the layers' FLOPs "
                             "and bytes")
        if args.model in PRESETS:
            profile, batch_size = preset_profile(args.model, args.precision)
        else:
            profile, batch_size = load_profile(args.model, args.precision, measure=args.measure)
        batch_size = batch_size if args.batch_size is None else args.batch_size
        link = parse_size(args.host_link) if args.host_link else 4 * spec.host_bandwidth
        host = HostSpec(memory=parse_size(args.host_memory), link_bandwidth=link,
                        update_params_per_second=args.update_rate, optimizer_state_bytes=_OPTIMIZER_STATE[args.optimizer],
                        nvme_bytes=parse_size(args.nvme), nvme_read=parse_rate(args.nvme_read),
                        nvme_write=parse_rate(args.nvme_write))
        network = parse_rate(args.network)
        where = f"{args.devices} x {spec.name}"
        if args.nodes > 1:
            where = f"{args.nodes} servers of {where}, network {args.network} each way"
        log(f"planning {profile.name}: {profile.num_params / 1e9:.2f}B parameters, {len(profile.layers)} layers, "
            f"batch {batch_size}{' per server' if args.nodes > 1 else ''}, {args.precision}, on {where}")
        layouts = {}
        for sharded in _layouts(args):
            cluster = ClusterSpec(args.nodes, network, args.network_latency, sharded)
            if args.nodes > 1:
                log(f"  optimizer state {'sharded over' if sharded else 'whole on each of'} the {args.nodes} servers:")
            try:
                layouts[sharded] = search(profile, spec, dataclasses.replace(host, cluster=cluster),
                                          batch_size=batch_size, devices=args.devices,
                                          budget=parse_size(args.memory_budget), parallel=args.parallel,
                                          microbatches=args.microbatches, progress=lambda m: log(f"  {m}"))
            except PlanningError as error:
                if len(_layouts(args)) == 1:
                    raise
                log(f"    does not fit: {error}")
        if not layouts:
            raise PlanningError("no optimizer layout fits host memory; add servers or host memory")
        sharded = min(layouts, key=lambda key: layouts[key].simulation.seconds)
        choice = layouts[sharded]
        host = dataclasses.replace(host, cluster=ClusterSpec(args.nodes, network, args.network_latency, sharded))
    except (PlanningError, ValueError) as error:
        print(f"harmony-fx plan: {error}", file=sys.stderr)
        return 2
    report = _report(profile, choice, spec, host, time.perf_counter() - started)
    if args.nodes > 1:
        sent = {kind: n for (lane, kind), n in choice.simulation.bytes_moved.items() if lane == "net"}
        report["network"] = {
            "nodes": args.nodes, "bandwidth_bytes_per_second": host.cluster.network_bandwidth,
            "optimizer": "sharded" if sharded else "replicated",
            "compared_seconds": {("sharded" if key else "replicated"): layouts[key].simulation.seconds for key in layouts},
            "bytes_per_server": sum(sent.values()), "bytes_by_collective": sent,
            "global_batch_size": batch_size * args.nodes,
            "global_samples_per_second": choice.samples_per_second() * args.nodes,
        }
    if host.nvme_bytes:
        report["nvme"] = _nvme_report(profile, choice, host)
    if args.trace:
        write_trace(args.trace, choice.simulation.trace_events())
        report["trace"] = args.trace
    if args.json:
        print(json.dumps(_finite(report), indent=2, allow_nan=False))
    else:
        print(_table(profile, choice))
        print(_summary(report))
    return 0


def _layouts(args) -> list[bool]:
    """Optimizer layouts to plan: sharded (True) and/or replicated (False)."""
    if args.nodes <= 1:
        return [False]
    return {"on": [True], "off": [False]}.get(args.shard_optimizer, [True, False])


def parse_rate(text: str) -> float:
    """A link's speed in bytes/s: ``100Gbit`` (bits per second) or ``12.5GB`` (bytes per second)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)bit(/s)?\s*", text)
    if match:
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2).lower()]
        return float(match.group(1)) * scale / 8
    try:
        rate = parse_size(text.removesuffix("/s"))
    except ValueError:
        rate = None
    if not rate:
        raise ValueError(f"--network {text!r}: give bits per second (100Gbit) or bytes per second (25GB)")
    return float(rate)


def _packs(profile, choice) -> list[dict]:
    from harmony_fx.lowering.placement import backward_device, forward_device, forward_tasks
    from harmony_fx.planner.chain import pack_layers

    schedule = choice.schedule
    count = len(schedule.boundaries)
    # each pack's forward task in the wrap (``lowering.pipeline``)
    task = [u for u, packs in enumerate(forward_tasks(schedule.forward_groups, count,
                                                      bool(schedule.forward_microbatches))) for _ in packs]
    rows = []
    for index, layers in enumerate(pack_layers(schedule.boundaries, len(profile.layers))):
        first = profile.layers[layers.start]
        stash = (profile.input_bytes if layers.start == 0 else profile.layers[layers.start - 1].out_bytes)
        if schedule.parallel == "pp":
            device = (f"d{forward_device(task[index], schedule.devices)}/"
                      f"d{backward_device(index, count, schedule.devices, task[-1])}")
        else:
            device = "all" if schedule.devices > 1 else "d0"
        rows.append({
            "pack": index, "layers": [first.name, profile.layers[layers.stop - 1].name], "num_layers": len(layers),
            "params": sum(profile.layers[i].num_params for i in layers),
            "weight_bytes": sum(profile.layers[i].param_bytes for i in layers),
            "stash_bytes": int(stash * choice.batch_size), "device": device,
        })
    return rows


def _report(profile, choice, spec, host, seconds: float) -> dict:
    simulation, schedule = choice.simulation, choice.schedule
    return {
        "model": profile.name, "parameters": profile.num_params, "layers": len(profile.layers),
        "batch_size": choice.batch_size, "precision": profile.precision,
        "device_spec": spec.name, "devices": schedule.devices, "parallel": schedule.parallel,
        "microbatches": schedule.microbatches, "packs": _packs(profile, choice), "policy": choice.policy,
        # Harmony's four choices: the forward's microbatches and packs, and the backward's
        "schedule": {"forward_microbatches": schedule.forward_microbatches or schedule.microbatches,
                     "forward_packs": schedule.forward_packs, "backward_microbatches": schedule.microbatches,
                     "backward_packs": len(schedule.boundaries)},
        "iteration_seconds": simulation.seconds, "samples_per_second": choice.samples_per_second(),
        "lower_bound_seconds": choice.lower_bound, "bound_by": choice.bound,
        "bytes_moved": {f"{d}/{k}": n for (d, k), n in sorted(simulation.bytes_moved.items())},
        "peak_bytes": simulation.peak_bytes, "host_bytes": choice.host_bytes,
        "compared_seconds": choice.compared, "planning_seconds": seconds,
    }


def _table(profile, choice) -> str:
    rows = []
    for pack in _packs(profile, choice):
        first, last = pack["layers"]
        layers = first if pack["num_layers"] == 1 else f"{first} .. {last} ({pack['num_layers']})"
        rows.append((str(pack["pack"]), layers, f"{pack['params'] / 1e6:,.1f}M", format_size(pack["weight_bytes"]),
                     format_size(pack["stash_bytes"]), pack["device"]))
    return format_table(("pack", "layers", "params", "weights", "stash", "devices (fwd/bwd)"), rows)


def _summary(report: dict) -> str:
    moved = report["bytes_moved"]
    by_direction = {}
    for key, n in moved.items():
        direction = key.split("/")[0]
        by_direction[direction] = by_direction.get(direction, 0) + n
    compared = ", ".join(f"{policy} {seconds:.3g} s" for policy, seconds in report["compared_seconds"].items())
    return "\n".join([
        "",
        f"{len(report['packs'])} packs, {report['microbatches']} microbatches, "
        + (f"{report['parallel']} over {report['devices']} devices" if report["devices"] > 1 else "one device")
        + f" (packing: {report['policy']})",
        _schedule_line(report["schedule"], report["batch_size"]),
        f"predicted iteration {report['iteration_seconds']:.4g} s, {report['samples_per_second']:.4g} samples/s",
        f"lower bound {report['lower_bound_seconds']:.4g} s (the {report['bound_by']} binds): "
        f"{report['iteration_seconds'] / report['lower_bound_seconds']:.2f}x of it",
        "bytes moved per iteration: " + ", ".join(f"{d} {format_size(n)}" for d, n in sorted(by_direction.items())),
        "peak per device: " + ", ".join(format_size(p) for p in report["peak_bytes"]),
        f"host memory: {format_size(report['host_bytes'])}" + (" per server" if "network" in report else ""),
        *([_network_line(report["network"])] if "network" in report else []),
        *([_nvme_line(report["nvme"])] if "nvme" in report else []),
        f"simulated packings: {compared}",
        f"planned in {report['planning_seconds']:.1f} s",
    ])


def _schedule_line(schedule: dict, batch_size: int) -> str:
    size = lambda count: f"{batch_size / count:.3g}"  # noqa: E731
    return (f"forward: {schedule['forward_microbatches']} microbatches in {schedule['forward_packs']} packs; "
            f"backward: {schedule['backward_microbatches']} in {schedule['backward_packs']} (Harmony's Ufwd "
            f"{size(schedule['forward_microbatches'])}, Pfwd {schedule['forward_packs']}, Ubwd "
            f"{size(schedule['backward_microbatches'])}, Pbwd {schedule['backward_packs']})")


def _nvme_report(profile, choice, host) -> dict:
    from harmony_fx.planner.host_memory import plan_host_memory

    schedule = choice.schedule
    levels = plan_host_memory(profile, schedule.boundaries, choice.batch_size, host,
                              schedule.devices if schedule.parallel == "pp" else 1)
    moved = choice.simulation.bytes_moved
    return {
        "capacity_bytes": host.nvme_bytes, "bytes_on_tier": levels.nvme_bytes,
        "optimizer_state_of_packs": list(levels.state_on_nvme), "fp32_masters_of_packs": list(levels.masters_on_nvme),
        "read_bytes_per_iteration": moved.get(("nvme", "read"), 0),
        "write_bytes_per_iteration": moved.get(("nvme", "write"), 0),
        "read_bandwidth": host.nvme_read, "write_bandwidth": host.nvme_write,
        "busy_seconds": sum(seconds for (_, lane), seconds in choice.simulation.busy.items() if lane == "io"),
    }


def _nvme_line(nvme: dict) -> str:
    if not nvme["bytes_on_tier"]:
        return "NVMe tier: not needed (host memory holds everything)"
    masters = (f" and the fp32 masters of {len(nvme['fp32_masters_of_packs'])}" if nvme["fp32_masters_of_packs"] else "")
    return (f"NVMe tier: the optimizer state of {len(nvme['optimizer_state_of_packs'])} pack(s){masters}, "
            f"{format_size(nvme['bytes_on_tier'])}; per iteration it reads {format_size(nvme['read_bytes_per_iteration'])} "
            f"and writes {format_size(nvme['write_bytes_per_iteration'])} ({nvme['busy_seconds']:.3g} s busy)")


def _network_line(network: dict) -> str:
    compared = ", ".join(f"{layout} {seconds:.4g} s" for layout, seconds in network["compared_seconds"].items())
    return (f"across {network['nodes']} servers (global batch {network['global_batch_size']}): optimizer state "
            f"{network['optimizer']}; {format_size(network['bytes_per_server'])} sent per server per iteration "
            f"({compared})")


def _finite(value: Any) -> Any:
    """``value`` with every infinite or NaN float as ``null`` (a compared packing that does not fit
    takes forever): JSON has no Infinity, and strict parsers refuse Python's."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
