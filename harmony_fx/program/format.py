"""Tables a person reads: device programs as a step x device grid of their compute tasks (and
host updates), and the aligned columns every table of harmony_fx prints with."""
from __future__ import annotations

from typing import Sequence

from harmony_fx.program.actions import Action, ActionKind

__all__ = ["format_schedule", "format_table"]

_SHOWN = (ActionKind.FWD, ActionKind.RECOMPUTE, ActionKind.BWD, ActionKind.UPDATE)
_SHORT = {ActionKind.FWD: "F", ActionKind.RECOMPUTE: "R", ActionKind.BWD: "B", ActionKind.UPDATE: "U"}


def format_schedule(programs: Sequence[Sequence[Action]], devices: Sequence[str]) -> str:
    """``F p1@0`` forward of pack 1 on microbatch 0, ``R`` recompute, ``B`` backward, ``U p1`` the
    host updating the parameters complete after pack 1; row i is each device's i-th task."""
    columns = [[_cell(a) for a in program if a.kind in _SHOWN] for program in programs]
    rows = max(len(column) for column in columns)
    width = max([len(name) for name in devices] + [len(cell) for column in columns for cell in column])
    lines = ["step  " + "  ".join(name.ljust(width) for name in devices)]
    for step in range(rows):
        cells = [column[step] if step < len(column) else "" for column in columns]
        lines.append(f"{step:<4}  " + "  ".join(cell.ljust(width) for cell in cells).rstrip())
    return "\n".join(lines)


def _cell(action: Action) -> str:
    if action.kind == ActionKind.UPDATE:
        return f"U p{action.pack}"
    return f"{_SHORT[action.kind]} p{action.pack}@{action.mb}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, a line of dashes under the header."""
    rows = [tuple(header), *[tuple(row) for row in rows]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
