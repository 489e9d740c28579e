"""What a program moves: bytes per direction and key kind, from the actions and key sizes alone."""
from __future__ import annotations

import collections
from typing import Callable, Sequence

from harmony_fx.program.actions import Action, ActionKind, Key

__all__ = ["bytes_moved", "COPIES_RECEIVED"]

# the actions whose bytes arrive somewhere: a SEND's are counted by the RECV that takes them
COPIES_RECEIVED = frozenset({ActionKind.PREFETCH, ActionKind.OFFLOAD, ActionKind.RECV})


def bytes_moved(actions: Sequence[Action], key_bytes: Callable[[Key], int]) -> dict[tuple[str, str], int]:
    """``{(direction, kind): bytes}``, e.g. ``("h2d", "weights")``, ``("peer", "act")`` (counted where
    received); the same keys as ``Stats``. A copy's direction is the stream it runs on."""
    moved: dict[tuple[str, str], int] = collections.defaultdict(int)
    for action in actions:
        if action.kind in COPIES_RECEIVED:
            moved[(action.stream.value, action.key.kind.name.lower())] += key_bytes(action.key)
    return dict(moved)
