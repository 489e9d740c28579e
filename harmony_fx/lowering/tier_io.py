"""``insert_tier_io``: the NVMe tier's reads and writes, placed in the programs.

A pack whose optimizer state lives on the tier (``tier_packs``, decided by
``compiler.host_memory.plan_host_memory``) needs that state in host memory for its update only. On
the device that hands the pack's update to the host (the first that does, in data-parallel), its
programs get:

* ``READ S[pk]`` ``tier_policy.PACKS_READ_AHEAD`` (one) tiered pack ahead: the first at the start
  of the program that updates it (the forward's, for a Trainer's last pack, which runs forward,
  loss and backward in one task, so that read overlaps the whole forward); each next one right
  after the ``UPDATE`` of the tiered pack before it (at the backward program's start when that
  update is in the forward's: a program's events are its own). The tier's reader then fetches the
  pack's first parameters' state while the device computes the backward of the packs in between
  and the host steps the pack before;
* the ``UPDATE pk`` names the read's event (its worker waits for the state, as for the gradients,
  then streams the rest through the update a parameter at a time: ``runtime.tier``);
* ``WRITE S[pk]`` right after it (at the backward program's start for an update in the forward's):
  done once the pack's stepped state is back on the tier and out of host memory.

No program waits for a write: the last writes of a step go on while the next step runs its
forward. The tier commits the step once they are on the device, and the next step's reads and
updates wait for that commit (``runtime.tier``), so its reads see the new files and its updates
step the new state.
"""
from __future__ import annotations

from typing import Sequence

from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind, Stream
from harmony_fx.tier_policy import PACKS_READ_AHEAD

__all__ = ["insert_tier_io", "state_key"]

PASS_NAME = "insert_tier_io"


def state_key(pack: int) -> Key:
    return Key(KeyKind.STATE, f"p{pack}")


def insert_tier_io(device_actions: Sequence[tuple[Sequence[Action], Sequence[Action]]],
                   tier_packs: frozenset[int]) -> list[tuple[list[Action], list[Action]]]:
    """``device_actions`` with the tier's reads and writes in the backward programs (see the module
    docstring). Every pack of ``tier_packs`` must be updated by some device's program."""
    events = [a.event for pair in device_actions for actions in pair for a in actions if a.event is not None]
    next_event = max(events, default=-1) + 1
    hosts: dict[int, int] = {}  # tiered pack -> the device whose program reads and writes its state
    for device, (forward, backward) in enumerate(device_actions):
        for action in [*forward, *backward]:
            if action.kind == K.UPDATE and action.pack in tier_packs:
                hosts.setdefault(action.pack, device)
    missing = sorted(tier_packs - hosts.keys())
    if missing:
        raise ValueError(f"{PASS_NAME}: pack(s) {', '.join(f'p{p}' for p in missing)} have optimizer state on the "
                         "tier, but no program updates them on the host")
    result = []
    for device, (forward, backward) in enumerate(device_actions):
        # the Trainer's fused last pack updates in the forward program: both are one iteration
        phases = [list(forward), list(backward)]
        hosted = [a.pack for phase in phases for a in phase if a.kind == K.UPDATE and hosts.get(a.pack) == device]
        if not hosted:
            result.append((phases[0], phases[1]))
            continue
        reads: dict[int, int] = {}
        out: list[list[Action]] = [[], []]
        # a program's events are its own: a read goes into the program whose UPDATE names it
        phase_of = {a.pack: phase for phase in (0, 1) for a in phases[phase] if a.kind == K.UPDATE}

        def emit(phase: int, kind: K, pack: int) -> int:
            nonlocal next_event
            event, next_event = next_event, next_event + 1
            out[phase].append(Action(kind, Stream.IO, key=state_key(pack), event=event, device=device,
                                     created_by=PASS_NAME))
            return event

        for first in hosted[:PACKS_READ_AHEAD]:
            reads[first] = emit(phase_of[first], K.READ, first)
        for phase, actions in enumerate(phases):
            for action in actions:
                if action.kind != K.UPDATE or hosts.get(action.pack) != device:
                    out[phase].append(action)
                    continue
                pack = action.pack
                out[phase].append(Action(K.UPDATE, Stream.HOST, pack=pack, after=(*action.after, reads[pack]),
                                         device=device, created_by=action.created_by))
                position = hosted.index(pack)
                if position + PACKS_READ_AHEAD < len(hosted):
                    upcoming = hosted[position + PACKS_READ_AHEAD]
                    reads[upcoming] = emit(phase_of[upcoming], K.READ, upcoming)  # the backward's start, or now
                emit(1, K.WRITE, pack)  # the backward's start when the update is in the forward
        result.append((out[0], out[1]))
    return result
