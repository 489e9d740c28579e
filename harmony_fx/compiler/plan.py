"""The plan: what the planning passes decided, frozen, printable and serialisable."""
from __future__ import annotations

import dataclasses
import json

from harmony_fx.config import format_size

__all__ = ["PackPlan", "Plan"]


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

    @property
    def bytes_h2d(self) -> int:
        return sum(n for k, n in self.predicted_bytes.items() if k.startswith("h2d/"))

    @property
    def bytes_d2h(self) -> int:
        return sum(n for k, n in self.predicted_bytes.items() if k.startswith("d2h/"))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def table(self) -> str:
        rows = [("pack", "layers", "params", "weights", "stash", "device", "recompute")]
        for pack in self.packs:
            layers = pack.layers[0] if len(pack.layers) == 1 else f"{pack.layers[0]} .. {pack.layers[-1]} ({len(pack.layers)})"
            rows.append((str(pack.index), layers, f"{pack.num_params:,}", format_size(pack.weight_bytes),
                         format_size(pack.stash_bytes), pack.device, "yes" if pack.recompute else "no"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        budget = "unlimited" if self.budget is None else format_size(self.budget)
        peaks = ", ".join(f"{d}: {format_size(p)}" for d, p in self.predicted_peak.items())
        lines += [
            "",
            f"{len(self.packs)} pack(s), {self.microbatches} microbatch(es), policy {self.policy}"
            + (f", {self.parallel} over {len(self.devices)} devices" if len(self.devices) > 1 else ""),
            f"predicted peak {peaks} (budget {budget}, margin {format_size(self.margin)} kept below it"
            + (f": {self.margin_note})" if self.margin_note else ")"),
            *([f"batch: {self.batch}"] if self.batch else []),
            f"predicted bytes per iteration: host->device {format_size(self.bytes_h2d)}, "
            f"device->host {format_size(self.bytes_d2h)}",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
