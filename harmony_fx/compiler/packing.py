"""Decide the packs: which contiguous layer ranges run together, and what each candidate costs.

A packing policy maps ``(layer_costs, num_packs)`` to pack boundaries; ``plan_packs`` tries 1, 2,
... packs and keeps the first packing whose program fits the budget. The policy is a parameter:
the planner's boundaries (``fixed``) or ``balanced``: the layers in ``num_packs`` contiguous chunks
of about equal cost (weights plus activations), cut at prefix-sum quantiles, as Harmony's
``balanced_addx``.

``evaluate`` is what a candidate costs, and changes nothing it is given: split the packs of every
microbatch size, lower every device's programs, verify them, and run each on FakeTensors for its
peak (``compiler.estimate``).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Callable, Mapping, Sequence, TypeVar

import torch
from torch import nn

from harmony_fx.compiler.estimate import DeviceEstimate, estimate_device
from harmony_fx.compiler.layout import Layout
from harmony_fx.compiler.shapes import Shapes
from harmony_fx.compiler.variants import Variant
from harmony_fx.ir import meta
from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.pipeline import lower_pipeline
from harmony_fx.lowering.single import lower_program
from harmony_fx.lowering.tasks import ProgramSignature
from harmony_fx.passes.split_packs import split_packs
from harmony_fx.program.actions import Action, ActionKind, Key, KeyKind
from harmony_fx.program.verify import verify_devices, verify_program

__all__ = ["balanced", "fixed", "plan_packs", "PackingPolicy", "BudgetTooSmallError", "Candidate", "PackingContext",
           "evaluate", "layer_costs", "lower_devices", "update_groups", "verify_programs"]

PackingPolicy = Callable[[Sequence[int], int], list[int]]
C = TypeVar("C")


class BudgetTooSmallError(ValueError):
    """No packing fits the budget. ``smallest_budget``: the smallest budget that fits, in bytes
    (what a tool that retries should ask for)."""

    def __init__(self, message: str, smallest_budget: int) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


def balanced(layer_costs: Sequence[int], num_packs: int) -> list[int]:
    """Boundaries (first layer of each pack) of ``num_packs`` chunks of about equal total cost."""
    num_layers = len(layer_costs)
    num_packs = min(num_packs, num_layers)
    prefix = list(itertools.accumulate(max(cost, 1) for cost in layer_costs))
    total = prefix[-1]
    boundaries = [0]
    for k in range(1, num_packs):
        cut = bisect.bisect_left(prefix, total * k / num_packs) + 1
        cut = max(cut, boundaries[-1] + 1)
        cut = min(cut, num_layers - (num_packs - k))
        boundaries.append(cut)
    return boundaries


def plan_packs(layer_costs: Sequence[int], evaluate: Callable[[list[int]], C], peak_of: Callable[[C], int],
               budget: int | None, policy: PackingPolicy = balanced, margin: int = 0) -> tuple[list[int], C]:
    """The fewest packs whose program fits ``budget`` with ``margin`` bytes to spare (kept for
    allocations no shape predicts); raises ``BudgetTooSmallError`` naming the smallest budget that
    fits when none does."""
    tried: dict[tuple[int, ...], C] = {}
    for num_packs in range(1, len(layer_costs) + 1):
        boundaries = policy(layer_costs, num_packs)
        if tuple(boundaries) in tried:
            continue
        candidate = tried[tuple(boundaries)] = evaluate(boundaries)
        if budget is None or peak_of(candidate) + margin <= budget:
            return boundaries, candidate
    smallest = min(peak_of(candidate) for candidate in tried.values()) + margin
    raise BudgetTooSmallError(
        f"plan_packs: no packing fits the memory budget of {budget:,} bytes; the smallest budget that "
        f"fits is {smallest:,} bytes ({smallest / 2**20:.2f} MiB). Raise memory_budget to at least that, "
        "or use more microbatches so each task holds fewer activations.",
        smallest,
    )


def fixed(boundaries: Sequence[int]) -> PackingPolicy:
    """A packing policy that always answers ``boundaries``."""
    return lambda layer_costs, num_packs: list(boundaries)


def layer_costs(variant: Variant) -> list[int]:
    """Bytes of each layer: the state it reads plus the values it makes (what ``balanced`` evens out)."""
    costs = []
    for layer in variant.layers:
        nodes = [variant.nodes[name] for name in layer.nodes]
        state = {read for node in nodes for read in node.meta[meta.READS]}
        costs.append(sum(meta.nbytes_of(variant.nodes[s]) for s in state) + sum(meta.nbytes_of(n) for n in nodes))
    return costs


@dataclasses.dataclass(frozen=True)
class PackingContext:
    """What evaluating a packing needs, the same for every candidate of one compile."""

    variants: Mapping[int | None, Variant]
    layout: Layout
    signature: ProgramSignature
    shapes: Shapes
    targets: Sequence[torch.device]    # the device each program runs on
    updates: bool                      # the host updates each pack's parameters as soon as they are complete
    verify: bool
    budget: int | None = None          # the first device's budget, and the margin kept below it
    margin: int = 0


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One packing, lowered, verified and run on FakeTensors."""

    boundaries: tuple[int, ...]
    packs_by_size: Mapping[int | None, list[Pack]]
    device_actions: list[tuple[list[Action], list[Action]]]  # (forward, backward) per device
    estimates: list[DeviceEstimate]                          # per device
    signature: ProgramSignature                              # what the programs were lowered with

    @property
    def packs(self) -> list[Pack]:
        return next(iter(self.packs_by_size.values()))

    @property
    def peaks(self) -> list[int]:
        return [estimate.peak for estimate in self.estimates]

    @property
    def peak(self) -> int:
        return max(self.peaks)


def evaluate(context: PackingContext, boundaries: Sequence[int]) -> Candidate:
    """The packing at ``boundaries``, its backward fetching each stash one task ahead, or, where
    that does not fit the budget, just in time (one microbatch's stash less on the device)."""
    if context.budget is None:
        return _evaluate(context, boundaries, stash_ahead=True)
    # Just in time first: fetching ahead never needs less, so where this does not fit, neither
    # does that (one FakeTensor run per packing that does not fit, as plan_packs tries many), and
    # its peak is the smallest budget these packs need.
    just_in_time = _evaluate(context, boundaries, stash_ahead=False)
    if just_in_time.peak + context.margin > context.budget:
        return just_in_time
    ahead = _evaluate(context, boundaries, stash_ahead=True)
    return ahead if ahead.peak + context.margin <= context.budget else just_in_time


def _evaluate(context: PackingContext, boundaries: Sequence[int], stash_ahead: bool) -> Candidate:
    packs_by_size, device_actions, signature = _lower(context, boundaries, stash_ahead)
    layout = context.layout
    estimates = [estimate_device(forward, backward, mbs + tuple(f for f, _ in layout.device_forward_parts(device)),
                                 packs_by_size, context.shapes, signature, target)
                 for device, ((forward, backward), mbs, target)
                 in enumerate(zip(device_actions, layout.device_microbatches, context.targets))]
    return Candidate(tuple(boundaries), packs_by_size, device_actions, estimates, signature)


def _lower(context: PackingContext, boundaries: Sequence[int], stash_ahead: bool):
    """The packs at ``boundaries`` at every microbatch size, every device's programs (verified),
    and the signature they were lowered with."""
    layout = context.layout
    signature = dataclasses.replace(context.signature, stash_ahead=stash_ahead)
    packs_by_size = {size: split_packs(v.captured.gm, v.layers, boundaries, v.masters)
                     for size, v in context.variants.items()}
    packs = packs_by_size[layout.mb_sizes[0]]
    update_packs = frozenset(update_groups(packs, context.shapes.masters)) if context.updates else frozenset()
    signature = dataclasses.replace(signature, update_packs=update_packs)
    device_actions = lower_devices(packs, signature, layout, boundaries)
    if context.verify:
        verify_programs(device_actions, signature, layout)
    return packs_by_size, device_actions, signature


def reuse(context: PackingContext, donor: Candidate, donor_variants: Mapping[int | None, Variant],
          donor_sizes: Sequence[int | None]) -> Candidate | None:
    """``donor``'s packing (compiled for a larger call of the same model, state and microbatch
    count) at ``context``'s shapes without a FakeTensor run, where that run provably could not
    exceed the donor's: every value of every graph here (activations, and so their gradients and
    stash) is no larger than the same-named value of the donor's graph at the same microbatch, and
    the programs move the same keys in the same order, so every device holds at most what the
    donor's did at every action. The donor's measured peaks are then bounds of these. ``None``
    where a graph differs or a value is larger (the caller checks the packing in full)."""
    if len(donor_sizes) != len(context.layout.sizes):
        return None
    for size, donor_size in zip(context.layout.sizes, donor_sizes):
        if not _no_larger(context.variants[size], donor_variants[donor_size]):
            return None
    packs_by_size, device_actions, signature = _lower(context, donor.boundaries, donor.signature.stash_ahead)
    if [[list(map(str, program)) for program in pair] for pair in device_actions] != [
            [list(map(str, program)) for program in pair] for pair in donor.device_actions]:
        return None  # not the same programs over the same keys
    return Candidate(donor.boundaries, packs_by_size, device_actions, donor.estimates, signature)


def _no_larger(variant: Variant, donor: Variant) -> bool:
    """Every value of ``variant``'s graph no larger than the same-named one of ``donor``'s. A node
    only one graph has must be a view, which holds no memory of its own: export writes a slice over
    a whole dim as ``alias`` at one size and as ``slice`` at a smaller one."""
    nodes, donor_nodes = variant.nodes, donor.nodes
    for name in nodes.keys() ^ donor_nodes.keys():
        node = nodes.get(name) or donor_nodes[name]
        if not _is_view(node):
            return False
    return all(meta.nbytes_of(node) <= meta.nbytes_of(donor_nodes[name])
               for name, node in nodes.items() if name in donor_nodes)


def _is_view(node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def lower_devices(packs: Sequence[Pack], signature: ProgramSignature, layout: Layout,
                  boundaries: Sequence[int]) -> list[tuple[list[Action], list[Action]]]:
    """Every device's (forward, backward) program: the pipeline's, or one per device's share of
    the microbatches; with the layout's larger forward packs where they group these boundaries."""
    planned = layout.forward_groups
    groups = planned[1] if planned and tuple(boundaries) == planned[0] else ()
    if layout.parallel == "pp":
        return lower_pipeline(packs, dataclasses.replace(signature, forward_groups=groups, handoff=layout.handoff,
                                                         forward_parts=layout.device_forward_parts(0)),
                              len(layout.device_microbatches))
    return [lower_program(packs, dataclasses.replace(signature, microbatches=mbs, forward_groups=groups,
                                                     forward_parts=layout.device_forward_parts(device)))
            for device, mbs in enumerate(layout.device_microbatches)]


def verify_programs(device_actions: Sequence[tuple[Sequence[Action], Sequence[Action]]],
                    signature: ProgramSignature, layout: Layout) -> None:
    """The program verifier over every device's ``(forward, backward)`` actions; raises
    ``ProgramError`` naming the offending action and the pass that made it."""
    if layout.parallel == "pp":
        every = [a for pair in device_actions for actions in pair for a in actions]
        offloaded = [a.key for a in every if a.kind == ActionKind.OFFLOAD]
        offloaded += [key for a in every if a.kind == ActionKind.SPLIT for key in a.writes]
        signature = dataclasses.replace(signature, forward_parts=layout.device_forward_parts(0))
        for forward, backward in device_actions:
            _verify_device(list(forward), list(backward), signature, elsewhere=offloaded)
        verify_devices([list(forward) + list(backward) for forward, backward in device_actions])
        return
    for device, ((forward, backward), mbs) in enumerate(zip(device_actions, layout.device_microbatches)):
        _verify_device(list(forward), list(backward), dataclasses.replace(
            signature, microbatches=mbs, forward_parts=layout.device_forward_parts(device)))


def _verify_device(forward: list[Action], backward: list[Action], signature: ProgramSignature,
                   elsewhere: Sequence[Key] = ()) -> None:
    """``elsewhere``: host keys other devices' programs write (their waits are checked across
    devices by ``verify_devices``)."""
    mbs = signature.microbatches
    inputs_at = dict.fromkeys(mbs + signature.forward_microbatches)  # the forward's, when larger
    host_keys = [Key(KeyKind.ACT, v, mb) for v in signature.model_inputs for mb in inputs_at] + list(elsewhere)
    grad_keys = [Key(KeyKind.GRAD, v, mb) for v in signature.model_outputs for mb in mbs]
    if signature.fuse_last:
        host_keys += grad_keys
    forward_results = [a.key for a in forward if a.kind == ActionKind.OFFLOAD
                       and (a.key.kind != KeyKind.ACT or a.key.name in signature.model_outputs)]
    verify_program(forward, host_keys, forward_results, ends_iteration=not signature.fuse_last)
    # the backward program continues from the forward's state: check them as one
    backward_results = [a.key for a in backward if a.kind == ActionKind.OFFLOAD]
    verify_program(forward + backward, host_keys + grad_keys, backward_results)


def update_groups(packs: Sequence[Pack], masters: Mapping[str, torch.Tensor]) -> dict[int, list[nn.Parameter]]:
    """``{pack index: the parameters the host updates after that pack's backward}``: each
    trainable parameter goes with the lowest-index pack that uses it, the last to add to its
    gradient (backward runs packs in reverse)."""
    groups: dict[int, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for pack in packs:
        for name in pack.params:
            param = masters[name]
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                groups.setdefault(pack.index, []).append(param)
    return groups
