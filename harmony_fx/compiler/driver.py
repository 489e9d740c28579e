"""``compile_program``: the compile pipeline, a list of named stages, each timed and logged.

1. ``resolve devices``: the devices and their budgets.
2. ``capture whole batch``, ``analyze batch``, ``choose schedule``: where the options leave the
   microbatches or the parallelism open, the planner chooses (``planner.choose``), on the whole
   batch's graph, cutting the batch only where ``analysis.batch_dims`` proves it safe.
3. ``lay out``: microbatches, their sizes and the devices that run them (``compiler.layout``).
4. ``capture microbatches``: the graph at every microbatch size (``compiler.variants``); where
   the batch is cut, the whole batch's graph too (a cut by hand is analysed on it: a microbatch's
   graph has its own sizes baked in; where a number scales the loss, its value there weighs the
   microbatches exactly), ``compare with the whole batch`` (each microbatch computes what the batch
   does on its samples, each value shaped as the batch's but along its batch dim:
   ``variants.check_computes_alike``; a difference refuses the planner's cut and is said of one by
   hand, whose outputs must still join) and, for the planner's cut, ``weigh the loss`` (its
   microbatch weights on the example).
5. ``signature``: inputs, outputs, what is differentiable (``compiler.signature``).
6. ``plan packs``: the fewest packs that fit (``compiler.packing.plan_packs``: bounds first, then a
   monotone search), each candidate evaluated apart (split, lower, FakeTensor peak replaying the
   tasks met before: ``compiler.packing.evaluate``), changing nothing it is given; the chosen one
   verified. Where the planner's packs do not fit after all, the packs are searched again for its
   microbatches (policy "balanced at the planner's microbatches"): they are captured already.
7. ``fall back``: if a stage from 3 on raises for the planner's schedule (its packing does not
   fit after all, a microbatch size captures another graph, ...), stages 3-9 again with its next
   schedule, and last with the options' own settings; if those fail too, their error says what
   was tried before. Where the planner was free to cut the batch and the options' own do not fit,
   one sample per microbatch is tried last, and a refusal names the smaller of the two smallest
   budgets (``count the smallest budget``: the options' own is counted only then).
   Where the options' own microbatches cut the batch into sizes whose graphs differ (an epoch's
   last, smaller batch), microbatches all of one size are tried.
8. ``annotate packs``: the chosen packing written on the graphs, liveness, ``verify_packs``.
9. ``check peak``; for a Trainer with ``host_memory``/``nvme_path``, ``plan host memory`` (what a
   step holds there, and which packs' optimizer state goes to the NVMe tier:
   ``compiler.host_memory``) and ``insert tier io`` (their ``READ``/``WRITE``:
   ``lowering.tier_io``); ``codegen``, ``plan``.

The result is a frozen ``Compiled``; ``hm.passes`` is its ``StageLog``. A compile that runs past two
seconds says on stderr which stage it is in, and which candidate packing it runs
(``StageLog.report``).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch
from torch import fx, nn

from harmony_fx.analysis.batch_dims import BatchAnalysis, analyze_batch_dims
from harmony_fx.analysis.buffer_writes import first_buffer_write
from harmony_fx.analysis.liveness import annotate_liveness
from harmony_fx.analysis.random_ops import draws_random
from harmony_fx.compiler.compiled import Compiled
from harmony_fx.compiler.heap import collections_skip_the_heap
from harmony_fx.compiler.host_memory import HostMemoryPlan, OptimizerFacts, plan_host_memory
from harmony_fx.compiler.layout import Layout, decide_layout
from harmony_fx.compiler.packing import (
    BudgetTooSmallError, Candidate, CountedWhenAsked, PackingBounds, PackingContext, balanced, evaluate, finish_chosen,
    fixed, layer_costs, plan_packs, reuse as reuse_packing, update_groups, verify_programs,
)
from harmony_fx.compiler.plan import make_plan
from harmony_fx.compiler.shapes import Shapes
from harmony_fx.compiler.signature import program_signature
from harmony_fx.compiler.stages import StageLog, progress_to_stderr
from harmony_fx.compiler.capture_cache import cached_capture
from harmony_fx.compiler.variants import (
    ComputesOtherwise, GraphsDiffer, Variant, check_computes_alike, check_outputs_alike, check_same_layers,
)
from harmony_fx.config import CompileOptions, format_size
from harmony_fx.frontend import microbatch
from harmony_fx.frontend.backward_hooks import without_a_backward
from harmony_fx.frontend.capture import CaptureError, raised_when_run, register_containers
from harmony_fx.ir import meta
from harmony_fx.lowering.tier_io import insert_tier_io
from harmony_fx.passes.split_packs import annotate_packs
from harmony_fx.planner.chain import Schedule
from harmony_fx.planner.choose import choose_schedules, cutting_changes_results
from harmony_fx.program.actions import Action, ActionKind, KeyKind
from harmony_fx.program.codegen import generate_program
from harmony_fx.program.verify import check_peak, verify_packs
from harmony_fx.runtime.devices import CudaDevice, HostDevice, resolve_devices
from harmony_fx.user_frames import user_stacklevel

__all__ = ["compile_program", "refuse_meta_state"]


@dataclasses.dataclass(frozen=True)
class _Example:
    """The example call and what is known of it before capturing."""

    model: nn.Module
    args: tuple
    kwargs: dict
    dims: tuple[tuple, dict]            # each input replaced by its batch dim
    flat_dims: tuple[int | None, ...]   # the batch dim of each tensor input, in flattening order

    @property
    def call(self) -> tuple[tuple, dict]:
        return self.args, self.kwargs

    def batch_size(self) -> int:
        return microbatch.batch_size(self.call, self.dims, self.model)


def compile_program(model: nn.Module, args: tuple, kwargs: dict, options: CompileOptions, *,
                    trainer: bool = False, updates: bool = False, optimizer: OptimizerFacts | None = None,
                    forward_only: bool = False, reuse: Compiled | None = None) -> Compiled:
    """Compile ``model`` for its example call ``model(*args, **kwargs)``; see the module docstring.
    ``trainer``: the model's output is its loss (``harmony_fx.Trainer``); ``updates``: the host
    updates each pack's parameters as soon as their gradients are complete; ``optimizer``: what the
    Trainer's optimizer keeps, for ``host_memory`` and the NVMe tier; ``forward_only``: calls under
    ``no_grad``, with no backward after them; ``reuse``: the compile of a larger call of the same
    model and state, whose packing this one takes (``options`` then fix its decisions:
    ``Compiled.decisions``) without a FakeTensor run where its peak provably bounds this one's."""
    # with no backward after the calls (forward_only), a hook the forward registers on a tensor is moot
    with collections_skip_the_heap(), without_a_backward(forward_only):
        return _compile_program(model, args, kwargs, options, trainer=trainer, updates=updates, optimizer=optimizer,
                                forward_only=forward_only, reuse=reuse)


def _compile_program(model: nn.Module, args: tuple, kwargs: dict, options: CompileOptions, *, trainer: bool,
                     updates: bool, optimizer: OptimizerFacts | None, forward_only: bool,
                     reuse: Compiled | None) -> Compiled:
    if (options.nvme_path is not None or options.host_memory is not None) and optimizer is None:
        raise ValueError("nvme_path= and host_memory= are options of harmony_fx.Trainer: the tier holds the "
                         "optimizer's state, which only the Trainer steps (harmony_fx.compile leaves the "
                         "optimizer to you)")
    log = StageLog(progress=progress_to_stderr, announced=_SLOW_STAGES)
    devices = log.run("resolve devices", resolve_devices, options.devices, options.memory_budget,
                      options.tracks_memory, options.chaos, decision=_describe_devices)
    resident = _weights_resident(model, devices, options)
    if resident:
        if trainer or updates or optimizer is not None:
            _refuse_resident_in_trainer()
        _reserve_resident_gradients(model, devices[0], options)
    register_containers((args, kwargs))  # a batch object's tensors: inputs to capture and cut, not a leaf
    microbatch.refuse_inputs_not_taken_apart(model, args, kwargs)
    dims = microbatch.argument_dims(model, args, kwargs, options.batch_dims)
    flat_dims = tuple(d for x, d in zip(microbatch.pytree.tree_leaves((args, kwargs)), microbatch.pytree.tree_leaves(dims))
                      if isinstance(x, torch.Tensor))
    example = _Example(model, args, kwargs, dims, flat_dims)
    by_hand = options.microbatches is not None  # the caller's cut: warned where unsure, not refused
    whole = analysis = least = None
    schedules: tuple[Schedule, ...] = ()
    if options.pack_boundaries is None and (
            options.microbatches is None or (options.parallel == "auto" and len(devices) > 1)):
        batch = _batch_or_none(example)
        if batch is not None and batch >= 1:
            whole = log.run("capture whole batch", cached_capture, model, None, args, kwargs,
                            devices[0].torch_device, options.compute_dtype, decision=_describe_variant)
            analysis = log.run("analyze batch", _analyze_batch, whole, batch, flat_dims, decision=_describe_batch)
            if options.microbatches is None and options.parallel == "dp" and len(devices) > 1 \
                    and not analysis.separable:
                raise ValueError(
                    f"parallel='dp' gives each device its own part of the batch, but harmony_fx cannot show that "
                    f"the parts compute what the whole batch does: {analysis.reason.rstrip('.')}. Use "
                    "parallel='pp' or 'auto' (the devices take turns on the whole batch), or set microbatches to "
                    "cut it anyway (BatchNorm then normalises each microbatch apart, as DDP does each device's "
                    "share; said at compile).")
            if options.microbatches is None and options.parallel != "dp" and (
                    not analysis.separable or first_buffer_write(whole.captured.gm, statistics=False) is not None):
                # samples computed together (a softmax over the batch, BatchNorm in training), or a
                # buffer the forward updates (spectral_norm, a step counter; not BatchNorm's statistics,
                # per device as in DDP) updated once per microbatch or by each device in turn: one
                # microbatch, and several devices form a pipeline, whatever the planner's search finds
                options = dataclasses.replace(options, microbatches=1,
                                              parallel="pp" if len(devices) > 1 else options.parallel)
            schedules = log.run("choose schedule", choose_schedules, whole.captured.gm, model, batch, devices,
                                devices[0].budget, options, analysis.separable, trainer, decision=_describe_schedules)
            least = _least_memory_options(options, analysis, whole, model, batch, len(devices))

    def stages(schedule: Schedule | None, options: CompileOptions = options, why: str = "",
               name_smallest: bool | str = True) -> Compiled:
        return _from_layout(log, example, devices, options, trainer, updates, optimizer, whole, analysis, schedule,
                            forward_only=forward_only, reuse=reuse, resident=resident, why=why,
                            name_smallest=name_smallest, by_hand=by_hand)

    try:
        return _first_that_compiles(log, stages, schedules, options, len(devices), least, devices[0].budget)
    except BudgetTooSmallError as refused:
        if options.pack_boundaries is not None and options.microbatches is None:
            refused.add_note("harmony_fx: with pack_boundaries fixed the planner chooses nothing, microbatches "
                             "included (one per device): pass microbatches=N to cut the batch into fewer activations "
                             "at a time, or leave pack_boundaries out for the planner to choose both.")
        raise


# the stages a compile past two seconds says it starts (the others take milliseconds)
_SLOW_STAGES = frozenset({"capture whole batch", "choose schedule", "capture microbatches", "reuse packs", "plan packs",
                          "count the smallest budget", "plan host memory"})


def _first_that_compiles(log: StageLog, stages, schedules: tuple[Schedule, ...], options: CompileOptions,
                         num_devices: int, least: CompileOptions | None = None, budget: int | None = None) -> Compiled:
    """``stages(schedule)`` for the planner's schedules in turn, then the options' own (``None``):
    the planner chose on the whole batch's graph and its own cost model, and a choice can still
    fail here (a microbatch size captures another graph, the packing does not fit after all), which
    is no reason to fail a model the next choice compiles. Each try is in the log; if the options'
    own fail too, their error is raised (its type kept: callers catch ``BudgetTooSmallError``),
    saying what was tried before and why each failed. Where the options' own do not fit and
    ``least`` is given (``_least_memory_options``), those are tried last, and a refusal names the
    smaller of the two smallest budgets."""
    tried: list[tuple[str, Exception]] = []
    candidates = [*schedules, None]
    for index, schedule in enumerate(candidates):
        try:
            # the options' own smallest budget is counted only if one sample per microbatch fails too
            own_named = True if least is None else "when asked"
            return stages(schedule) if schedule is not None else stages(None, name_smallest=own_named)
        except Exception as error:  # noqa: BLE001 - any failure of a planner's choice: try the next
            if schedule is None:
                if isinstance(error, GraphsDiffer) and (one_size := _of_one_size(options, error)) is not None:
                    return _with_one_size(log, stages, one_size, error, options, num_devices)
                if least is not None and isinstance(error, BudgetTooSmallError):
                    return _with_least_memory(log, stages, least, error, tried, options, num_devices, budget)
                if (pipeline := _whole_batch_pipeline(options, num_devices, error)) is not None:
                    return _as_a_pipeline(log, stages, pipeline, error, tried,
                                          _describe_try(None, options, num_devices))
                if not tried:
                    raise
                replacement = _say_what_was_tried(error, tried)
                if replacement is error:
                    raise
                raise replacement from error
            what = _describe_try(schedule, options, num_devices)
            tried.append((what, error))
            following = _describe_try(candidates[index + 1], options, num_devices)
            said = f"{what} raised {type(error).__name__}; trying {following}"
            log.run("fall back", lambda: None, decision=lambda _: said)
    raise AssertionError("unreachable: the options' own settings are the last candidate")


def _least_memory_options(options: CompileOptions, analysis: BatchAnalysis, whole: Variant, model: nn.Module,
                          batch: int, num_devices: int) -> CompileOptions | None:
    """The options with one sample per microbatch (the fewest activations at a time), where the
    planner was free to choose the microbatches and cutting changes no result (the samples are
    apart, nothing random is drawn, no BatchNorm in training); ``None`` where the options' own (one
    microbatch per device) are already all the planner may choose."""
    if (options.microbatches is not None or options.forward_microbatches is not None or not analysis.separable
            or batch <= num_devices or cutting_changes_results(whole.captured.gm, model)):
        return None
    return dataclasses.replace(options, microbatches=batch)


def _with_least_memory(log: StageLog, stages, least: CompileOptions, refusal: BudgetTooSmallError,
                       tried: list[tuple[str, Exception]], options: CompileOptions, num_devices: int,
                       budget: int) -> Compiled:
    """The options' own do not fit (``refusal``): ``least``'s compile, or a refusal naming the
    smaller of the two smallest budgets. A sample per microbatch holds the fewest activations at a
    time, but each microbatch adds what the device keeps of it (a model whose weights outweigh
    its activations fits one microbatch in less): neither alone is the smallest budget the
    planner's microbatches allow, and naming the one microbatch's alone sent users of a model
    whose activations dominate to a device four times larger than it needs (a 59-block GPT-2).
    Where ``least`` fails otherwise (a sample alone captures another graph), ``refusal``."""
    own = _describe_try(None, options, num_devices)
    what = f"one sample per microbatch ({least.microbatches} microbatches)"
    batch = "one microbatch" if num_devices == 1 else f"one microbatch per device ({num_devices})"
    log.run("fall back", lambda: None, decision=lambda _: f"{own} do not fit; trying {what}")
    try:
        return stages(None, least, f", {what}: {batch} does not fit")
    except BudgetTooSmallError as error:
        each = error.smallest_budget
        at_least = refusal.at_least if isinstance(refusal, CountedWhenAsked) else 0
        if at_least >= each:  # the options' own bound already passes it: no need to count them
            smallest, which, other = each, what, f"{batch} needs at least {format_size(at_least)}"
        else:
            refusal = log.run("count the smallest budget", _counted, refusal,
                              decision=lambda counted: f"{batch} needs {format_size(counted.smallest_budget)}")
            whole = refusal.smallest_budget
            if (own := _own_where_it_fits(stages, whole, budget)) is not None:
                return own
            smallest = min(each, whole)
            which, other = (what, f"{batch} needs {format_size(whole)}") if each < whole else \
                (batch, f"{what} needs {format_size(each)}")
        message = (f"plan_packs: no packing fits the memory budget of {budget:,} bytes; the smallest budget that fits "
                   f"is {smallest:,} bytes ({format_size(smallest)}), with {which} ({other}). Raise memory_budget "
                   "to at least that, or use a smaller batch or shorter inputs.")
        replacement = BudgetTooSmallError(message, smallest)
        # it names both counts: the sample-per-microbatch refusal chained under it would only repeat one
        raise (_say_what_was_tried(replacement, tried) if tried else replacement) from None
    except Exception as error:  # noqa: BLE001 - the options' own refusal stands, saying what was tried
        refusal = _counted(refusal)
        if (own := _own_where_it_fits(stages, refusal.smallest_budget, budget)) is not None:
            return own
        replacement = _say_what_was_tried(refusal, [*tried, (what, error)])
        if replacement is refusal:
            raise refusal from error
        raise replacement from error


def _of_one_size(options: CompileOptions, error: GraphsDiffer) -> CompileOptions | None:
    """The options with microbatches all of one size, where theirs cut the batch into sizes whose
    graphs differ (the last, smaller batch of an epoch: 3 samples in 2 microbatches of 2 and 1, the
    graph of one sample not the graph of two): the largest size that divides the batch and is no
    larger than theirs, so that no microbatch holds more than they planned for."""
    if error.forward or not isinstance(options.microbatches, int):
        return None
    sizes = [size for size in error.sizes if size]
    batch = sum(sizes)
    size = max(d for d in range(1, max(sizes) + 1) if batch % d == 0)
    count, forward = batch // size, options.forward_microbatches
    if count == options.microbatches:
        return None
    # larger forward microbatches only where they still group the new count whole (else one size for both)
    grouped = forward is not None and count % forward == 0 and count > forward
    return dataclasses.replace(options, microbatches=count, forward_microbatches=forward if grouped else None)


def _with_one_size(log: StageLog, stages, one_size: CompileOptions, error: GraphsDiffer, options: CompileOptions,
                   num_devices: int) -> Compiled:
    """``one_size``'s compile, the plan saying why; where that fails too, ``error`` stands, saying so."""
    batch = sum(size for size in error.sizes if size)
    what = f"{one_size.microbatches} microbatches of {batch // one_size.microbatches}"
    if options.forward_microbatches is not None and one_size.forward_microbatches is None:
        what += f" (the forward's too: {options.forward_microbatches} forward microbatches cannot group them)"
    cut = ", ".join(map(str, sorted({s for s in error.sizes if s}, reverse=True)))
    why = f"microbatches={options.microbatches} cuts the batch of {batch} into sizes {cut}, whose graphs differ"
    log.run("fall back", lambda: None, decision=lambda _: f"{why}; trying {what}")
    try:
        return stages(None, one_size, f", {what}: {why}")
    except Exception as failure:  # noqa: BLE001 - the first error stands, saying what was tried
        replacement = _say_what_was_tried(error, [(what, failure)])
        if replacement is error:
            raise error from failure
        raise replacement from failure


# what a failed cut of the batch raises: a microbatch's graph cannot be captured, or computes otherwise
_CUT_FAILURES = (CaptureError, GraphsDiffer, ComputesOtherwise)


def _whole_batch_pipeline(options: CompileOptions, num_devices: int, error: Exception) -> CompileOptions | None:
    """The options as a pipeline on the whole batch (``parallel="pp"``, one microbatch), where
    ``parallel="auto"`` over several devices left the microbatches to the planner and every cut of
    the batch failed (``error``): the devices take turns on it, as they do on a batch the analysis
    keeps whole; one device already runs it whole as its own settings. ``None`` elsewhere."""
    if (options.parallel != "auto" or num_devices < 2 or options.microbatches is not None
            or options.forward_microbatches is not None or not isinstance(error, _CUT_FAILURES)):
        return None
    return dataclasses.replace(options, microbatches=1, parallel="pp")


def _as_a_pipeline(log: StageLog, stages, pipeline: CompileOptions, error: Exception,
                   tried: list[tuple[str, Exception]], own: str) -> Compiled:
    """``pipeline``'s compile, the plan saying why; where it fails too, its error (a refusal names
    the pipeline's smallest budget: what would run), saying that the cuts tried failed and why."""
    why = f"the batch cannot be cut into microbatches ({type(error).__name__})"
    log.run("fall back", lambda: None, decision=lambda _: f"{why}; trying the devices in turn on the whole batch")
    try:
        return stages(None, pipeline, f", the devices in turn on the whole batch: {why}")
    except Exception as failure:  # noqa: BLE001 - said with the cuts that failed before it
        replacement = _say_what_was_tried(failure, [*tried, (own, error)])
        if replacement is failure:
            raise
        raise replacement from failure


def _own_where_it_fits(stages, smallest: int, budget: int | None) -> Compiled | None:
    """The options' own compile where their counted smallest budget is within ``budget`` (the bound
    that refused them was above what they hold: refusing would name this budget again); ``None``
    where it is not, or where it fails after all (the counted refusal is named then)."""
    if budget is None or smallest > budget:
        return None
    try:
        return stages(None, name_smallest=True)
    except BudgetTooSmallError:
        return None


def _counted(refusal: BudgetTooSmallError) -> BudgetTooSmallError:
    return refusal.counted() if isinstance(refusal, CountedWhenAsked) else refusal


def _describe_try(schedule: Schedule | None, options: CompileOptions, num_devices: int) -> str:
    if schedule is None:
        forward = "" if options.forward_microbatches is None else f", {options.forward_microbatches} in the forward"
        count = options.microbatches or num_devices
        return f"the options' own settings ({count} microbatch{'es' if count > 1 else ''}{forward})"
    return f"the planner's {schedule.describe()}"


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _say_what_was_tried(error: Exception, tried: list[tuple[str, Exception]]) -> Exception:
    """``error``, its message followed by the schedules tried before and why each failed: the same
    object where its message is its one argument (type and attributes kept, e.g.
    ``BudgetTooSmallError.smallest_budget``), else a ``ValueError`` saying it all."""
    lines = "\n".join(f"  - {what}: {type(failure).__name__}: {_first_line(failure)}" for what, failure in tried)
    message = f"{error}\nharmony_fx also tried, and each failed:\n{lines}"
    if type(error).__str__ is BaseException.__str__ and len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (message,)
        return error
    return ValueError(f"{type(error).__name__}: {message}")


def _from_layout(log: StageLog, example: _Example, devices: list, options: CompileOptions, trainer: bool,
                 updates: bool, optimizer: OptimizerFacts | None, whole: Variant | None, analysis: BatchAnalysis | None,
                 schedule: Schedule | None, forward_only: bool = False, reuse: Compiled | None = None,
                 resident: bool = False, why: str = "", name_smallest: bool | str = True,
                 by_hand: bool = True) -> Compiled:
    """Stages 3-9 of the module docstring, for ``schedule`` (``None``: the options' own; ``why``:
    what the plan says of them where the compile chose them; ``name_smallest``: how their refusal
    names the smallest budget, ``compiler.packing.plan_packs``; ``by_hand``: the caller set the
    microbatches, whose cut is said where it may compute otherwise, not refused)."""
    layout = log.run("lay out", decide_layout, schedule, options, len(devices), example.batch_size,
                     decision=Layout.describe)
    variants = log.run("capture microbatches", _capture_microbatches, example, layout, whole,
                       devices[0].torch_device, options.compute_dtype, decision=_describe_microbatches)
    primary = variants[layout.mb_sizes[0]]
    if analysis is None:
        whole = whole or _whole_batch_for_a_cut(log, example, variants, layout, devices[0], options)
        analysis = log.run("analyze batch", _analyze_the_cut, example, variants, layout, whole,
                           decision=_describe_batch)
    if schedule is None:
        _warn_if_cut_changes_results(layout, analysis, primary.captured.gm)
    example_flat = primary.captured.flatten_inputs(*microbatch.split_call(
        example.call, example.dims, [s for s in layout.mb_sizes if s] or [0])[0])
    signature = log.run("signature", program_signature, primary.captured, [x.requires_grad for x in example_flat],
                        layout.num_microbatches, options.grouping, trainer, forward_only, decision=_describe_signature)
    if layout.forward_parts:
        _check_forward_parts(trainer, analysis)
    whole = _beside_the_whole_batch(log, example, variants, layout, whole, schedule, devices[0], options, analysis,
                                    by_hand)
    shapes = Shapes(variants, layout.sizes, primary.masters, options.compute_dtype)
    context = PackingContext(variants, layout, signature, shapes, [d.torch_device for d in devices], updates,
                             options.verify, devices[0].budget, devices[0].margin)
    if schedule is not None:
        policy, policy_name = fixed(schedule.boundaries), "planner"
    elif options.pack_boundaries is not None:
        policy, policy_name = fixed(options.pack_boundaries), f"fixed{why}"
    else:
        policy, policy_name = balanced, f"balanced{why}"
    candidate: Candidate | None = None
    if reuse is not None:
        candidate = log.run("reuse packs", reuse_packing, context, reuse.candidate, reuse.variants, reuse.layout.sizes,
                            decision=lambda c: "the larger call's packing, every value no larger: its peak bounds this "
                            "one's" if c is not None else "a value is larger here: the packing is checked in full")
    if candidate is None:
        def plan_packs_by(policy, policy_name: str) -> Candidate:
            return log.run("plan packs", _plan_packs, log, context, primary, devices[0], policy,
                           name_smallest=name_smallest if schedule is None else False,
                           decision=lambda c: f"{policy_name}: {len(c.packs)} pack(s), peak "
                           + ", ".join(f"{d.name} {format_size(p)}" for d, p in zip(devices, c.peaks)))

        try:
            candidate = plan_packs_by(policy, policy_name)
        except BudgetTooSmallError:
            if schedule is None:
                raise
            # The planner's packs come from its cost model, which the exact count may refuse; its
            # microbatches are captured already and likely still the faster choice: search packs
            # for them before falling back to another schedule (and capturing again)
            policy_name = "balanced at the planner's microbatches"
            candidate = plan_packs_by(balanced, policy_name)
    if layout.forward_parts:
        _refuse_stashed_batch_indices(candidate, variants[max(s for s in layout.sizes if s)], example.flat_dims)
    log.run("annotate packs", _annotate, variants, candidate.boundaries, options.verify,
            decision=lambda _: "the chosen packs and liveness written on the graph" + (", verified" if options.verify else ""))
    if options.verify:
        log.run("check peak", _check_peaks, candidate, devices,
                decision=lambda _: "every device's peak, with its margin, within the budget")
    memory = None
    if optimizer is not None and (options.nvme_path is not None or options.host_memory is not None):
        memory = log.run("plan host memory", _plan_host_memory, candidate, shapes, layout, options, optimizer,
                         decision=_describe_host_memory)
        if memory.tier_packs and updates:  # without per-pack updates (max_grad_norm) the final update streams it
            candidate = log.run("insert tier io", _insert_tier_io, candidate, memory, layout, options.verify,
                                decision=lambda c: f"READ/WRITE of {len(memory.tier_packs)} pack(s)' optimizer state"
                                + (" and fp32 masters" if memory.tier_master_packs else ""))
    device_programs = log.run("codegen", _codegen, candidate, layout,
                              decision=lambda programs: f"{2 * len(programs)} program(s), "
                              f"{sum(len(f) + len(b) for f, b in candidate.device_actions)} actions")
    batch_note = _batch_note(analysis, layout.num_microbatches)
    plan = log.run("plan", make_plan, candidate, shapes, primary.nodes, devices, layout, devices[0].budget,
                   policy_name, batch_note, memory, options.nvme_path, resident, decision=lambda p: f"{format_size(p.bytes_h2d)} in, "
                   f"{format_size(p.bytes_d2h)} out per iteration")
    input_specs = tuple((x.shape, x.dtype, x.requires_grad) for x in example_flat)
    return Compiled(options=options, devices=tuple(devices), trainer=trainer, updates=updates, schedule=schedule,
                    layout=layout, variants=variants, batch_analysis=analysis, flat_dims=example.flat_dims,
                    input_specs=input_specs, signature=candidate.signature, shapes=shapes, candidate=candidate,
                    device_programs=tuple(device_programs), plan=plan, passes=log, host_memory=memory,
                    resident_weights=resident, batch_reductions=whole and whole.captured.reductions,
                    batch_outputs=whole and whole.captured.gm.graph.find_nodes(op="output")[0].args[0])


# ----------------------------------------------------------------------------------- the stages


def refuse_meta_state(model: nn.Module) -> None:
    """A model with a parameter or buffer on the meta device is refused, naming it as the model names it
    (``harmony_fx.Trainer`` asks before wrapping the model with its loss); so is a lazy module not
    run yet, whose parameters its first call makes: capturing runs the forward on FakeTensors, which
    would make them on the meta device, in the user's own module, for good."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(
                f"{f'the module {name!r}' if name else 'the model'} ({type(module).__name__}) makes its parameters "
                "on its first call, which has not run yet: run the model once before compiling it "
                "(with torch.no_grad(): model(example_batch)), so that they exist with their values.")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.device.type == "meta":
                raise ValueError(
                    f"the model's {kind} {name!r} is on the meta device, which holds no values: make the model on "
                    "the CPU (or model.to_empty(device='cpu') and load its weights) before compiling it; "
                    "`harmony-fx plan` plans a model built on the meta device without its values.")


def _weights_resident(model: nn.Module, devices: list, options: CompileOptions) -> bool:
    """Where the masters (the model's own tensors) live: in host memory (``False``), each pack's
    weights copied to the devices once per iteration, or resident on the one device that computes
    (``True``: ``CompileOptions.resident_weights``). A model on a GPU is resident only where that is
    the one GPU named: anywhere else its weights would go from the GPU to the host and back every
    iteration, and its gradients land on the host beside parameters that live on the GPU."""
    refuse_meta_state(model)
    state = [("parameter", *item) for item in model.named_parameters()] + [
        ("buffer", *item) for item in model.named_buffers()]
    off_host = next(((kind, name, tensor) for kind, name, tensor in state if tensor.device.type != "cpu"), None)
    wanted = options.resident_weights
    if wanted is False or (wanted is None and (off_host is None or len(devices) != 1)):
        if off_host is not None:
            kind, name, tensor = off_host
            raise ValueError(
                f"the model's {kind} {name!r} is on {tensor.device}: harmony_fx keeps the model's weights in host "
                "memory and copies each pack's weights to the devices that compute, once per iteration. Keep the "
                "model on the CPU (model.cpu(), and build the optimizer over its parameters there) and name the "
                f"GPUs in devices= (e.g. devices=['{tensor.device}']); or, for a model that fits on one GPU, leave "
                f"it there and compile for that GPU alone (devices=['{tensor.device}'], resident_weights=True).")
        return False
    device = devices[0]
    if len(devices) != 1:
        raise ValueError(f"resident_weights=True keeps the weights on the one device that computes, but devices= "
                         f"names {len(devices)} ({', '.join(d.name for d in devices)}): name one, or keep the model "
                         "on the CPU (resident_weights=False) to train on several.")
    if options.precision != "fp32":
        raise ValueError(f"the model is on {device.name}, where resident weights compute in their own dtype: "
                         f"precision={options.precision!r} would keep a second, bf16 copy of them there. Use "
                         "torch.autocast around the call instead, or keep the model on the CPU.")
    home = torch.device("cpu") if isinstance(device, HostDevice) else device.torch_device
    for kind, name, tensor in state:
        if tensor.device != home:
            where = "the CPU (a HostDevice stands in for a GPU the model was moved to)" if home.type == "cpu" else home
            raise ValueError(f"resident_weights: the model's {kind} {name!r} is on {tensor.device}, but the weights "
                             f"stay where {device.name} computes with them: move the model to {where} "
                             f"(model.to({str(home)!r})) before compiling.")
    return True


def _refuse_resident_in_trainer() -> None:
    raise ValueError(
        "harmony_fx.Trainer steps the optimizer on the host, pack by pack, while the devices go on: it "
        "keeps the model's weights in host memory. For a model that fits on one GPU, keep it there and use "
        "harmony_fx.compile(model, devices=['cuda:0']) with your optimizer on the GPU (loss.backward(); "
        "optimizer.step()); or keep the model on the CPU (model.cpu()) for the Trainer.")


def _reserve_resident_gradients(model: nn.Module, device, options: CompileOptions) -> None:
    """Resident weights' gradients stay on the device, every one of them by the backward's end,
    beside what the plan counts: they are kept below the budget with the device's margin. On a GPU
    whose budget is what is free now, so is room for an Adam-like optimizer's two states, which
    the caller's optimizer makes there on its first step."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)  # tied: once
    optimizer = 2 * grads if options.memory_budget is None and isinstance(device, CudaDevice) else 0
    before = f"{device.margin_note}; and " if device.margin else ""
    device.margin += grads + optimizer
    device.margin_note = (f"{before}{format_size(grads)} for the resident weights' gradients"
                          + (f", {format_size(optimizer)} for an Adam-like optimizer's state beside them (the "
                             "budget being what was free when compiling: give memory_budget= to say otherwise)"
                             if optimizer else ""))


def _batch_or_none(example: _Example) -> int | None:
    try:
        return example.batch_size()
    except ValueError:
        return None  # no batch to cut


def _capture_microbatches(example: _Example, layout: Layout, whole: Variant | None, target,
                          dtype: torch.dtype | None) -> dict:
    """A graph per distinct microbatch size: the backward's, and the forward's where larger."""
    variants: dict[int | None, Variant] = {}
    backward_sizes, forward_sizes = layout.mb_sizes, layout.sizes[layout.num_microbatches:]
    for sizes in (backward_sizes, forward_sizes) if forward_sizes else (backward_sizes,):
        calls = microbatch.split_call(example.call, example.dims, [s for s in sizes if s] or [0])
        for size, (mb_args, mb_kwargs) in zip(sizes, calls):
            if size not in variants:
                try:
                    variants[size] = whole if size is None and whole is not None else cached_capture(
                        example.model, size, mb_args, mb_kwargs, target, dtype)
                except CaptureError as error:
                    if size is None or not error.raised_by_model or raised_when_run(
                            example.model, example.args, example.kwargs) is not None:
                        raise  # the model's own error: the whole batch raises too
                    raise CaptureError(
                        f"{type(example.model).__name__} raises on a microbatch of {size} sample(s), cut from the "
                        "batch along each input's batch dim (dim 0 unless batch_dims says otherwise), though not on "
                        f"the whole batch: {str(error).splitlines()[0].split(': ', 1)[-1]}\nAn input whose first "
                        "dim is not a batch of samples (an unbatched sample, an edge list, offsets) is cut wrongly: "
                        "name its batch dim, or None for one every microbatch shares (batch_dims={'name': None}), or "
                        "pass microbatches=1.") from error
    check_same_layers(variants, backward_sizes, forward_sizes)
    return variants


def _beside_the_whole_batch(log: StageLog, example: _Example, variants: dict, layout: Layout, whole: Variant | None,
                            schedule: Schedule | None, device, options: CompileOptions,
                            analysis: BatchAnalysis, by_hand: bool) -> Variant | None:
    """Where the batch is cut, the whole batch's graph (the planner's or the analysis's, else
    captured where a number scales the loss or is returned: what it is at the batch's size), each
    microbatch's graph compared with it (a difference refuses the compile's own cut and is said of
    one by hand, ``by_hand``), and for the planner's cut the loss weighed on the example's
    microbatches; ``None`` where the batch is whole or its graph was not needed."""
    if layout.num_microbatches == 1:
        return None
    primary = variants[layout.mb_sizes[0]]
    numbers = any(r.scaled for r in primary.captured.reductions.values()) or _returns_numbers(primary)
    if whole is None and numbers:
        whole = log.run("capture whole batch", cached_capture, example.model, None, example.args, example.kwargs,
                        device.torch_device, options.compute_dtype, decision=lambda _: "a number scales a loss cut "
                        "into microbatches, or the model returns one: its value at the whole batch's size")
    if whole is not None and not by_hand:
        log.run("compare with the whole batch", _check_cut_computes_alike, whole, variants, layout, analysis,
                decision=lambda _: "each microbatch's graph computes as the whole batch's")
    elif whole is not None:
        log.run("compare with the whole batch", _compare_a_cut_by_hand, whole, variants, layout, analysis,
                decision=lambda _: "each microbatch's outputs have the whole batch's dims; where its graph computes "
                                   "otherwise, said")
    if schedule is not None:
        # the planner's own cut only: one by hand is weighed at each call, or by the caller
        # (HarmonyTrainer weighs a step's batches as transformers does)
        log.run("weigh the loss", _weigh_the_loss, example, variants, layout, whole and whole.captured.reductions,
                decision=lambda _: "every scalar output put back together from the example's microbatches")
    return whole


def _returns_numbers(variant: Variant) -> bool:
    """Whether the model returns a Python number (``x.shape[0]``, a token count), which each graph
    holds at its own size."""
    returned = variant.captured.gm.graph.find_nodes(op="output")[0].args[0]
    return any(isinstance(value, (int, float)) and not isinstance(value, bool) for value in returned)


def _check_cut_computes_alike(whole: Variant, variants: dict, layout: Layout, analysis: BatchAnalysis) -> None:
    _check_cut_outputs_join(whole, variants, layout, analysis)
    _check_cut_computes_as_the_batch(whole, variants, layout, analysis)


def _check_cut_outputs_join(whole: Variant, variants: dict, layout: Layout, analysis: BatchAnalysis) -> None:
    for size in dict.fromkeys(layout.mb_sizes):  # each output joined as the call joins it (``Compiled.output_dims``)
        check_outputs_alike(whole, variants[size], sum(layout.mb_sizes),
                            analysis.output_dims if analysis.separable else {})


def _check_cut_computes_as_the_batch(whole: Variant, variants: dict, layout: Layout, analysis: BatchAnalysis) -> None:
    for size in dict.fromkeys(layout.mb_sizes):
        check_computes_alike(whole, variants[size], sum(layout.mb_sizes), analysis.value_dims)


def _compare_a_cut_by_hand(whole: Variant, variants: dict, layout: Layout, analysis: BatchAnalysis) -> None:
    """A cut by hand is the user's: where a microbatch's graph computes otherwise than the whole
    batch's (control flow on the batch size, a size read from it), it is said, as an analysis that
    cannot show the samples apart is (once: not again where that was said); outputs that cannot be
    joined are refused."""
    _check_cut_outputs_join(whole, variants, layout, analysis)
    if not analysis.separable:
        return
    try:
        _check_cut_computes_as_the_batch(whole, variants, layout, analysis)
    except ComputesOtherwise as error:
        warnings.warn(
            f"harmony_fx: microbatches={layout.num_microbatches} cuts the batch, but {error.reason}: the results (loss "
            "and gradients) may differ from eager's; microbatches=1, or None (the planner keeps such a batch "
            "whole), computes eager's.", MicrobatchesComputeApart, stacklevel=user_stacklevel())


def _weigh_the_loss(example: _Example, variants: dict, layout: Layout, batch_reductions: dict | None) -> None:
    """Each scalar output's microbatch weights on the example batch: a loss they cannot put back
    together (a mean plus a scaled sum) fails a planner's cut here, which falls back to the next
    choice, rather than on the first call."""
    sizes = layout.mb_sizes
    calls = microbatch.split_call(example.call, example.dims, sizes)
    captured = [variants[size].captured for size in sizes]
    inputs = [dict(zip(c.inputs, c.flatten_inputs(*call))) for c, call in zip(captured, calls)]
    for name in captured[0].reductions:
        reductions = [c.reductions[name] for c in captured]
        if all(reduction.combine is not None for reduction in reductions):  # else the call says why
            microbatch.scalar_weights(reductions, inputs, sizes, None, (batch_reductions or {}).get(name))


def _plan_packs(log: StageLog, context: PackingContext, primary: Variant, device, policy,
                name_smallest: bool | str) -> Candidate:
    """The fewest packs that fit (``compiler.packing.plan_packs``: bounds, then a monotone search,
    each run cut short where it passes the budget), the chosen packing as it will run.
    ``name_smallest``: a refusal names the smallest budget (the options' own settings: a planner's
    schedule falls back instead)."""
    costs = layer_costs(primary)
    # one packing to try (the planner's, or the caller's boundaries): fetching ahead is tried first
    single = len({tuple(policy(costs, n)) for n in (1, len(costs))}) == 1
    _, candidate = plan_packs(costs, functools.partial(evaluate, context, ahead_first=single), lambda c: c.peak,
                              device.budget, policy, device.margin, bound=PackingBounds(context), cut_short=True,
                              name_smallest=name_smallest, progress=log.report)
    return finish_chosen(context, candidate, ahead_tried=single)


def _refuse_stashed_batch_indices(candidate: Candidate, forward: Variant, flat_dims) -> None:
    """Larger forward microbatches cut their stash for the backward's: a sample's index in the batch
    (``arange`` over it, e.g. to pick each sample's row of a mask) crossing packs would keep the
    forward microbatch's numbers, and the second part would index past its own microbatch. Read on
    the forward microbatch's graph, the one that stashes (of more than one sample; at the whole
    batch's size an ``arange`` over positions as many as the samples would look like one)."""
    indices = _analyze_batch(forward, forward.size, flat_dims).batch_indices
    crossing = sorted({v for pack in candidate.packs for v in pack.act_inputs} & set(indices))
    if crossing:
        raise ValueError(f"microbatches={{'forward': ..., 'backward': ...}}: {crossing[0]} is each sample's index in "
                         "the batch (arange over it) and crosses packs: stashed at the forward's size and cut for the "
                         "backward, the second part would index past its own microbatch. Give microbatches as one int")


def _check_forward_parts(trainer: bool, analysis: BatchAnalysis) -> None:
    """Larger forward microbatches compute what the backward's do only if the samples are apart."""
    if not trainer:
        raise ValueError("microbatches={'forward': ..., 'backward': ...}: forward microbatches larger than the "
                         "backward's need the loss inside the graph (the last pack runs forward, loss and backward "
                         "on the backward's microbatches): train with harmony_fx.Trainer, or give microbatches as "
                         "one int")
    if not analysis.separable:
        raise ValueError("microbatches={'forward': ..., 'backward': ...}: the backward recomputes each pack on part "
                         "of a forward microbatch, which computes the same only when every op treats the samples "
                         f"apart, and this model's do not ({analysis.reason}); give microbatches as one int")


def _analyze_batch(variant: Variant, batch: int, flat_dims) -> BatchAnalysis:
    """Whether this variant's graph treats the samples apart (and its outputs' batch dims), and
    whether each scalar output (a loss) can be put back together from microbatches: judged by the
    reductions read at capture, the ones the runtime weighs the microbatches' losses by."""
    captured = variant.captured
    if batch < 2:
        return BatchAnalysis(False, "a batch of one sample has nothing to cut")
    analysis = analyze_batch_dims(captured.gm, dict(zip(captured.inputs, flat_dims)), batch, captured.reductions)
    if analysis.separable or set(flat_dims) - {None} != {0}:
        return analysis
    # read along dim 0, a sequence-first model ([time, batch, ...]: nn.Transformer's and nn.LSTM's
    # default layout) mixes its "samples": say so where dim 1 would be a batch the analysis can cut
    values = {node.name: node.meta[meta.VAL] for node in captured.gm.graph.find_nodes(op="placeholder")}
    cut = [values[name] for name, dim in zip(captured.inputs, flat_dims) if dim == 0]
    if any(value.dim() < 2 for value in cut) or len({value.shape[1] for value in cut}) != 1 or cut[0].shape[1] < 2:
        return analysis
    along_one = analyze_batch_dims(captured.gm, {name: 1 if dim == 0 else None for name, dim in
                                                 zip(captured.inputs, flat_dims)}, cut[0].shape[1], captured.reductions)
    if not along_one.separable:
        return analysis
    return dataclasses.replace(analysis, reason=f"{analysis.reason}; along dim 1 of the inputs every op treats the "
                                                "samples apart: if the batch is dim 1 (a sequence-first layout), "
                                                "say batch_dims=1")


def _whole_batch_for_a_cut(log: StageLog, example: _Example, variants: dict, layout: Layout, device,
                           options: CompileOptions) -> Variant | None:
    """The whole batch's graph where the options cut the batch (``None`` where the batch has no one
    size): what the analysis judges and the microbatches' graphs are compared with."""
    if variants.get(None) is not None:
        return variants[None]
    try:
        example.batch_size()
    except ValueError:
        return None
    return log.run("capture whole batch", cached_capture, example.model, None, example.args, example.kwargs,
                   device.torch_device, options.compute_dtype,
                   decision=lambda _: "what the microbatches must compute, at the batch's own sizes")


def _analyze_the_cut(example: _Example, variants: dict, layout: Layout, whole: Variant | None) -> BatchAnalysis:
    """The analysis of the whole batch's graph: a microbatch's graph has its own sizes baked in
    (``x[:3]`` of a batch of 4 keeps every sample of a microbatch of 2, ``unflatten(0, (-1, 3))``
    groups none of them), and one sample's cannot show samples apart. Where the batch has no one
    size, the largest microbatch's."""
    try:
        batch = example.batch_size()
    except ValueError as error:
        if layout.mb_sizes != (None,) and max(layout.mb_sizes) > 1:
            largest = max(layout.mb_sizes)
            return _analyze_batch(variants[largest], largest, example.flat_dims)
        return BatchAnalysis(False, getattr(error, "finding", str(error)))
    assert whole is not None, "a batch with one size has its whole graph"
    return _analyze_batch(whole, batch, example.flat_dims)


def _annotate(variants: dict, boundaries, verify: bool) -> None:
    for variant in variants.values():
        annotate_packs(variant.captured.gm, variant.layers, boundaries)
        if verify:
            verify_packs(variant.captured.gm)
    first = next(iter(variants.values()))
    annotate_liveness(first.captured.gm)


def _plan_host_memory(candidate: Candidate, shapes: Shapes, layout: Layout, options: CompileOptions,
                      optimizer: OptimizerFacts) -> HostMemoryPlan:
    packs = candidate.packs
    masters = list({id(t): t for pack in packs for name in pack.params + pack.buffers
                    for t in [shapes.masters[name]]}.values())
    stash = sum(shapes.key_bytes(a.key, packs) for forward, _ in candidate.device_actions for a in forward
                if a.kind == ActionKind.OFFLOAD and a.key.kind == KeyKind.ACT)
    return plan_host_memory(update_groups(packs, shapes.masters), masters, stash, optimizer, options.host_memory,
                            tier=options.nvme_path is not None,
                            devices=len(candidate.device_actions) if layout.parallel == "pp" else 1,
                            compute_dtype=options.compute_dtype,
                            weight_stagers=1 if layout.parallel == "pp" else len(candidate.device_actions))


def _insert_tier_io(candidate: Candidate, memory: HostMemoryPlan, layout: Layout, verify: bool) -> Candidate:
    device_actions = insert_tier_io(candidate.device_actions, frozenset(memory.tier_packs))
    if verify:
        verify_programs(device_actions, candidate.signature, layout)
    return dataclasses.replace(candidate, device_actions=device_actions)


def _describe_host_memory(memory: HostMemoryPlan) -> str:
    masters = f", fp32 masters of {len(memory.tier_master_packs)}" if memory.tier_master_packs else ""
    where = (f"optimizer state of {len(memory.tier_packs)} of {len(memory.pack_state_bytes)} pack(s){masters} on "
             f"the tier ({format_size(memory.tier_bytes)})" if memory.tier_packs else "everything in host memory")
    limit = "" if memory.host_memory is None else f" of {format_size(memory.host_memory)}"
    return f"{where}; host memory {format_size(memory.needs.total)}{limit}"


def _check_peaks(candidate: Candidate, devices: list) -> None:
    for device, estimate in zip(devices, candidate.estimates):
        check_peak(estimate.peak + device.margin, device.budget, device.name, estimate.peak_at)


def _codegen(candidate: Candidate, layout: Layout) -> list[dict[str, fx.GraphModule]]:
    packs = candidate.packs_by_size[layout.mb_sizes[0]]
    published = frozenset(a.event for pair in candidate.device_actions for actions in pair for a in actions
                          if a.kind == ActionKind.WAIT and a.peer is not None)
    return [{phase: generate_program(actions, _steps(actions, packs), f"Harmony{phase.title()}", published)
             for phase, actions in zip(("forward", "backward"), pair)}
            for pair in candidate.device_actions]


def _steps(actions: list[Action], packs) -> list[str]:
    """The comment above each action: the task it serves (transfers before a task belong to it)."""
    labels: list[str] = [""] * len(actions)
    upcoming = ""
    for index in range(len(actions) - 1, -1, -1):
        action = actions[index]
        if action.kind in (ActionKind.FWD, ActionKind.RECOMPUTE, ActionKind.BWD):
            pack = packs[action.pack]
            upcoming = f"{action.kind.value} {pack.name} ({pack.describe_layers()}) microbatch {action.mb}"
        elif action.kind == ActionKind.UPDATE:
            upcoming = f"UPDATE on the host: parameters last used by p{action.pack}"
        labels[index] = upcoming or "end of the iteration"
    return labels


# ----------------------------------------------------------------------------------- decisions


def _describe_devices(devices: list) -> str:
    return ", ".join(f"{d.name} (budget {'unlimited' if d.budget is None else format_size(d.budget)})"
                     for d in devices)


def _describe_schedules(schedules: tuple[Schedule, ...]) -> str:
    if not schedules:
        return "none found: the options' defaults"
    later = f" (then {len(schedules) - 1} simpler one(s) to fall back to)" if len(schedules) > 1 else ""
    return schedules[0].describe() + later


def _describe_variant(variant: Variant) -> str:
    captured = variant.captured
    kept = ", kept from an earlier compile of the model in this state" if variant.reused else ""
    return f"{captured.method}: {len(variant.layers)} layers, {len(captured.params)} parameter tensors" \
           f"{_cache_note([variant])}{kept}"


def _describe_microbatches(variants: dict) -> str:
    kept = sum(variant.reused for variant in variants.values())
    kept_note = f" ({kept} kept from an earlier compile of the model in this state)" if kept else ""
    if None in variants:
        return "the whole batch's graph" + kept_note
    return f"{len(variants)} graph(s), at microbatch sizes " + ", ".join(map(str, variants)) + \
        _cache_note(variants.values()) + kept_note


def _cache_note(variants) -> str:
    return ", the model's key/value cache off (training does not read it)" if any(
        variant.captured.caches_off for variant in variants) else ""


def _describe_batch(analysis: BatchAnalysis) -> str:
    return "may be cut" if analysis.separable else f"kept whole: {analysis.reason[:120]}"


def _describe_signature(signature: Any) -> str:
    return (f"{len(signature.model_inputs)} input(s), {len(signature.model_outputs)} output(s), "
            f"{len(signature.differentiable)} differentiable values")


def _batch_note(analysis: BatchAnalysis, num_microbatches: int) -> str:
    if analysis.separable:
        return "every op treats the samples apart, so microbatches compute what the whole batch does"
    if num_microbatches > 1:
        return (f"cut into {num_microbatches} microbatches as microbatches= asks, although microbatches may "
                f"change the result: {analysis.reason}")
    # the reason may be an op that mixes the samples or one the analysis has no rule for: not proven either way
    return f"kept whole (harmony_fx cannot show that microbatches compute what the whole batch does): {analysis.reason}"


def _warn_if_cut_changes_results(layout: Layout, analysis: BatchAnalysis, gm: fx.GraphModule) -> None:
    """Microbatches the user gave are theirs (BatchNorm per microbatch, as in Harmony), but a batch
    cut where the graph mixes samples (a contrastive loss over every pair of samples, a softmax over
    the batch) computes another loss than eager without any error: say so once, at compile. Where
    an output has no batch dim to join the microbatches' outputs along, a cut would return another
    tensor than the model's: refused."""
    if layout.num_microbatches > 1 and not analysis.joinable:
        raise ValueError(f"microbatches={layout.num_microbatches} cuts the batch, but {analysis.reason.rstrip('.')}: "
                         "microbatches' outputs cannot be put back together. Use microbatches=1 (or, for an output "
                         "reshaped across its batch dim, reshape it after the call).")
    if layout.num_microbatches > 1 and not analysis.separable:
        warnings.warn(
            f"harmony_fx: microbatches={layout.num_microbatches} cuts the batch, but harmony_fx cannot show "
            f"that microbatches compute what the whole batch does: {analysis.reason.rstrip('.')}. The results "
            "(loss and gradients) may differ from eager's; microbatches=1, or None (the planner keeps such a "
            "batch whole), computes eager's.", MicrobatchesComputeApart, stacklevel=user_stacklevel())
    elif layout.num_microbatches > 1 and (draw := next((n for n in gm.graph.nodes if draws_random(n)), None)):
        warnings.warn(
            f"harmony_fx: microbatches={layout.num_microbatches} cuts the batch of a model that draws random "
            f"numbers ({meta.describe(draw)}): each microbatch draws its own, in another order than eager's one "
            "draw for the batch, so the loss and gradients equal eager's in distribution, not in value (as under "
            "gradient accumulation); microbatches=1, or None (the planner keeps such a batch whole), draws as "
            "eager does.", RandomDrawsPerMicrobatch, stacklevel=user_stacklevel())
    elif layout.num_microbatches > 1 and (write := first_buffer_write(gm)) is not None:
        warnings.warn(
            f"harmony_fx: microbatches={layout.num_microbatches} cuts the batch of a model that updates a buffer in "
            f"place ({meta.describe(write)}): each microbatch's forward updates it in turn, reading what the one "
            "before left, where eager updates it once for the batch, so the results differ from eager's; "
            "microbatches=1, or None (the planner keeps such a batch whole; over several devices, in a pipeline: "
            "not parallel='dp', which gives each device its own), computes eager's.", MicrobatchesComputeApart,
            stacklevel=user_stacklevel())


class MicrobatchesComputeApart(UserWarning):
    """Microbatches set by hand where the whole batch would compute otherwise: a graph that mixes
    samples (a contrastive loss over the batch), BatchNorm's statistics, a buffer each microbatch
    updates in turn. Where the microbatches are the caller's own batches (transformers' gradient
    accumulation), that is what it computes: filtered there."""


class RandomDrawsPerMicrobatch(MicrobatchesComputeApart):
    """Microbatches set by hand on a model that draws random numbers (dropout): each draws its own."""
