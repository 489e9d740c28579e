"""``plan_host_memory``: what a ``Trainer`` step holds in host memory, and which packs keep their
optimizer state, and then their fp32 masters, on the NVMe tier so that it fits ``host_memory``.

What a step holds in host memory (``HostNeeds``, every figure in bytes):

* ``masters``: the model's parameters and buffers (what the devices' weight copies read); a
  parameter whose fp32 master is on the tier counts as its compute-dtype copy (bf16: 2 B);
* ``weight_copies``: under a compute dtype (``precision="bf16"``), the copy in that dtype each
  device's weight copies read of every other floating parameter (``runtime.devices`` stages them);
* ``grads``: a gradient per trainable parameter, summed on the host;
* ``state``: the optimizer's state of the packs not on the tier;
* ``stash``: every activation the forward copies out, held until the backward reads it;
* ``copies``: with ``Trainer(atomic=True)``, the copy of each updated pack's parameters and
  in-memory state kept until the step ends (a tiered pack's state needs none: its previous
  file stays until the step is committed);
* ``staging``: the tier's state in flight: a pack's state streams through its update one
  parameter at a time (``runtime.tier``), so at most ``tier_policy.staged_params(devices)`` times
  the largest tiered parameter's state (and its fp32 master, where that is on the tier too).

What goes to the tier, and in what order, is ``tier_policy.choose_tiered``'s: state, the largest
first, until the total fits ``host_memory``; then, where weights travel in a narrower compute
dtype, the fp32 masters, largest first: the parameter then holds its bf16 copy in host memory (the
tensor the devices read; its gradient stays fp32 through ``Tensor.grad_dtype``), and its update
reads the fp32 master with the state, steps it and writes it back (``runtime.tier``). A master on
the tier saves its 4 B and the copy the devices would otherwise stage. A planning pass: it
decides, ``lowering.tier_io.insert_tier_io`` applies.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from harmony_fx.config import format_size
from harmony_fx.tier_policy import choose_tiered, largest_first, masters_may_move, staging_bytes

__all__ = ["OptimizerFacts", "HostNeeds", "HostMemoryPlan", "plan_host_memory"]

PASS_NAME = "plan_host_memory"


@dataclasses.dataclass(frozen=True)
class OptimizerFacts:
    """What the ``Trainer`` tells compiling about its optimizer."""

    state_bytes: Callable[[nn.Parameter], int]  # the optimizer's state tensors for a parameter, once made
    keeps_copies: bool                          # Trainer(atomic=True): copies of each updated pack
    masters_may_move: bool = True               # False: the fp32 masters stay in host memory (across processes)


@dataclasses.dataclass(frozen=True)
class HostNeeds:
    masters: int
    grads: int
    state: int
    stash: int
    copies: int
    staging: int
    weight_copies: int = 0

    @property
    def total(self) -> int:
        return self.masters + self.weight_copies + self.grads + self.state + self.stash + self.copies + self.staging

    def describe(self) -> str:
        parts = [(self.masters, "weights"), (self.weight_copies, "weight copies in the compute dtype"),
                 (self.grads, "gradients"), (self.state, "optimizer state"),
                 (self.stash, "stash"), (self.copies, "the step's undo copies"), (self.staging, "tier staging")]
        return ", ".join(f"{format_size(n)} {what}" for n, what in parts if n)


@dataclasses.dataclass(frozen=True)
class HostMemoryPlan:
    host_memory: int | None                 # the limit asked for (None: no limit)
    tier_packs: tuple[int, ...]             # packs whose optimizer state is on the tier
    pack_state_bytes: Mapping[int, int]     # every updated pack's optimizer state
    needs: HostNeeds                        # host memory with that choice
    tier_master_packs: tuple[int, ...] = ()  # packs whose fp32 masters are on the tier too
    pack_master_bytes: Mapping[int, int] = dataclasses.field(default_factory=dict)  # fp32 masters a pack may move

    @property
    def tier_bytes(self) -> int:
        return (sum(self.pack_state_bytes[p] for p in self.tier_packs)
                + sum(self.pack_master_bytes[p] for p in self.tier_master_packs))


def plan_host_memory(groups: Mapping[int, Sequence[nn.Parameter]], masters: Sequence, stash: int,
                     optimizer: OptimizerFacts, host_memory: int | None, tier: bool, devices: int = 1,
                     compute_dtype: torch.dtype | None = None, weight_stagers: int = 1) -> HostMemoryPlan:
    """``groups``: the parameters each pack's update steps; ``masters``: every host tensor the
    packs read (parameters and buffers, each once); ``stash``: bytes the forward copies out;
    ``tier``: whether there is a tier to move state to (``nvme_path``); ``devices``: how many
    devices' programs may open a pack's stream ahead; ``compute_dtype``: the dtype weights travel
    in (``None``: their own); ``weight_stagers``: how many devices stage a copy of each weight in
    it (each, data-parallel; one, a pipeline)."""
    state = {pack: sum(optimizer.state_bytes(p) for p in params) for pack, params in groups.items()}
    largest = {pack: max((optimizer.state_bytes(p) for p in params), default=0) for pack, params in groups.items()}
    params = [p for group in groups.values() for p in group]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    param_bytes = sum(nbytes(p) for p in params)
    narrow = torch.empty((), dtype=compute_dtype).element_size() if compute_dtype is not None else 0
    staged_copy = lambda t: (t.numel() * narrow if compute_dtype is not None and t.is_floating_point()  # noqa: E731
                             and t.dtype != compute_dtype else 0)
    fixed = sum(nbytes(t) for t in masters)
    fixed_copies = weight_stagers * sum(staged_copy(t) for t in masters)
    # per pack, what moving its masters would take off the host: the fp32 tensor less its bf16
    # copy, and the copies the devices would stage
    movable = {pack: [p for p in params if optimizer.masters_may_move and masters_may_move(p, compute_dtype)]
               for pack, params in groups.items()}
    master_bytes = {pack: sum(nbytes(p) for p in movable[pack]) for pack in groups}
    largest_master = {pack: max((nbytes(p) for p in movable[pack]), default=0) for pack in groups}

    def needs(on_tier: Sequence[int], masters_on_tier: Sequence[int] = ()) -> HostNeeds:
        kept = sum(n for pack, n in state.items() if pack not in on_tier)
        moved = [p for pack in masters_on_tier for p in movable[pack]]
        staged = staging_bytes(devices, [largest[p] + (largest_master[p] if p in masters_on_tier else 0)
                                         for p in on_tier])
        copies = param_bytes - sum(nbytes(p) for p in moved) + kept if optimizer.keeps_copies else 0
        return HostNeeds(fixed - sum(nbytes(p) - staged_copy(p) for p in moved), param_bytes, kept, stash, copies,
                         staged, fixed_copies - weight_stagers * sum(staged_copy(p) for p in moved))

    chosen: list[int] = []
    chosen_masters: list[int] = []
    order = largest_first(state)
    # a pack's masters follow its state only (the tier's store keeps them in the state's file)
    movable_masters = {p: master_bytes[p] for p in order}
    master_order = largest_first(movable_masters)
    if tier and host_memory is not None:
        chosen, chosen_masters = choose_tiered(state, movable_masters,
                                               lambda *on_tier: needs(*on_tier).total <= host_memory)
    elif tier:
        chosen = order  # a tier and no limit: all of the state, as asked
    plan = HostMemoryPlan(host_memory, tuple(sorted(chosen)), state, needs(chosen, chosen_masters),
                          tuple(sorted(chosen_masters)), master_bytes)
    if host_memory is not None and plan.needs.total > host_memory:
        candidates = [needs(order[:k]) for k in range(len(order) + 1)]
        candidates += [needs(order, master_order[:k]) for k in range(1, len(master_order) + 1)]
        best = min(candidates, key=lambda n: n.total) if tier else plan.needs
        advice = (f"raise host_memory to at least {format_size(best.total)}" if tier else
                  f"raise host_memory to at least {format_size(best.total)}, or pass nvme_path= so that the "
                  "optimizer state goes to an NVMe tier")
        raise ValueError(f"{PASS_NAME}: host_memory={format_size(host_memory)} is too small: a step holds "
                         f"{format_size(best.total)} ({best.describe()}); {advice}")
    return plan
