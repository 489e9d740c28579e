"""Decide the packs: which contiguous layer ranges run together, and what each candidate costs.

A packing policy maps ``(layer_costs, num_packs)`` to pack boundaries: the planner's boundaries
(``fixed``) or ``balanced``: the layers in ``num_packs`` contiguous chunks of about equal cost
(weights plus activations), cut at prefix-sum quantiles, as Harmony's ``balanced_addx``. The
candidates are the policy's packings for 1, 2, ... packs; ``plan_packs`` keeps the fewest packs
whose program fits the budget, without running every candidate:

1. **Bounds first.** A packing needs at least, for each pack, the pack's weights and its largest
   input (both on the device during its forward) and, in training, what its backward holds: what
   its recompute left for it (measured layer by layer: ``compiler.held``), its inputs, the gradients
   of its outputs, the previous pack's weights (fetched ahead) and what its last layer's backward
   adds, and what earlier microbatches leave beside a later one's backward (``PackingBounds``); a
   candidate whose bound passes the budget is never run, and where every candidate's does, the
   budget is refused with one run, the most packs', and a run of each of the few packings whose
   bound is below its peak (fewer packs can need less): the least peak is the smallest budget named
   (asked for, the search finds that packing possible, and it fits).
2. **A monotone search over the rest.** A packing's peak mostly falls as its packs get more: the
   fewest packs are tried, then the most (the least memory), then bisection between the two for
   the fewest that fit: a handful of runs, where trying every count ran a hundred for a deep
   model. Where even the most packs do not fit, memory need not be monotone (a pack that ends at
   a wide output holds it, one that goes on to reduce it need not), so every candidate the bounds
   leave is run before the budget is refused: a refusal the bounds do not prove costs a run per
   candidate, each cut short where it passes the budget.
3. **Runs that share their work.** Every candidate of one compile replays the compute tasks the
   ones before it ran (``compiler.replay``): a transformer's blocks run once, whatever the packing.

``evaluate`` is what a candidate costs, and changes nothing it is given: split the packs of every
microbatch size, lower every device's programs, verify them, and run each on FakeTensors for its
peak (``compiler.estimate``).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from typing import Callable, Mapping, Sequence, TypeVar

import torch
from torch import fx, nn

from harmony_fx.compiler.estimate import DeviceEstimate, estimate_device
from harmony_fx.compiler.held import LayerHeld, measure_held
from harmony_fx.compiler.layout import Layout
from harmony_fx.compiler.replay import TaskRecords
from harmony_fx.compiler.shapes import Shapes
from harmony_fx.compiler.variants import Variant
from harmony_fx.config import format_size
from harmony_fx.ir import meta
from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.pipeline import lower_pipeline
from harmony_fx.lowering.single import lower_program
from harmony_fx.lowering.tasks import ProgramSignature
from harmony_fx.passes.split_packs import split_packs
from harmony_fx.planner.layer_memory import last_readers
from harmony_fx.program.actions import Action, ActionKind, Key, KeyKind
from harmony_fx.program.verify import verify_devices, verify_program
from harmony_fx.runtime import ambient

__all__ = ["balanced", "fixed", "plan_packs", "PackingPolicy", "BudgetTooSmallError", "CountedWhenAsked", "Candidate",
           "PackingContext", "PackingBounds", "evaluate", "finish_chosen", "layer_costs", "lower_devices",
           "update_groups", "verify_programs"]

PackingPolicy = Callable[[Sequence[int], int], list[int]]
C = TypeVar("C")


class BudgetTooSmallError(ValueError):
    """No packing fits the budget. ``smallest_budget``: the smallest budget that fits, in bytes
    (what a tool that retries should ask for)."""

    def __init__(self, message: str, smallest_budget: int) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


class CountedWhenAsked(BudgetTooSmallError):
    """No packing fits, and the smallest budget that does is counted (one run of the packing of
    least memory) only when asked for: ``smallest_budget`` or ``counted()``, the error that names
    it (its message says it is not counted until then); ``at_least``, the bound of that packing's
    peak (never above it). A compile with another schedule still to try (one sample per
    microbatch) asks only where that fails too, and the bound passes what that one needs."""

    def __init__(self, budget: int, count: Callable[[], BudgetTooSmallError], at_least: int = 0) -> None:
        ValueError.__init__(self, f"plan_packs: no packing fits the memory budget of {budget:,} bytes (the smallest "
                                  "budget that fits is not counted yet)")
        self.at_least = at_least  # a lower bound of the smallest budget, from shapes alone (0: none)
        self._count: Callable[[], BudgetTooSmallError] | None = count
        self._counted: BudgetTooSmallError | None = None

    def counted(self) -> BudgetTooSmallError:
        if self._counted is None:
            self._counted, self._count = self._count(), None
        return self._counted

    smallest_budget = property(lambda self: self.counted().smallest_budget)

    def __str__(self) -> str:
        return super().__str__() if self._counted is None else str(self._counted)


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
               budget: int | None, policy: PackingPolicy = balanced, margin: int = 0, *,
               bound: Callable[[Sequence[int], int], int] | None = None, cut_short: bool = False,
               name_smallest: bool | str = True, progress: Callable[[str], None] | None = None) -> tuple[list[int], C]:
    """The fewest packs whose program fits ``budget`` with ``margin`` bytes to spare (kept for
    allocations no shape predicts), by the search of the module docstring; raises
    ``BudgetTooSmallError`` naming the smallest budget that fits when none does (where the packing
    run in full to name it fits after all, its bound having passed its peak, it is the plan: the
    named budget always compiles).
    ``bound(boundaries, limit)``: a lower bound of the packing's peak (never above what ``evaluate``
    finds), or any lower bound above ``limit`` where one is (``None``: the bound itself);
    ``cut_short``: the search calls ``evaluate(boundaries, limit)``, which may stop where the peak
    passes ``limit`` (then any peak above it does); ``name_smallest``: where none fits, run the packing of least
    memory in full to name the smallest budget (else the error says only that more is needed: a
    caller with another schedule to fall back on never shows it), or ``"when asked"``: run it when
    the error is asked for it (``CountedWhenAsked``); ``progress``: told each candidate run."""
    candidates = list(dict.fromkeys(tuple(policy(layer_costs, n)) for n in range(1, len(layer_costs) + 1)))
    tried: dict[tuple[int, ...], C] = {}

    def run(boundaries: tuple[int, ...], limit: int | None = None) -> C:
        if boundaries not in tried:
            if progress is not None:
                progress(f"candidate {len(tried) + 1}: {len(boundaries)} of at most {len(candidates[-1])} packs")
            tried[boundaries] = evaluate(list(boundaries)) if limit is None else evaluate(list(boundaries), limit)
        return tried[boundaries]

    if budget is None:
        return list(candidates[0]), run(candidates[0])
    limit = budget - margin if cut_short else None

    def fits(boundaries: tuple[int, ...]) -> bool:
        return peak_of(run(boundaries, limit)) + margin <= budget

    possible = candidates if bound is None else [c for c in candidates if bound(c, budget - margin) + margin <= budget]
    if possible and fits(possible[0]):
        return list(possible[0]), tried[possible[0]]
    if len(possible) > 1 and fits(possible[-1]):
        low, high = 0, len(possible) - 1  # possible[low] does not fit, possible[high] does
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(possible[middle]) else (middle, high)
        return list(possible[high]), tried[possible[high]]
    # The least memory does not fit, where memory falls with more packs; it does not always (a
    # pack that ends at a wide output holds it, one that goes on to reduce it need not): before
    # refusing, every candidate the bounds leave is run (cut short where it passes the budget)
    for boundaries in possible[1:-1]:
        if fits(boundaries):
            return list(boundaries), tried[boundaries]
    if not name_smallest:
        # each candidate's peak where it ran (at least it, where cut short), else its bound
        least = min(peak_of(tried[c]) if c in tried else bound(c, None) if bound is not None else budget - margin + 1
                    for c in candidates) + margin
        raise BudgetTooSmallError(f"plan_packs: no packing fits the memory budget of {budget:,} bytes; these "
                                  f"packings need at least {least:,} bytes", least)
    # nothing fits. The smallest budget named is the least peak of the most packs (run in full) and
    # of the few packings whose bound is below it (asked for again, the search finds that packing
    # possible, its bound below its peak, and runs it)
    def count_least() -> tuple[BudgetTooSmallError, tuple[int, ...]]:
        if progress is not None:
            progress(f"no candidate fits: the peak of {len(candidates[-1])} packs, in full")
        tried[candidates[-1]] = evaluate(list(candidates[-1]))
        least = candidates[-1]
        for at_least, boundaries in _rivals(candidates, bound, margin):
            limit = peak_of(tried[least]) - 1
            if at_least > limit + margin:
                break
            # cut short where it passes the least peak so far: only a packing needing less runs to its end
            if progress is not None:
                progress(f"the peak of {len(boundaries)} packs, its bound below it")
            result = evaluate(list(boundaries), limit) if cut_short else evaluate(list(boundaries))
            if peak_of(result) <= limit:
                tried[boundaries], least = result, boundaries
        smallest = peak_of(tried[least]) + margin
        return BudgetTooSmallError(
            f"plan_packs: no packing fits the memory budget of {budget:,} bytes; the smallest budget that "
            f"fits is {smallest:,} bytes ({format_size(smallest)}). Raise memory_budget to at least that, "
            "or use a smaller batch or shorter inputs (more microbatches hold fewer activations at a time, but keep "
            "more of what each leaves: they need less only where activations dominate).",
            smallest,
        ), least

    if name_smallest == "when asked":
        at_least = min(bound(c, None) for c in candidates) + margin if bound is not None else 0
        raise CountedWhenAsked(budget, lambda: count_least()[0], at_least)
    error, least = count_least()
    if error.smallest_budget <= budget:
        # its bound passed its peak after all (a value autograd frees sooner than counted): the
        # packing run in full to name the smallest budget fits. Refusing would name this budget again
        return list(least), tried[least]
    raise error


def _rivals(candidates: Sequence[tuple[int, ...]], bound, margin: int) -> list[tuple[int, tuple[int, ...]]]:
    """The packings of fewer packs than the last of ``candidates`` (the most) whose bound is below
    its bound, lowest first, each with its bound (the margin added): memory does not always fall
    with more packs (one pack per layer recomputes a wide layer alone, in a pack of its own, that
    fewer packs keep in the last, whose forward graph stays for its backward), and where the
    bounds say a packing may need less, it is run. A handful at most, as many as the search's
    bisection runs (a deep model's packings of nearly as many packs share the bound of the most);
    without a bound, none."""
    if bound is None:
        return []
    most = bound(candidates[-1], None)
    below = sorted((b, len(c), c) for c in candidates[:-1] if (b := bound(c, None)) < most)
    return [(b + margin, c) for b, _, c in below[:len(candidates).bit_length()]]


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
    # what the candidates' planning runs recorded, for the next ones to replay (``compiler.replay``)
    records: TaskRecords = dataclasses.field(default_factory=TaskRecords, compare=False)
    packs: dict = dataclasses.field(default_factory=dict, compare=False)  # size -> the packs built, by layers
    # per layer, what a recompute leaves for its pack's backward (``compiler.held``): measured once
    held: list = dataclasses.field(default_factory=list, compare=False)


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

    @property
    def complete(self) -> bool:
        """Every device's run went to the end (else its peak passed the limit it was run under)."""
        return all(estimate.complete for estimate in self.estimates)


def evaluate(context: PackingContext, boundaries: Sequence[int], limit: int | None = None,
             ahead_first: bool = False) -> Candidate:
    """The packing at ``boundaries`` as the search sees it: under a budget, its backward fetching
    each stash just in time, the least these packs need (fetching ahead never needs less, so the
    search asks only whether this fits, one FakeTensor run a candidate); without one, one task
    ahead. ``limit``: stop each device's run where it would hold more (its peak is then only known
    to pass it: ``Candidate.complete``). ``ahead_first``: under a budget, first the run fetching
    ahead, kept where it fits (then the just-in-time one fits too, and ``finish_chosen`` has nothing
    to run again): for the one packing a search of a single candidate tries. Its programs are
    verified once chosen (``finish_chosen``), or where running them fails: a ``ProgramError`` then
    says what the lowering got wrong."""
    if ahead_first and context.budget is not None and limit is not None:  # (without a limit: the least it needs)
        ahead = _evaluate(context, boundaries, stash_ahead=True, verify=False, cap=limit)
        if ahead.complete and ahead.peak <= limit:
            return ahead
    return _evaluate(context, boundaries, stash_ahead=context.budget is None, verify=False, cap=limit)


def finish_chosen(context: PackingContext, candidate: Candidate, ahead_tried: bool = False) -> Candidate:
    """The chosen packing as it will run: its backward fetching each stash one task ahead where
    that fits the budget too (else just in time: one microbatch's stash less on the device; the
    run fetching ahead is cut short at the budget), its programs verified. ``ahead_tried``: the
    search ran it first (``evaluate(ahead_first=True)``), so a just-in-time candidate is one where
    it did not fit."""
    if not candidate.signature.stash_ahead and not ahead_tried:
        ahead = _evaluate(context, candidate.boundaries, stash_ahead=True, verify=False,
                          cap=context.budget - context.margin)
        if ahead.complete and ahead.peak + context.margin <= context.budget:
            candidate = ahead
    if context.verify:
        verify_programs(candidate.device_actions, candidate.signature, context.layout)
    return candidate


def _receiving_gradients(gm: fx.GraphModule, signature: ProgramSignature) -> set[str]:
    """The values the backward makes a gradient for: differentiable, and a model output (the
    caller's gradient) or read by a value that receives one and is differentiable (not by a
    ``detach`` alone, whose result no gradient reaches). A layer none of whose values receives one
    runs no backward and gives its weights no gradient."""
    reached: set[str] = set()
    for node in reversed(gm.graph.nodes):
        if node.name in signature.differentiable and (
                node.name in signature.model_outputs or any(user.name in reached for user in node.users)):
            reached.add(node.name)
    return reached


def _gradient_bytes(node: fx.Node, shapes: Shapes, reached: set[str]) -> int:
    """Bytes of the gradient the backward makes for ``node``'s value on the first microbatch; of a
    tuple taken apart by ``getitem`` (an LSTM's output and state), only the parts a gradient reaches
    (an unused ``h_n`` gets none)."""
    users = list(node.users)
    if isinstance(node.meta.get(meta.VAL), (tuple, list)) and users and all(u.target is operator.getitem for u in users):
        parts = {user.args[1]: user.name for user in users if user.name in reached}
        return sum(shapes.key_bytes(Key(KeyKind.GRAD, name, 0), ()) for name in parts.values())
    return shapes.key_bytes(Key(KeyKind.GRAD, node.name, 0), ())


class PackingBounds:
    """A lower bound of a packing's peak from shapes alone: the largest, over its packs, of the
    pack's weights and the larger of its largest input (its forward and its recompute hold it with
    the weights: distinct storages, at every microbatch size) and, in training, the gradients of
    the weights its backward differentiates (complete at the end of its backward, the weights still
    there). In training, also what the device holds in the pack's backward of the first
    microbatch: the weights, its inputs (one program: each fetched into a copy of its own, else the
    largest), the previous pack's weights where one program fetches them ahead, and the gradients
    of its differentiable outputs (each in a storage of its own: every later reader's backward made
    it, or the caller) with,
    as it begins, what its recompute left for it (its outputs and what autograd saved), or, while
    its last layer's backward runs, what of that it keeps and the most that backward adds
    (``compiler.held``, measured layer by layer on the first microbatch's graph the first time a
    bound is asked for, once per compile). With more microbatches of the first's size: a last pack
    not fused with the loss holds each one's forward graph (its largest input and what it left) as
    its first backward begins; in one program, the gradients the later packs gave its outputs for
    the microbatches still to come wait beside each of its backwards, and a pack's second backward
    runs beside the first's weight gradients and the gradients the first gave its inputs, adding
    what its last layer's backward adds where the weight gradients exist (``compiler.held``'s
    ``accumulating``). Not under autocast, whose casts
    the captured graph does not show. ``bounds(boundaries)`` never passes what ``evaluate`` finds."""

    def __init__(self, context: PackingContext) -> None:
        variant = context.variants[context.layout.mb_sizes[0]]
        self._context = context
        self._passed_at = 0  # the first layer of the pack whose bound last passed a limit
        # each pack's bound, by (start, end, previous): a search's candidates share most of their
        # packs (of 113 packings of a 114-layer model, 13,000 packs, 660 distinct)
        self._packs: dict[tuple[int, int, int | None], int] = {}
        shapes, masters = context.shapes, variant.masters
        nodes = variant.nodes
        self._read_after = last_readers(variant.captured.gm, variant.layers)
        defined_in = {name: layer.index for layer in variant.layers for name in layer.nodes}
        self._weights: list[dict[int, int]] = []  # per layer: id of each master it reads -> its bytes
        self._grads: list[dict[int, int]] = []    # the same, of those its backward gives a gradient
        self._inputs: list[list[tuple[int, int]]] = []  # per layer: (defining layer, bytes) of what it takes in
        self._first_inputs: list[list[tuple[int, int]]] = []
        self._input_grads: list[dict[str, tuple[int, int]]] = []  # per layer: of its inputs a layer made
        sizes = range(len(context.layout.sizes))
        reached = _receiving_gradients(variant.captured.gm, context.signature)
        self._backward_runs = [any(name in reached for name in layer.nodes) for layer in variant.layers]
        for layer in variant.layers:
            names = set(layer.nodes)
            reads = {read for name in layer.nodes for read in nodes[name].meta[meta.READS]}
            self._weights.append({id(masters[read]): shapes.staged_bytes(read) for read in reads if read in masters})
            differentiated = set() if context.signature.forward_only else {
                read for name in layer.nodes if name in reached
                for read in nodes[name].meta[meta.READS]
                if read in masters and masters[read].requires_grad}
            self._grads.append({id(masters[read]): self._weights[-1][id(masters[read])] for read in differentiated})
            # values only: not state, nor a higher-order op's subgraph (``get_attr``, no value)
            taken = {arg.name for name in layer.nodes for arg in nodes[name].all_input_nodes
                     if arg.name not in names and meta.role_of(arg) not in (meta.Role.PARAM, meta.Role.BUFFER)
                     and meta.VAL in arg.meta}
            self._inputs.append([(defined_in.get(name, -1),
                                  max(shapes.key_bytes(Key(KeyKind.ACT, name, mb), ()) for mb in sizes))
                                 for name in sorted(taken)])
            self._first_inputs.append({name: (defined_in.get(name, -1), shapes.key_bytes(Key(KeyKind.ACT, name, 0), ()))
                                       for name in sorted(taken)})  # on the first microbatch
            self._input_grads.append({name: (defined_in[name], shapes.key_bytes(Key(KeyKind.GRAD, name, 0), ()))
                                      for name in sorted(taken)
                                      if name in defined_in and name in context.signature.differentiable})
        signature = context.signature
        self._at_backward = not signature.forward_only and not ambient.Autocast.current().enabled
        # a later microbatch's weight gradients are added into ``.grad`` by autograd as it makes
        # them (``runtime.executor``), unless computed in another dtype than the masters' gradients
        self._summed_by_autograd = context.shapes.compute_dtype is None
        # One device's program (``lowering.single``) with grouping: a pack before the last fetches
        # each of its stashed inputs into a copy of its own for its recompute, whose graph keeps them
        # all through the backward; and the backward of pack p fetches W[p-1] before its first task.
        # A pipeline's packs run on several devices, and the last pack's inputs may share storage
        # (views of one output kept from the forward): there the largest input only.
        self._one_program = context.layout.parallel != "pp" and signature.grouping
        # ... but for a last pack fused into the forward (its backward runs there, W[p-1] unasked for)
        self._last_fused_in_forward = signature.fuse_last and not signature.last_in_backward
        # In one program, while a pack's second microbatch runs its backward, the first's weight
        # gradients stay on the device (later microbatches add into them), and so do the gradients
        # it gave its inputs, until the pack before runs its backward: counted where the second
        # microbatch is of the first's size (the inputs and the recompute's leftovers measured on it)
        first_device, sizes = context.layout.device_microbatches[0], context.layout.mb_sizes
        # the first device's microbatches after the first of the first's size: what is measured on
        # the first holds for them
        self._alike = sum(1 for mb in first_device[1:] if sizes[mb] == sizes[first_device[0]])
        self._second_microbatch = self._one_program and self._alike > 0
        # A last pack not fused with the loss runs its forward with grad on every microbatch and
        # keeps each graph (its inputs and what its forward left) until its backward
        self._keeps_last_graphs = context.layout.parallel != "pp" and not signature.fuse_last
        # per layer: (its last reader, bytes of its gradient on the first microbatch) of each
        # differentiable value it makes: a pack ending before that reader holds the gradient
        self._output_grads = [[(self._read_after.get(name, -1), _gradient_bytes(nodes[name], shapes, reached))
                               for name in layer.nodes if name in reached]
                              for layer in variant.layers] if self._at_backward else []

    def __call__(self, boundaries: Sequence[int], limit: int | None = None) -> int:
        """The bound; given ``limit``, the first pack's bound found above it, if any. The pack holding
        the layer where a bound last passed its limit goes first: the search's candidates, packings of
        the same layers, mostly pass it at the same place, so a refusal costs one pack a candidate."""
        ends = [*boundaries[1:], len(self._weights)]
        packs = list(zip(boundaries, ends, [None, *boundaries]))
        if limit is not None:
            packs.insert(0, packs.pop(bisect.bisect_right(boundaries, self._passed_at) - 1))
        bound = 0
        for pack in packs:
            if pack not in self._packs:
                self._packs[pack] = self._pack(*pack)
            bound = max(bound, self._packs[pack])
            if limit is not None and bound > limit:
                self._passed_at = pack[0]
                break
        return bound

    def _pack(self, start: int, end: int, previous: int | None = None) -> int:
        """``previous``: the first layer of the pack before (``None``: this is the first)."""
        weights: dict[int, int] = {}
        grads: dict[int, int] = {}
        for layer in range(start, end):
            weights.update(self._weights[layer])
            grads.update(self._grads[layer])
        largest = max((nbytes for layer in range(start, end) for defined, nbytes in self._inputs[layer]
                       if defined < start), default=0)
        bound = sum(weights.values()) + max(largest, sum(grads.values()))
        if self._at_backward:
            held = self._held()
            # the gradients of its outputs, and its inputs (the graph keeps them)
            handed = sum(weights.values()) + sum(nbytes for layer in range(start, end)
                                                 for reader, nbytes in self._output_grads[layer] if reader >= end)
            inputs = {name: nbytes for layer in range(start, end)
                      for name, (defined, nbytes) in self._first_inputs[layer].items() if defined < start}
            last = end == len(self._weights)
            handed += sum(inputs.values()) if self._one_program and not last else max(inputs.values(), default=0)
            if previous is not None and self._one_program and not (last and self._last_fused_in_forward):
                # W[p-1], less the weights both packs read
                fetched = {key: nbytes for layer in range(previous, start) for key, nbytes in self._weights[layer].items()}
                handed += sum(nbytes for key, nbytes in fetched.items() if key not in weights)
            begins = sum(held[layer].begins.held_until(end) for layer in range(start, end))
            kept = sum(held[layer].during.held_until(end) for layer in range(start, end))
            runs = self._backward_runs[end - 1]  # the last layer's backward, where a gradient reaches it
            during = kept + (held[end - 1].backward if runs else 0)
            graph = 0  # another microbatch's graph, which a last pack not fused with the loss keeps:
            if last and self._keeps_last_graphs:  # its largest input a layer made (a model input unsplit
                # along the batch might be one tensor for all) and what its forward left
                graph = begins + max((nbytes for layer in range(start, end)
                                      for defined, nbytes in self._first_inputs[layer].values()
                                      if 0 <= defined < start), default=0)
            # In one program, the packs after this one ran every microbatch's backward before it:
            # the gradients they gave its outputs wait here for its later microbatches
            waiting = sum(nbytes for layer in range(start, end) for reader, nbytes in self._output_grads[layer]
                          if end <= reader < len(self._weights)) if self._one_program else 0
            bound = max(bound, handed + self._alike * (graph + waiting) + max(begins, during))
            if self._second_microbatch:
                # as its backward begins, and while its last layer's backward runs: what it adds
                # where the weight gradients exist (autograd adds the new ones into them in place:
                # ``accumulating``; summed in another dtype, the runtime holds them all, as the
                # first does). Each input's gradient is a storage of its own (the runtime copies
                # one autograd hands to two inputs, as an ``add``'s backward does)
                input_grads = sum({name: nbytes for layer in range(start, end)
                                   for name, (defined, nbytes) in self._input_grads[layer].items()
                                   if defined < start}.values())
                adds = 0 if not runs else held[end - 1].accumulating if self._summed_by_autograd else \
                    held[end - 1].backward
                bound = max(bound, handed + (self._alike - 1) * (graph + waiting) + sum(grads.values()) + input_grads
                            + max(begins, kept + adds))
        return bound

    def _held(self) -> list[LayerHeld]:
        context = self._context
        if not context.held:
            variant = context.variants[context.layout.mb_sizes[0]]
            if len({target.type for target in context.targets}) == 1:
                context.held.extend(measure_held(variant.captured.gm, variant.layers, self._read_after,
                                                 context.targets[0]))
            else:  # the devices' kernels may keep different tensors: nothing is counted
                context.held.extend(LayerHeld() for _ in variant.layers)
        return context.held


def _evaluate(context: PackingContext, boundaries: Sequence[int], stash_ahead: bool, verify: bool,
              cap: int | None = None) -> Candidate:
    packs_by_size, device_actions, signature = _lower(context, boundaries, stash_ahead, verify)
    layout = context.layout
    try:
        estimates = [estimate_device(forward, backward,
                                     mbs + tuple(f for f, _ in layout.device_forward_parts(device)), packs_by_size,
                                     context.shapes, signature, target, context.records, cap)
                     for device, ((forward, backward), mbs, target)
                     in enumerate(zip(device_actions, layout.device_microbatches, context.targets))]
    except Exception:
        if not verify:  # programs the search did not verify: where they are wrong, say so
            verify_programs(device_actions, signature, layout)
        raise
    return Candidate(tuple(boundaries), packs_by_size, device_actions, estimates, signature)


def _lower(context: PackingContext, boundaries: Sequence[int], stash_ahead: bool, verify: bool):
    """The packs at ``boundaries`` at every microbatch size (built once per layer range in a
    compile), every device's programs (``verify``: verified), and the signature they were lowered
    with."""
    layout = context.layout
    signature = dataclasses.replace(context.signature, stash_ahead=stash_ahead)
    packs_by_size = {size: split_packs(v.captured.gm, v.layers, boundaries, v.masters, context.packs.setdefault(size, {}))
                     for size, v in context.variants.items()}
    packs = packs_by_size[layout.mb_sizes[0]]
    update_packs = frozenset(update_groups(packs, context.shapes.masters)) if context.updates else frozenset()
    signature = dataclasses.replace(signature, update_packs=update_packs)
    device_actions = lower_devices(packs, signature, layout, boundaries)
    if verify:
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
    packs_by_size, device_actions, signature = _lower(context, donor.boundaries, donor.signature.stash_ahead,
                                                      context.verify)
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
                                                     forward_parts=layout.device_forward_parts(device),
                                                     writes_buffers=device == 0))
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
