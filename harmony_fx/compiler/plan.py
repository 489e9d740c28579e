"""The plan: what compiling decided, frozen, printable and serialisable (``hm.plan``)."""
from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Sequence

from torch import fx

from harmony_fx.config import format_size
from harmony_fx.ir import meta
from harmony_fx.program.actions import ActionKind, Key, KeyKind
from harmony_fx.program.format import format_table
from harmony_fx.program.traffic import bytes_moved

__all__ = ["PackPlan", "Plan", "make_plan"]


@dataclasses.dataclass(frozen=True)
class PackPlan:
    index: int
    layers: tuple[str, ...]
    num_params: int
    weight_bytes: int
    stash_bytes: int      # bytes of this pack's inputs stashed on the host per iteration
    device: str
    recompute: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    packs: tuple[PackPlan, ...]
    microbatches: int
    devices: tuple[str, ...]
    budget: int | None
    predicted_peak: dict[str, int]
    predicted_bytes: dict[str, int]   # "h2d/weights": bytes, ..., summed over devices
    policy: str
    parallel: str = "single"          # "single" (one device) | "dp" | "pp"
    batch: str = ""                   # whether the batch may be cut, and if not why (analysis.batch_dims)
    margin: int = 0                   # bytes kept below the budget for allocations no shape predicts
    margin_note: str = ""             # what the margin is for on these devices
    # host memory a GPU run pins: every pack's weights as copies read them (the masters, or their
    # compute-dtype copies), the stash and everything else offloaded in one iteration
    pinned_bytes: int = 0
    # the forward's own microbatches and packs (Harmony's Ufwd, Pfwd; the fields above are the
    # backward's Ubwd, Pbwd): how many microbatches and forward tasks per microbatch
    forward_microbatches: int = 0
    forward_packs: int = 0
    # samples in the largest microbatch of each (Harmony's Ufwd and Ubwd; 0: the batch is not cut)
    forward_microbatch_size: int = 0
    microbatch_size: int = 0
    handoff: str = ""  # a pipeline's: "peer" (device to device) or "host" (through the stash)
    # host memory and the NVMe tier (Trainer(host_memory=..., nvme_path=...)): the bytes a step holds
    # in host memory as planned, the packs whose optimizer state is on the tier and its bytes there
    # (each read and written once per iteration)
    host_bytes: int = 0
    host_memory: int | None = None
    nvme_path: str = ""
    tier_packs: tuple[int, ...] = ()
    tier_bytes: int = 0
    host_detail: str = ""
    tier_master_packs: tuple[int, ...] = ()  # of tier_packs, those whose fp32 masters are there too
    # the masters stay on the one device (``CompileOptions.resident_weights``): the program's weight
    # prefetches and weight-gradient offloads hand tensors over there, and move no bytes
    resident_weights: bool = False

    @property
    def bytes_h2d(self) -> int:
        return sum(n for k, n in self.predicted_bytes.items() if k.startswith("h2d/"))

    @property
    def bytes_d2h(self) -> int:
        return sum(n for k, n in self.predicted_bytes.items() if k.startswith("d2h/"))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def table(self) -> str:
        rows = []
        for pack in self.packs:
            layers = pack.layers[0] if len(pack.layers) == 1 else f"{pack.layers[0]} .. {pack.layers[-1]} ({len(pack.layers)})"
            rows.append((str(pack.index), layers, f"{pack.num_params:,}", format_size(pack.weight_bytes),
                         format_size(pack.stash_bytes), pack.device, "yes" if pack.recompute else "no"))
        lines = format_table(("pack", "layers", "params", "weights", "stash", "device", "recompute"), rows).split("\n")
        budget = "unlimited" if self.budget is None else format_size(self.budget)
        peaks = ", ".join(f"{d}: {format_size(p)}" for d, p in self.predicted_peak.items())
        lines += [
            "",
            f"{len(self.packs)} pack(s), {self.microbatches} microbatch(es), policy {self.policy}"
            + (f", {self.parallel} over {len(self.devices)} devices" if len(self.devices) > 1 else "")
            + {"peer": ", handing on device to device", "host": ", handing on through the host"}.get(self.handoff, ""),
            *([self.schedule_line()] if self.forward_microbatches else []),
            f"predicted peak {peaks} (budget {budget}, margin {format_size(self.margin)} kept below it"
            + (f": {self.margin_note})" if self.margin_note else ")"),
            *([f"batch: {self.batch}"] if self.batch else []),
            *([f"weights resident on {self.devices[0]}: none copied in, their gradients left there "
               "(param.grad) for your optimizer"] if self.resident_weights else []),
            f"predicted bytes per iteration: host->device {format_size(self.bytes_h2d)}, "
            f"device->host {format_size(self.bytes_d2h)}; host memory pinned on a GPU {format_size(self.pinned_bytes)}",
            *([self.tier_line()] if self.host_bytes else []),
        ]
        return "\n".join(lines)

    def schedule_line(self) -> str:
        """The four choices of Harmony's scheduler, in its terms beside ours."""
        size = lambda samples: str(samples) if samples else "the batch"  # noqa: E731
        return (f"forward: {self.forward_microbatches} microbatch(es) in {self.forward_packs} pack(s); backward: "
                f"{self.microbatches} microbatch(es) in {len(self.packs)} pack(s) (Harmony's Ufwd = "
                f"{size(self.forward_microbatch_size)}, Pfwd = {self.forward_packs}, Ubwd = {size(self.microbatch_size)}, "
                f"Pbwd = {len(self.packs)})")

    def tier_line(self) -> str:
        """Bytes per tier: host memory (and its limit), and what is on NVMe."""
        limit = "" if self.host_memory is None else f" (host_memory {format_size(self.host_memory)})"
        line = f"host memory per step {format_size(self.host_bytes)}{limit}: {self.host_detail}"
        if self.tier_packs:
            packs = " ".join(f"p{p}" for p in self.tier_packs)
            masters = (f" and fp32 masters of {' '.join(f'p{p}' for p in self.tier_master_packs)}"
                       if self.tier_master_packs else "")
            line += (f"; NVMe tier {self.nvme_path}: optimizer state of {packs}{masters}, "
                     f"{format_size(self.tier_bytes)}, read and written once per iteration")
        return line

    def __str__(self) -> str:
        return self.table()


def make_plan(candidate, shapes, nodes: Mapping[str, fx.Node], devices: Sequence, layout, budget: int | None,
              policy: str, batch: str, host_memory=None, nvme_path=None, resident: bool = False) -> Plan:
    """The plan of the chosen ``candidate`` (a ``compiler.packing.Candidate``): per pack its layers,
    parameters, weight bytes and stash; per device its predicted peak; the bytes moved by
    direction and kind (``shapes``: the key sizes; ``nodes``: the primary graph's, annotated with
    the chosen packs); ``host_memory``: the host memory plan (``compiler.host_memory.HostMemoryPlan``), if one
    was asked for; ``resident``: the weights stay on the device (their copies are hand-overs)."""
    packs = candidate.packs_by_size[layout.mb_sizes[0]]
    key_bytes = lambda key: shapes.key_bytes(key, packs)  # noqa: E731
    every_action = [a for forward, backward in candidate.device_actions for a in forward + backward]
    moved = bytes_moved(every_action, key_bytes)
    if resident:
        moved = {(direction, kind): n for (direction, kind), n in moved.items() if kind not in ("weights", "wgrad")}
    stash = {pack.index: 0 for pack in packs}
    for action in every_action:
        if action.kind == ActionKind.OFFLOAD and action.key.kind == KeyKind.ACT and action.key.name in nodes:
            producer = nodes[action.key.name].meta.get(meta.PACK)
            if producer is not None:
                stash[producer] += key_bytes(action.key)
    placement = ", ".join(d.name for d in devices)
    pack_plans = tuple(
        PackPlan(pack.index, pack.layer_names, sum(shapes.masters[n].numel() for n in pack.params),
                 key_bytes(Key(KeyKind.WEIGHTS, pack.name)), stash[pack.index], placement,
                 recompute=pack.index < len(packs) - 1)
        for pack in packs)
    first = devices[0]
    pinned = (0 if resident else sum(plan.weight_bytes for plan in pack_plans)) + sum(
        n for (direction, _), n in moved.items() if direction == "d2h")
    # the forward's own microbatches and packs: what its programs run (a group of packs is one)
    forward = [a for actions, _ in candidate.device_actions for a in actions if a.kind == ActionKind.FWD]
    runs = {a.pack for a in forward}
    groups = layout.forward_groups
    starts = groups[1] if groups and tuple(groups[0]) == tuple(candidate.boundaries) else sorted(runs)
    forward_packs = len([start for start in starts if start in runs])
    return Plan(pack_plans, layout.num_microbatches, tuple(d.name for d in devices), budget,
                {d.name: peak for d, peak in zip(devices, candidate.peaks)},
                {f"{d}/{k}": n for (d, k), n in sorted(moved.items())}, policy, layout.parallel, batch,
                first.margin, first.margin_note, pinned, len({a.mb for a in forward}), forward_packs,
                max(layout.sizes[a.mb] or 0 for a in forward) if forward else 0, max(s or 0 for s in layout.mb_sizes),
                layout.handoff if layout.parallel == "pp" else "",
                *(() if host_memory is None else (
                    host_memory.needs.total, host_memory.host_memory, str(nvme_path or ""), host_memory.tier_packs,
                    host_memory.tier_bytes, host_memory.needs.describe(), host_memory.tier_master_packs)),
                resident_weights=resident)
