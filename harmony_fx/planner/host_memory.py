"""Host memory and an NVMe tier: what of each pack's host state lives where, for the planner.

A parameter costs the host its fp32 master (4 B), its fp32 gradient (4 B) and the optimizer's
state (Adam: 8 B); when weights travel in bf16, the bf16 copy the devices' copies read (2 B, one
for all devices); the stash comes on top. Where that passes ``HostSpec.memory`` and an NVMe tier
is given (``HostSpec.nvme_bytes``), packs move to it by the tier's policy, as the compiler's
``compiler.host_memory.plan_host_memory`` does for a model at hand
(``tier_policy.choose_tiered``: the optimizer state first, the largest first; then, under bf16,
the fp32 masters, 4 B each, the bf16 copy staying), within the tier's capacity. A pack on the
tier streams its state through its update one parameter at a time (``runtime.tier``), so host
memory also holds ``tier_policy.staged_params`` times the largest tiered layer's tier bytes (a
bound: the runtime's unit is a parameter, at most a layer).

This decides for the planner and the simulator: ``chain_schedule`` inserts the programs' ``READ``
and ``WRITE`` of each tiered pack, sized from it. The packing's dynamic program, which chooses
packs before any of this is decided, charges each pack its share of the tier (``tier_share``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from harmony_fx.planner.profile import ModelProfile
from harmony_fx.tier_policy import choose_tiered, staging_bytes

__all__ = ["HostMemoryLevels", "plan_host_memory", "MASTER_AND_GRAD_BYTES", "TierShare", "tier_share"]

MASTER_AND_GRAD_BYTES = 8  # fp32 master and its fp32 gradient, per parameter


@dataclasses.dataclass(frozen=True)
class HostMemoryLevels:
    host_bytes: int                      # host memory one iteration holds
    nvme_bytes: int                      # bytes on the tier
    state_on_nvme: tuple[int, ...] = ()  # packs whose optimizer state is on the tier
    masters_on_nvme: tuple[int, ...] = ()  # packs whose fp32 masters are too (bf16 weights)
    pack_nvme_bytes: tuple[int, ...] = ()  # per pack: bytes read before its update, written after


def plan_host_memory(profile: ModelProfile, boundaries: Sequence[int], batch_size: int, host,
                     devices: int = 1) -> HostMemoryLevels:
    """Where each pack's host state lives for the packs starting at ``boundaries`` (``[]``: no
    stash, what the parameters alone need). ``host``: a ``HostSpec``; ``devices``: how many
    devices' programs update packs (a pipeline's; data-parallel updates on the first)."""
    layers = profile.layers
    ends = [*boundaries[1:], len(layers)] if boundaries else []
    spans = [range(a, b) for a, b in zip(boundaries, ends)] or [range(len(layers))]
    params = [sum(layers[i].num_params for i in span) for span in spans]
    largest = [max((layers[i].num_params for i in span), default=0) for span in spans]  # a pack's largest layer
    stash = sum((profile.input_bytes if b == 0 else layers[b - 1].out_bytes) for b in boundaries) * batch_size
    cluster = host.cluster
    sharded = cluster.nodes > 1 and cluster.shard_optimizer
    # sharded across servers: full weights and gradients on every server, and 1/N of the fp32
    # master chunks with their optimizer state (the part the tier may take)
    state_per_param = (4 + host.optimizer_state_bytes) / cluster.nodes if sharded else host.optimizer_state_bytes
    state = [int(n * state_per_param) for n in params]
    # the masters may follow only where the devices read bf16 copies, which the host keeps
    copies = 2 * sum(params) if profile.precision == "bf16" else 0
    base = int(sum(params) * MASTER_AND_GRAD_BYTES + copies + sum(state) + stash)
    if host.memory is None or base <= host.memory or not host.nvme_bytes:
        return HostMemoryLevels(base, 0, pack_nvme_bytes=(0,) * len(params))
    masters = [4 * n if profile.precision == "bf16" and not sharded else 0 for n in params]

    def need(state_moved: Sequence[int], masters_moved: Sequence[int]) -> int:
        # the tier takes the state and the masters moved; staging: the largest tiered layer's
        # tier bytes, as many times as the stream holds parameters
        taken = sum(state[p] for p in state_moved) + sum(masters[p] for p in masters_moved)
        staging = staging_bytes(devices, [largest[p] * (state_per_param + (4 if p in masters_moved else 0))
                                          for p in state_moved])
        return int(base - taken + staging)

    state_moved, masters_moved = choose_tiered(
        dict(enumerate(state)), dict(enumerate(masters)), lambda *moved: need(*moved) <= host.memory,
        capacity=host.nvme_bytes)
    on_tier = [(state[p] if p in state_moved else 0) + (masters[p] if p in masters_moved else 0)
               for p in range(len(params))]
    return HostMemoryLevels(need(state_moved, masters_moved), sum(on_tier), tuple(sorted(state_moved)),
                            tuple(sorted(masters_moved)), tuple(on_tier))


@dataclasses.dataclass(frozen=True)
class TierShare:
    """A pack's share of the NVMe tier, as bytes the tier holds for it (read before its update,
    written after it): ``per_param`` for each of its parameters, and ``per_input_byte`` for each
    byte of one sample's input to it (its stash, which takes host memory and so pushes as much
    state out to the tier). Zero where everything fits host memory."""

    per_param: float = 0.0
    per_input_byte: float = 0.0


def tier_share(profile: ModelProfile, batch_size: int, host, devices: int = 1) -> TierShare:
    """Host memory's overflow shared out over a packing not yet chosen: what the parameters alone
    overflow (masters, gradients, state, no stash) spread evenly over them, and the share of the
    most stash (a pack per layer) that overflows beyond that, per byte of it. Additive over packs,
    as the dynamic program needs; the tier's real placement (whole packs, the largest first) takes
    up to a pack's state more."""
    if host.memory is None or not host.nvme_bytes or not profile.num_params:
        return TierShare()
    unbounded = dataclasses.replace(host, memory=None)  # what an iteration holds, nothing on the tier
    layers = range(len(profile.layers))
    params_need = plan_host_memory(profile, layers, 0, unbounded, devices).host_bytes
    stash = batch_size * (profile.input_bytes + sum(layer.out_bytes for layer in profile.layers[:-1]))
    params_over = max(params_need - host.memory, 0)
    stash_over = max(params_need + stash - host.memory, 0) - params_over
    return TierShare(params_over / profile.num_params, batch_size * stash_over / stash if stash else 0.0)
