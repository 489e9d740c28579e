"""The host optimizer's update: one ``Updater``, whatever the axes.

Three axes, each answered in one place:

* **when**: per pack, on a worker thread as soon as the pack's gradients are complete, overlapped
  with the backward of the packs before it (``PackUpdates``); or at the step's end
  (``Updater.update_all``), when the global gradient norm (``max_grad_norm``) needs every gradient
  first, or when a batch of another size is cut into other packs than the NVMe tier's files;
* **whose gradients**: this process's, or summed over the ranks first (``CrossProcessUpdates``,
  which also fixes the order in which every rank issues its packs' collectives);
* **where the optimizer state lives**: host memory, or the NVMe tier, through which a pack's state
  streams one parameter at a time (``runtime.tier``).

The updates are the user's own ``torch.optim`` optimizer, stepped over one group of parameters at
a time, so the results and ``optimizer.state_dict()`` equal a plain ``optimizer.step()``: that holds
for optimizers whose step is each parameter's own update (``steps_per_parameter``: torch's); any
other (timm's ``Lookahead`` counts its steps in each param group) is stepped once, after the
backward. Each gradient is set as autograd would leave it: the parameter's own hooks
(``register_hook``, ``register_post_accumulate_grad_hook``: a pruning mask) run on it, and a
parameter that got none this step (frozen, unused) has none. Before a parameter is stepped, the
step's ``Undo`` keeps what the update changes (``transaction``).
"""
from __future__ import annotations

import collections
import concurrent.futures
import importlib
import threading
import time
from typing import Callable, Sequence

import torch
from torch import nn

from harmony_fx.distributed.updates import CrossProcessUpdates, TurnOrder
from harmony_fx.runtime.host import GradientBuffers, land
from harmony_fx.runtime.tier import StateTier
from harmony_fx.tier_policy import PACKS_READ_AHEAD

__all__ = ["Updater", "PackUpdates", "StepHooks", "step_subset", "steps_per_parameter", "clear_stale_grads"]


def steps_per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` over some parameters then over the others equals one step over
    all: torch's own optimizers (state in ``optimizer.state[p]``, one update per parameter), not a
    subclass or wrapper whose step may count steps, or sum over a group, outside that state, unless
    it says so (``harmony_steps_per_parameter = True``, on its class or itself). A ``step`` set on the
    optimizer itself (a wrapper that counts its calls, warms up, clips) would run once a pack: it is
    stepped once, as torch's own (``torch.optim.Adafactor``, ``Muon``, whose module is ``torch.optim``)
    are not; the LR schedulers' wrapper, which only notes that ``step`` was called, is no such step."""
    said = getattr(optimizer, "harmony_steps_per_parameter", None)
    if said is not None:
        return bool(said)
    module = type(optimizer).__module__
    return (module == "torch.optim" or module.startswith("torch.optim.")) and _steps_as_its_class(optimizer)


def _steps_as_its_class(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` is its class's ``step``, seen through the LR schedulers' wrapper."""
    step = vars(optimizer).get("step")
    if step is None:
        return True
    if getattr(step, "_wrapped_by_lr_sched", False):
        step = getattr(step, "__wrapped__", None)  # the class's function, as the wrapper calls it
    return getattr(step, "__func__", step) is type(optimizer).step


class Updater:
    def __init__(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None,
                 tier: StateTier | None = None, cross: CrossProcessUpdates | None = None,
                 grad_buffers: GradientBuffers | None = None) -> None:
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.tier = tier
        self.cross = cross
        # where the next step's gradients land: each ``.grad`` set here goes back to it
        self.grad_buffers = grad_buffers

    def update_pack(self, pack: int, params: Sequence[nn.Parameter], grads: dict, undo) -> tuple[float, float]:
        """``pack``'s update with its summed host gradients ``grads`` (``id`` of a parameter -> its
        gradient); returns the seconds it took and those it waited for the tier. With a tier, the
        last step is committed first: only then are its undo copies let go, so two steps' copies
        are never held at once."""
        waited = _timed(self.tier.wait_committed) if self.tier is not None else 0.0
        started = time.perf_counter()
        cross = self.cross
        if cross is not None and pack in cross.buffers:
            cross.step(pack, [grads.get(id(p)) for p in cross.buffers[pack].params],
                       lambda stepped: self._step(pack, _run_gradient_hooks(stepped), undo))
        else:
            _set_grads(params, grads, self.grad_buffers)
            self._step(pack, params, undo)
        return time.perf_counter() - started, waited

    def update_all(self, groups: dict[int, list[nn.Parameter]], grads: dict, undo,
                   before_step: Callable[[], None] | None = None) -> float | None:
        """Every pack's update after the backward: the gradients summed over the ranks, clipped to
        ``max_grad_norm`` by their global norm, ``before_step`` (the optimizer's step pre-hooks, which
        see those gradients, as around eager's ``optimizer.step()``), then the update (the tier's
        packs streamed in turn, then the rest). Returns that norm before clipping (``None`` without
        ``max_grad_norm``), the figure a training log shows."""
        cross = self.cross
        norm = None
        if cross is None:
            params = [p for group in groups.values() for p in group]
            _set_grads(params, grads, self.grad_buffers)
            if self.max_grad_norm is not None:
                norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        else:
            for pack in cross.order:
                cross.reduce(pack, [grads.get(id(p)) for p in cross.buffers[pack].params])
                _run_gradient_hooks(cross.buffers[pack].params)
            if self.max_grad_norm is not None:
                norm = cross.clip_grad_norm_(self.max_grad_norm)
        if before_step is not None:
            before_step()
        if self.tier is None:
            _update(self.optimizer, None, undo)
        else:
            self._through_tier(undo)
        if cross is not None:
            for pack in cross.order:
                cross.gather(pack)
        return norm

    def _step(self, pack: int, params: Sequence[nn.Parameter], undo) -> None:
        """Step ``params`` of ``pack``, whose gradients are set: on the tier, one parameter at a time."""
        if self.tier is not None and pack in self.tier.packs:
            self.tier.update(pack, lambda stepped: _update(self.optimizer, stepped, undo))
        else:
            _update(self.optimizer, params, undo)

    def _through_tier(self, undo) -> None:
        """Each tiered pack streams through its update in turn, the next ones' reads issued
        ``PACKS_READ_AHEAD`` packs ahead, as the programs issue theirs; then every other parameter."""
        tier = self.tier
        tier.wait_committed()  # the last step's files are the ones to read, and its undo copies go
        packs = sorted(tier.packs)
        reads = [tier.read(pack) for pack in packs[:PACKS_READ_AHEAD]]
        for index, pack in enumerate(packs):
            reads.pop(0).result()
            if index + PACKS_READ_AHEAD < len(packs):
                reads.append(tier.read(packs[index + PACKS_READ_AHEAD]))
            tier.update(pack, lambda stepped: _update(self.optimizer, stepped, undo))
        rest = [p for group in self.optimizer.param_groups for p in group["params"] if id(p) not in tier.params]
        if rest:
            _update(self.optimizer, rest, undo)


class PackUpdates:
    """One step's per-pack updates. The iteration reports each device's share of a pack's weight
    gradients (``on_pack``, from the device's issuing thread); once every device's share is in, the
    pack goes to the step's one update worker, which lands the gradient copies (summing them on the
    host) and updates the pack. Across processes, a complete pack waits for its turn in the order
    every rank issues collectives in. A context manager: the worker is shut down when the step
    leaves it, returned or raised, so no update still runs when a step is undone and no thread
    outlives the step."""

    def __init__(self, updater: Updater, groups: dict[int, list[nn.Parameter]], arrivals: int, undo) -> None:
        self.updater, self.groups, self.undo = updater, groups, undo
        self._needed = arrivals  # shares per pack: one per device holding it (data-parallel)
        self._arrived: collections.Counter = collections.Counter()
        self._landing: collections.defaultdict = collections.defaultdict(list)  # pack -> its gradient copies
        self._lock = threading.Lock()
        cross = updater.cross
        self.turns = TurnOrder(cross.order) if cross is not None else None
        # across processes every rank issues the collectives pack by pack in the example's packing
        # (cross.order); a module cut into other packs (a batch of another shape, planned afresh on this
        # rank alone) lands its gradients as its packs complete, and updates in that packing once they
        # all have (finish): its own packs' turns would update some parameters with this rank's
        # gradient alone, or wait for packs of the example's that never complete here
        self._deferred = cross is not None and _packing(groups) != _packing(
            {pack: cross.buffers[pack].params for pack in cross.order})
        self._futures: list[concurrent.futures.Future] = []
        self._workers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harmony-update")
        self.exposed_seconds = 0.0  # the time the step waited for its updates once the iteration ended

    def on_pack(self, runtime, pack: int, copies: Sequence) -> None:
        with self._lock:
            self._arrived[pack] += 1
            self._landing[pack].extend(copies)
            if self._arrived[pack] < self._needed:
                return
            complete = self._landing.pop(pack)
            if self._deferred:
                self._futures.append(self._workers.submit(lambda: (0.0, land(complete))))
                return
            if self.turns is None or pack not in self.updater.cross.buffers:
                self._submit(pack, complete, runtime.host_grads)
                return
            for turn, copies_of_turn in self.turns.arrive(pack, complete):
                self._submit(turn, copies_of_turn, runtime.host_grads)

    def _submit(self, pack: int, copies: Sequence, grads: dict) -> None:
        self._futures.append(self._workers.submit(self._land_and_update, pack, copies, grads))

    def _land_and_update(self, pack: int, copies: Sequence, grads: dict) -> tuple[float, float]:
        tier_waited = land(copies)  # the copies' host work sums the gradients into ``grads``
        seconds, waited = self.updater.update_pack(pack, self.groups.get(pack, []), grads, self.undo)
        return seconds, tier_waited + waited

    def finish(self, runtime) -> None:
        """After the iteration: where the module's packs are not the example's (``_deferred``), every
        pack of the example's updates now, in the order every rank takes them, after the landings
        queued before (one worker). Nothing where no pack was handed over (no per-pack updates)."""
        if not self._deferred or not self._arrived:
            return
        cross = self.updater.cross
        for pack in cross.order:
            for turn, _ in self.turns.arrive(pack, None):  # taken: a step failing after this stands in for none
                self._futures.append(self._workers.submit(
                    self.updater.update_pack, turn, cross.buffers[turn].params, runtime.host_grads, self.undo))

    def __enter__(self) -> "PackUpdates":
        return self

    def __exit__(self, *exc_info) -> None:
        started = time.perf_counter()
        self._workers.shutdown(wait=True)
        self.exposed_seconds = time.perf_counter() - started

    def shutdown(self) -> None:
        """Again on a failed step: a second Ctrl-C may have cut the first wait short."""
        self._workers.shutdown(wait=True)

    def results(self) -> tuple[float, float]:
        """The seconds the updates took and those they waited for the tier; re-raises an update's
        error."""
        done = [future.result() for future in self._futures]
        return sum(seconds for seconds, _ in done), sum(waited for _, waited in done)


def _set_grads(params: Sequence[nn.Parameter], grads: dict, buffers: GradientBuffers | None) -> None:
    for param in params:
        grad = param.grad = grads.get(id(param))
        if grad is not None and buffers is not None:
            buffers.keep(id(param), grad)  # the next step's copy of this gradient lands in it
    _run_gradient_hooks(params)


def _run_gradient_hooks(params: Sequence[nn.Parameter]) -> Sequence[nn.Parameter]:
    """The hooks autograd runs on a leaf's gradient as it accumulates it: ``register_hook``'s (each
    may return a new gradient), then ``register_post_accumulate_grad_hook``'s, on the step's gradient
    summed over its microbatches, as on eager's one backward's."""
    for param in params:
        if param.grad is None:
            continue
        for hook in (getattr(param, "_backward_hooks", None) or {}).values():
            changed = hook(param.grad)
            if changed is not None:
                param.grad = changed
        for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(param)
    return params


def clear_stale_grads(optimizer: torch.optim.Optimizer, groups: dict[int, list[nn.Parameter]]) -> None:
    """A parameter no pack gave a gradient this step (frozen since, or unused in this call's mode) has
    none, as after eager's ``zero_grad()`` and backward: the last step's would be stepped again."""
    given = {id(p) for group in groups.values() for p in group}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in given:
                param.grad = None


def _update(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter] | None, undo) -> None:
    """Save what the update changes, then step ``params`` (``None``: every parameter)."""
    if params is None:
        undo.save([p for group in optimizer.param_groups for p in group["params"]])
        optimizer.step()
    else:
        undo.save(params)
        step_subset(optimizer, params)


def step_subset(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
    """``optimizer.step()`` over ``params`` only: every other parameter is hidden for the call.
    Per-parameter state and arithmetic are those of a full step."""
    wanted = {id(p) for p in params}
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in wanted]
        optimizer.step()
    finally:
        for group, original in zip(optimizer.param_groups, saved):
            group["params"] = original


def _packing(groups: dict[int, Sequence[nn.Parameter]]) -> dict[int, list[int]]:
    return {pack: [id(param) for param in params] for pack, params in groups.items() if params}


class StepHooks:
    """The optimizer's step hooks, its own (``register_step_pre_hook``, ``register_step_post_hook``)
    and torch's global ones (``torch.optim.optimizer.register_optimizer_step_pre_hook``, ``..._post_hook``),
    once a Trainer step, as around one ``optimizer.step()``, each seeing every parameter: the step
    updates pack by pack, each update an ``optimizer.step()`` over that pack's parameters, which
    would run every hook once a pack. ``hold()`` takes every hook off; ``run_pre()`` runs the
    pre-hooks (the global ones first, as torch does) once every gradient is set, as eager runs them
    after the backward (they may read or change the gradients: a clip, gradient centralization), so
    an optimizer with pre-hooks is stepped once, after the backward (``has_pre_hooks``);
    ``release(done)`` puts them back and, for a step done (not undone), runs the post-hooks (the
    optimizer's own first)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._held: dict[str, list[tuple[dict, dict]]] = {}  # "pre"/"post" -> (a hooks' dict, what it held)

    @staticmethod
    def _dicts(optimizer: torch.optim.Optimizer) -> dict[str, tuple]:
        module = importlib.import_module("torch.optim.optimizer")  # not an attribute of torch.optim
        return {"pre": (getattr(module, "_global_optimizer_pre_hooks", None),
                        getattr(optimizer, "_optimizer_step_pre_hooks", None)),
                "post": (getattr(optimizer, "_optimizer_step_post_hooks", None),
                         getattr(module, "_global_optimizer_post_hooks", None))}

    @classmethod
    def has_pre_hooks(cls, optimizer: torch.optim.Optimizer) -> bool:
        return any(cls._dicts(optimizer)["pre"])

    def hold(self) -> None:
        for kind, dicts in self._dicts(self._optimizer).items():
            self._held[kind] = [(hooks, dict(hooks)) for hooks in dicts if hooks is not None]
            for hooks, _ in self._held[kind]:
                hooks.clear()

    def run_pre(self) -> None:
        self._run(self._held.get("pre", ()))

    def release(self, done: bool) -> None:
        held, self._held = self._held, {}
        for hooks, hooks_held in (*held.get("pre", ()), *held.get("post", ())):
            hooks.update(hooks_held)
        if done:
            self._run(held.get("post", ()))

    def _run(self, held: Sequence[tuple[dict, dict]]) -> None:
        for _, hooks_held in held:
            for hook in hooks_held.values():
                hook(self._optimizer, (), {})


def _timed(fn: Callable, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started
