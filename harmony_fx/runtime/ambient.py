"""The thread's autocast state, as a value: read where a forward starts, replayed in every pack.

Autocast is thread-local and the captured graph does not contain its casts (export's training IR
leaves them to the dispatcher), so a pack computes what eager computes only under the autocast
state the graph was captured under. A ``Runtime`` reads that state once, on the caller's thread
(``Autocast.current()``), and runs every forward and recompute under it (``scope``), whichever
thread issues the task and whatever autocast state is current when the backward comes: the
recompute replays the forward's state as it replays the forward's RNG state. The backward runs
with autocast off, as eager's ``loss.backward()`` outside the autocast region does.

Inside a pack autocast's weight-cast cache is off: the cache keeps every pack's low-precision
weight copy until the caller's outermost autocast region ends, memory the plan does not count.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

__all__ = ["Autocast", "scope"]

_DEVICE_TYPES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Autocast:
    """Per device type (``cpu``, ``cuda``), whether autocast is on and its dtype (``None``: off)."""

    dtypes: tuple[torch.dtype | None, ...] = (None,) * len(_DEVICE_TYPES)

    @classmethod
    def current(cls) -> "Autocast":
        return cls(tuple(torch.get_autocast_dtype(t) if torch.is_autocast_enabled(t) else None
                         for t in _DEVICE_TYPES))

    @property
    def enabled(self) -> bool:
        return any(dtype is not None for dtype in self.dtypes)

    def describe(self) -> str:
        on = [f"{t} {str(d).removeprefix('torch.')}" for t, d in zip(_DEVICE_TYPES, self.dtypes) if d is not None]
        return "autocast " + ", ".join(on) if on else "no autocast"


OFF = Autocast()


def _apply(state: Autocast) -> None:
    for device_type, dtype in zip(_DEVICE_TYPES, state.dtypes):
        torch.set_autocast_enabled(device_type, dtype is not None)
        if dtype is not None:
            torch.set_autocast_dtype(device_type, dtype)


@contextlib.contextmanager
def scope(state: Autocast) -> Iterator[None]:
    """Run under exactly ``state`` with the weight-cast cache off; the thread's own state is
    restored after, on errors too. Costs nothing where neither side has autocast on."""
    if not state.enabled and not any(torch.is_autocast_enabled(t) for t in _DEVICE_TYPES):
        yield
        return
    # the dtype is kept where autocast is off too: a later torch.autocast(enabled=True) reads it
    saved = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _DEVICE_TYPES]
    cache = torch.is_autocast_cache_enabled()
    try:
        _apply(state)
        torch.set_autocast_cache_enabled(False)
        yield
    finally:
        for device_type, enabled, dtype in saved:
            torch.set_autocast_enabled(device_type, enabled)
            torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_cache_enabled(cache)
