"""``plan_tier``: which packs keep their optimizer state on the NVMe tier, so that host memory fits.

What a ``Trainer`` step holds in host memory (``HostNeeds``, every figure in bytes):

* ``masters``: the model's parameters and buffers (what the devices' weight copies read);
* ``grads``: a gradient per trainable parameter, summed on the host;
* ``state``: the optimizer's state of the packs not on the tier;
* ``stash``: every activation the forward copies out, held until the backward reads it;
* ``copies``: with ``Trainer(atomic=True)``, the copy of each updated pack's parameters and
  in-memory state kept until the step ends (a tiered pack's state needs none: its previous
  file stays until the step is committed);
* ``staging``: the tier's state in flight: a pack's state streams through its update one
  parameter at a time (``runtime.tier``), so at most ``staged_params(devices)`` times the largest
  tiered parameter's state.

Packs go to the tier largest state first (the fewest packs, so the fewest files and reads),
until the total fits ``host_memory``. A planning pass: it decides, ``insert_tier_io`` applies.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from torch import nn

from harmony_fx.config import format_size

__all__ = ["OptimizerFacts", "HostNeeds", "TierPlan", "plan_tier", "staged_params", "READ_AHEAD"]

PASS_NAME = "plan_tier"
READ_AHEAD = 2  # parameters a pack's state stream reads ahead of the one being stepped


def staged_params(devices: int) -> int:
    """Parameters' state the tier holds in host memory at most (``runtime.tier``): ``READ_AHEAD``
    for each pack a device's program opened ahead of its update (one per device) and for the pack
    being updated, the parameter being stepped, and the one in the writer's hands."""
    return READ_AHEAD * (devices + 1) + 2


@dataclasses.dataclass(frozen=True)
class OptimizerFacts:
    """What the ``Trainer`` tells compiling about its optimizer."""

    state_bytes: Callable[[nn.Parameter], int]  # the optimizer's state tensors for a parameter, once made
    keeps_copies: bool                          # Trainer(atomic=True): copies of each updated pack


@dataclasses.dataclass(frozen=True)
class HostNeeds:
    masters: int
    grads: int
    state: int
    stash: int
    copies: int
    staging: int

    @property
    def total(self) -> int:
        return self.masters + self.grads + self.state + self.stash + self.copies + self.staging

    def describe(self) -> str:
        parts = [(self.masters, "weights"), (self.grads, "gradients"), (self.state, "optimizer state"),
                 (self.stash, "stash"), (self.copies, "the step's undo copies"), (self.staging, "tier staging")]
        return ", ".join(f"{format_size(n)} {what}" for n, what in parts if n)


@dataclasses.dataclass(frozen=True)
class TierPlan:
    host_memory: int | None                 # the limit asked for (None: no limit)
    packs: tuple[int, ...]                  # packs whose optimizer state is on the tier
    pack_state_bytes: Mapping[int, int]     # every updated pack's optimizer state
    needs: HostNeeds                        # host memory with that choice

    @property
    def tier_bytes(self) -> int:
        return sum(self.pack_state_bytes[p] for p in self.packs)


def plan_tier(groups: Mapping[int, Sequence[nn.Parameter]], masters: Sequence, stash: int,
              optimizer: OptimizerFacts, host_memory: int | None, tier: bool, devices: int = 1) -> TierPlan:
    """``groups``: the parameters each pack's update steps; ``masters``: every host tensor the
    packs read (parameters and buffers, each once); ``stash``: bytes the forward copies out;
    ``tier``: whether there is a tier to move state to (``nvme_path``); ``devices``: how many
    devices' programs may open a pack's stream ahead."""
    state = {pack: sum(optimizer.state_bytes(p) for p in params) for pack, params in groups.items()}
    largest = {pack: max((optimizer.state_bytes(p) for p in params), default=0) for pack, params in groups.items()}
    params = [p for group in groups.values() for p in group]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    fixed = sum(t.numel() * t.element_size() for t in masters)

    def needs(on_tier: Sequence[int]) -> HostNeeds:
        kept = sum(n for pack, n in state.items() if pack not in on_tier)
        staged = staged_params(devices) * max((largest[p] for p in on_tier), default=0)
        copies = param_bytes + kept if optimizer.keeps_copies else 0
        return HostNeeds(fixed, param_bytes, kept, stash, copies, staged)

    chosen: list[int] = []
    order = sorted((p for p in state if state[p]), key=lambda p: (-state[p], -p))
    if tier and host_memory is not None:
        for pack in order:
            if needs(chosen).total <= host_memory:
                break
            chosen.append(pack)
    elif tier:
        chosen = order  # a tier and no limit: all of it, as asked
    plan = TierPlan(host_memory, tuple(sorted(chosen)), state, needs(chosen))
    if host_memory is not None and plan.needs.total > host_memory:
        best = min((needs(order[:k]) for k in range(len(order) + 1)), key=lambda n: n.total) if tier else plan.needs
        advice = (f"raise host_memory to at least {format_size(best.total)}" if tier else
                  f"raise host_memory to at least {format_size(best.total)}, or pass nvme_path= so that the "
                  "optimizer state goes to an NVMe tier")
        raise ValueError(f"{PASS_NAME}: host_memory={format_size(host_memory)} is too small: a step holds "
                         f"{format_size(best.total)} ({best.describe()}); {advice}")
    return plan
