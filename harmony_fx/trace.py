"""Chrome trace (``chrome://tracing``, https://ui.perfetto.dev) of a timeline: one process per device,
one thread (row) per stream, and a memory counter per device.

Both the simulator's predicted timeline and the runtime's measured one are written by this module.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

__all__ = ["chrome_events", "write_trace"]

_ROWS = ("compute", "h2d", "d2h", "peer", "host")


def chrome_events(spans: Iterable[tuple[int, str, str, float, float]],
                  memory: Sequence[Sequence[tuple[float, int]]] = (), names: Sequence[str] | None = None) -> list[dict]:
    """``spans``: (device, stream, label, start s, end s); ``memory``: per device (time s, bytes)."""
    events: list[dict] = []
    devices = set()
    for device, stream, label, start, end in spans:
        devices.add(device)
        events.append({"name": label, "cat": stream, "ph": "X", "pid": device, "tid": _ROWS.index(stream),
                       "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6})
    for device, timeline in enumerate(memory):
        devices.add(device)
        for time, resident in timeline:
            events.append({"name": "memory", "ph": "C", "pid": device, "ts": time * 1e6,
                           "args": {"MiB": resident / 2**20}})
    for device in sorted(devices):
        label = names[device] if names else f"device {device}"
        events.append({"name": "process_name", "ph": "M", "pid": device, "args": {"name": label}})
        for tid, row in enumerate(_ROWS):
            events.append({"name": "thread_name", "ph": "M", "pid": device, "tid": tid, "args": {"name": row}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": device, "tid": tid, "args": {"sort_index": tid}})
    return events


def write_trace(path: str | os.PathLike, events: list[dict]) -> None:
    """Write atomically: a viewer never opens a half-written file."""
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
