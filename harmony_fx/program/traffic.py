"""What a program moves: bytes per direction and key kind, from the actions and key sizes alone."""
from __future__ import annotations

import collections
from typing import Callable, Sequence

from harmony_fx.program.actions import Action, ActionKind, Key

__all__ = ["bytes_moved"]


def bytes_moved(actions: Sequence[Action], key_bytes: Callable[[Key], int]) -> dict[tuple[str, str], int]:
    """``{(direction, kind): bytes}``, e.g. ``("h2d", "weights")``, ``("peer", "act")`` (counted where
    received); the same keys as ``Stats``."""
    moved: dict[tuple[str, str], int] = collections.defaultdict(int)
    direction_of = {ActionKind.PREFETCH: "h2d", ActionKind.OFFLOAD: "d2h", ActionKind.RECV: "peer"}
    for action in actions:
        if action.kind in direction_of:
            moved[(direction_of[action.kind], action.key.kind.name.lower())] += key_bytes(action.key)
    return dict(moved)
