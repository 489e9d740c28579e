"""``harmony_fx.Trainer``: one whole iteration per ``step``, the optimizer on the host, overlapped.

The loss is part of the compiled graph (``loss_fn(model(*inputs), target)``), so the last pack runs
forward, loss and backward as one task per microbatch without its weights leaving the device. Each
pack's weight gradients go to the host once per iteration; as soon as every pack that uses a
parameter has added its share, the host's optimizer updates that parameter on a worker thread while
the device goes on with the backward of the packs before it. The updates are the user's own
``torch.optim`` optimizer, stepped over one group of parameters at a time, so the results and
``optimizer.state_dict()`` equal a plain ``optimizer.step()``.

``max_grad_norm`` needs every gradient before any update (the norm is global), so with clipping the
update runs after the backward, not overlapped with it.

A step is all or nothing. The overlap means some packs are updated while later tasks of the same
iteration may still fail (an error in a task, a device out of memory, Ctrl-C, a non-finite loss
found at the end), so before it updates a pack, the update worker copies that pack's parameters and
their optimizer state (host to host, on the worker, so the copy overlaps the device's backward as
the update does); if the step fails, every pack updated so far is put back from its copy, newest
first, along with the buffers the forward wrote back (BatchNorm statistics) and each parameter's
``.grad``. Deferring the updates to the end instead would keep no copies but would give up the
overlap, the point of per-pack updates. The price is host memory: until the step ends, the copies
of the packs updated so far (at most one more copy of the parameters and optimizer state).

With ``nvme_path`` (and ``host_memory``), the optimizer state of the packs the plan chooses lives
on an NVMe tier between updates (``runtime.tier``): each such pack's update streams it in and out
one parameter at a time, the program's ``READ``/``WRITE`` actions around it (with ``max_grad_norm``,
and on a batch of another size than the example's, the programs update nothing, and the final
update streams each pack in turn; across processes each rank has its own tier, and the ranks agree
on a step once every rank's files are written). Its files follow the
all-or-nothing rule: a step's files count only once the step succeeded and they are all on the
drive, so an undone step needs no copy of that state. ``step`` returns before its last writes end
(they overlap the next step's forward); until they do, the step's copies are kept, and a write
that fails then undoes that step when the next step, ``flush``, a checkpoint or ``close`` finds
out.

Checkpoints (``state_dict``/``load_state_dict``, ``save``/``load``) hold what decides the next
losses: the host master weights and buffers (the model's own tensors, which the compiled packs
read every iteration), the optimizer's state, the step counter and the RNG states. Only the global
generators matter: a recompute replays an RNG state saved by the forward of the same iteration,
and each iteration starts with no saved states.
"""
from __future__ import annotations

import collections
import concurrent.futures
import copy
import inspect
import os
import pathlib
import random
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from harmony_fx.api import HarmonyModule
from harmony_fx.compiler.tier import OptimizerFacts
from harmony_fx.config import CompileOptions, check_option_names, option_names
from harmony_fx.distributed import checkpoint
from harmony_fx.distributed.cluster import Cluster, PeerError, StepFailedElsewhere
from harmony_fx.distributed.updates import CrossProcessUpdates
from harmony_fx.runtime.executor import Runtime, grad_dtype, land
from harmony_fx.runtime.tier import StateTier, on_tier_entry
from harmony_fx.program.actions import Key, KeyKind

__all__ = ["Trainer", "NonFiniteLossError"]

# Stored in every checkpoint; bump when its layout changes.
_CHECKPOINT_FORMAT = "harmony_fx.Trainer"
_CHECKPOINT_VERSION = 1


class _LossModel(nn.Module):
    """``model`` and its loss as one module, so both are captured in one graph.

    ``takes_target``: ``forward(*inputs, target, **keyword_inputs)`` returns ``loss_fn(output,
    target)``; otherwise ``forward(*inputs, **keyword_inputs)`` returns ``loss_fn(output)``, or with
    no ``loss_fn`` the loss the model returns (see ``_loss_of``)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, takes_target: bool) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.takes_target = takes_target

    def forward(self, *args, **kwargs):
        if self.takes_target:
            *inputs, target = args
            return self.loss_fn(self.model(*inputs, **kwargs), target)
        output = self.model(*args, **kwargs)
        return _loss_of(output) if self.loss_fn is None else self.loss_fn(output)


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a model returns: the output itself, its ``.loss`` (Hugging Face), or its ``"loss"``."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise ValueError(
            f"loss_fn=None means the model returns its loss, but it returned a {type(output).__name__}; name the "
            "loss with a one-argument loss_fn (e.g. loss_fn=lambda out: out[1] for nanoGPT's (logits, loss)), "
            "or pass labels so that a Hugging Face model computes .loss.")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"the loss must be a scalar tensor, got {type(loss).__name__} of shape "
                         f"{tuple(getattr(loss, 'shape', ()))}; reduce it (e.g. .mean()) in the model or in loss_fn.")
    return loss


def _takes_target(loss_fn: Callable | None) -> bool:
    """Whether ``loss_fn`` is the two-argument ``(output, target)`` form (the one-argument form
    gets the output alone). A callable whose signature says nothing is taken as two-argument."""
    if loss_fn is None:
        return False
    function = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return True
    required = [p for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) != 1


class Trainer:
    """``trainer.step(batch)`` runs forward, backward and the optimizer step.

    The batch and the loss, in one of three forms:

    * ``loss_fn(output, target)`` (two arguments): ``batch = (inputs, target)``, ``inputs`` a tensor,
      a tuple of positional inputs or a dict of keyword inputs;
    * ``loss_fn=None``: the model returns its loss (a scalar tensor, an output with ``.loss`` as
      Hugging Face models give when passed ``labels``, or a dict with ``"loss"``); ``batch`` is a dict
      of keyword inputs, a tuple of positional inputs, or a tensor;
    * ``loss_fn(output)`` (one argument): the same batches; ``loss_fn`` picks the loss out of what
      the model returns (``lambda out: out[1]`` for nanoGPT's ``(logits, loss)``).

    Inputs are split into microbatches along their batch dims (``batch_dims``, dim 0 by default). The
    batch's loss combines the microbatches' losses as eager computes it on the whole batch: the graph
    says how the loss reduces (a mean over labelled tokens, over elements, a sum); where it cannot
    tell, the microbatch losses are averaged weighted by microbatch size (``loss_reduction="sum"``:
    added). Other options are those of ``harmony_fx.compile``.

    A batch of another size than ``example_batch`` is planned on its first step and kept (see
    ``HarmonyModule.for_batch``); other shape changes are refused. A step whose loss is NaN or
    infinite raises ``NonFiniteLossError`` (a ``FloatingPointError`` and a ``ValueError``) naming the
    step, and leaves the weights and optimizer state as they were; with ``skip_nonfinite=True`` the
    step is skipped instead (nothing updated, its number recorded in ``skipped_steps``) and the
    loss is returned as it is.

    ``atomic=False`` drops that guarantee to save host memory: a step is all or nothing because the
    update worker copies each pack's parameters and optimizer state before updating them (one more
    copy of both: about 12 bytes a parameter with Adam, 13 GB for 1B parameters). Without it, a
    failed step leaves the packs updated before the failure updated (the error says so), and
    ``skip_nonfinite`` is refused.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer, example_batch: Any, *, max_grad_norm: float | None = None,
                 loss_reduction: str = "mean", skip_nonfinite: bool = False, atomic: bool = True,
                 process_group: Any = None, shard_optimizer: bool | None = None,
                 collective_timeout: float | None = None, **options: Any) -> None:
        # before anything else, so that a misspelled max_grad_norm is named as the Trainer's, not CompileOptions'
        own = [name for name, p in inspect.signature(Trainer.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY]
        check_option_names(options, own + list(option_names()), "harmony_fx.Trainer")
        if skip_nonfinite and not atomic:
            raise ValueError("skip_nonfinite=True needs atomic=True: skipping a step puts back the updates the "
                             "backward already made, from the copies atomic=False does not keep")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        model_params = {id(p) for p in model.parameters()}
        foreign = [i for group in optimizer.param_groups for i, p in enumerate(group["params"]) if id(p) not in model_params]
        if foreign:
            raise ValueError(f"the optimizer holds {len(foreign)} parameter(s) that are not the model's; build it "
                             "over model.parameters() (harmony_fx updates the model's own host parameters).")
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.atomic = atomic
        self.skipped_steps: list[int] = []  # the step numbers skipped for a non-finite loss
        self.loss_reduction = loss_reduction
        self._takes_target = _takes_target(loss_fn)
        args, kwargs = self._call_of(example_batch)
        if isinstance(options.get("batch_dims"), dict):
            # the user names the model's own arguments; the loss model takes them as *args, **kwargs
            dims = options["batch_dims"]
            names = list(inspect.signature(model.forward).parameters)
            positional = len(args) - self._takes_target
            args_dims = tuple(dims.get(name, 0) for name in names[:positional]) + (0,) * self._takes_target
            loss_model_dims = {"args": args_dims} if args else {}
            if kwargs:
                loss_model_dims["kwargs"] = {name: dims.get(name, 0) for name in kwargs}
            options = {**options, "batch_dims": loss_model_dims}
        compile_options = CompileOptions(**options)
        if compile_options.nvme_path is not None and shard_optimizer is None:
            shard_optimizer = False  # the tier takes each rank's whole state (sharded state on it: not yet)
        self.cluster = _cluster(process_group, shard_optimizer, collective_timeout)
        if compile_options.nvme_path is not None and self.cluster is not None:
            _check_tier_across(self.cluster, max_grad_norm)
        facts = None
        if compile_options.nvme_path is not None or compile_options.host_memory is not None:
            facts = OptimizerFacts(_state_bytes(optimizer), keeps_copies=atomic, masters_may_move=self.cluster is None)
        self.hm = HarmonyModule(_LossModel(model, loss_fn, self._takes_target), args, kwargs, compile_options,
                                trainer=True, updates=max_grad_norm is None, optimizer=facts)
        (self._loss_name,) = self.hm.signature.model_outputs
        self._groups = self.hm.update_groups()
        # the undo copies' memory, kept from step to step: copying into it costs half of cloning,
        # which faults in fresh pages for every parameter and optimizer state every step
        self._undo_store: dict[int, tuple] = {}
        self._last_hm = self.hm  # the module that ran the last step (one per batch size)
        self.step_count = 0
        self._tier: StateTier | None = None  # the optimizer state on NVMe (nvme_path=)
        self._pending: _PendingStep | None = None  # the last step, until its state is on the tier
        if self.hm.plan.tier_packs:
            names = {id(p): name for name, p in model.named_parameters()}
            path = pathlib.Path(compile_options.nvme_path)
            if self.cluster is not None:
                path = path / f"rank{self.cluster.rank}"  # each rank's own copy of the (replicated) state
            self._tier = StateTier(path, optimizer,
                                   {pack: self._groups[pack] for pack in self.hm.plan.tier_packs}, names,
                                   self.hm.plan.tier_master_packs, compile_options.compute_dtype,
                                   pin_copies=any(d.torch_device.type == "cuda" for d in self.hm.devices))
            self._tier.store_all(self.step_count)  # state the optimizer already holds goes there now
        self._cross: CrossProcessUpdates | None = None
        if self.cluster is not None:
            names = {id(p): name for name, p in model.named_parameters()}
            self.cluster.same_everywhere(
                [(pack, [names[id(p)] for p in params]) for pack, params in sorted(self._groups.items())],
                "how the model is cut into packs; give every rank the same batch size, memory_budget and options "
                "(or the same pack_boundaries)")
            self._cross = CrossProcessUpdates(self.cluster, optimizer, self._groups)

    # ------------------------------------------------------------------ what people look at
    @property
    def plan(self):
        return self.hm.plan

    @property
    def stats(self):
        """The last step's measured figures. With an NVMe tier, its ``tier_bytes``, ``tier_seconds``
        and ``tier_staged_peak`` are filled in once the step is committed, while the next step runs
        (``flush()`` waits for it); reading them does not wait, so logging every step keeps the
        overlap."""
        return self._last_hm.stats

    @property
    def code(self) -> str:
        return self.hm.code

    def explain(self) -> str:
        return self.hm.explain()

    def record_timeline(self, on: bool = True) -> None:
        """Record the next steps' timelines (for ``save_trace`` and ``plot_memory``)."""
        self.hm.record_timeline(on)

    def save_trace(self, path) -> None:
        """The last step's measured timeline as a Chrome trace."""
        self._last_hm.save_trace(path)

    def plot_memory(self, path) -> None:
        """Memory over the last step per device, measured and predicted, as a PNG."""
        self._last_hm.plot_memory(path)

    # ------------------------------------------------------------------ training
    def step(self, batch: tuple) -> torch.Tensor:
        """One iteration on ``batch``; returns the batch's loss. All or nothing: if anything fails
        (including Ctrl-C), the weights, buffers and optimizer state are as before the call."""
        args, kwargs = self._call_of(batch)
        tier = self._tier
        if tier is not None and self.cluster is not None and self.hm.calls.batch_size_of(args, kwargs) is not None:
            raise ValueError(f"Trainer(nvme_path=...) across processes trains on batches of the example's size; this "
                             f"batch has {self.hm.calls.batch_size_of(args, kwargs)} samples (drop the last, smaller "
                             "batch, e.g. DataLoader(drop_last=True)): its packs differ from the tier's files")
        # the tier's files are the example's packs: a batch of another size, cut into other packs,
        # updates nothing in its programs, and its final update streams the tier (``_update_through_tier``)
        hm = self.hm.for_batch(args, kwargs, **({"updates": False} if tier is not None else {}))
        if self._pending is not None and self._pending.io.committed.done():
            self.flush()  # the last step's state is on the tier, or that step is undone and this raises
        groups = self._groups if hm is self.hm else hm.update_groups()
        (loss_name,) = hm.signature.model_outputs
        per_mb = hm.split_inputs(args, kwargs)
        cluster, cross = self.cluster, self._cross
        total = None
        if cluster is not None:
            cluster.begin_step(self.step_count)
            total = cluster.total  # the loss is over every rank's batch
        weights = hm.scalar_weights(loss_name, per_mb, otherwise=lambda: self._size_weights(hm, total), total=total)
        loss_like = hm.output_like(loss_name)
        output_grads = {Key(KeyKind.GRAD, loss_name, mb): torch.full(loss_like.shape, w, dtype=loss_like.dtype)
                        for mb, w in enumerate(weights)}
        undo = _Undo(self.optimizer, [p for group in groups.values() for p in group], hm.compiled.written_buffers(),
                     copies=self.atomic, tier=tier,
                     # with the tier a step's undo lives on until its files are committed, which may be
                     # after the next step's copies: each step's its own then
                     store=self._undo_store if tier is None else None)
        if tier is not None:
            tier.begin(self.step_count)

        def on_tier(runtime: Runtime, what: str, pack: int) -> concurrent.futures.Future:
            runtime.links.on_abort(tier.fail)  # a failed device never hands some updates over
            return tier.read(pack) if what == "read" else tier.write(pack)
        pending: list[concurrent.futures.Future] = []
        arrivals: collections.Counter = collections.Counter()
        landing: collections.defaultdict = collections.defaultdict(list)  # pack -> copies its update waits for
        ready: dict[int, list] = {}  # across processes: packs complete here, waiting for their turn
        arrivals_lock = threading.Lock()
        turn = [0]  # across processes: the next pack, in ``cross.order``, whose collectives may go
        # a worker per step, shut down before the step returns or raises: no update can still be
        # running when the step is undone, and no thread outlives the step
        workers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harmony-update")

        def on_update(runtime: Runtime, pack_index: int, copies) -> None:
            # data-parallel: the gradients are complete once every device has sent its share
            with arrivals_lock:
                arrivals[pack_index] += 1
                landing[pack_index].extend(copies)
                if arrivals[pack_index] < hm.update_arrivals:
                    return
                if cross is None or pack_index not in cross.buffers:
                    params = groups.get(pack_index, [])
                    pending.append(workers.submit(_land_and_update, landing.pop(pack_index), runtime.host_grads,
                                                  self.optimizer, params, undo, tier, pack_index))
                    return
                # every rank issues the packs' collectives in one order, whatever order they finish in
                ready[pack_index] = landing.pop(pack_index)
                while turn[0] < len(cross.order) and cross.order[turn[0]] in ready:
                    pack = cross.order[turn[0]]
                    turn[0] += 1
                    pending.append(workers.submit(_land_and_update_across, ready.pop(pack), runtime.host_grads,
                                                  self.optimizer, undo, cross, pack, tier))

        self._last_hm = hm
        agreed = False  # whether the ranks have exchanged this step's outcome
        if cross is not None:
            cross.bytes.clear()
        try:
            try:
                runtime = hm.run_iteration(per_mb, on_update, output_grads, on_tier if tier is not None else None)
            finally:
                waited_from = time.perf_counter()
                workers.shutdown(wait=True)
                hm.stats.update_exposed_seconds = time.perf_counter() - waited_from
            done = [future.result() for future in pending]  # re-raises an update's error
            hm.stats.update_seconds = sum(seconds for seconds, _ in done)
            hm.stats.tier_wait_seconds = sum(waited for _, waited in done)
            losses = [runtime.host_values[Key(KeyKind.ACT, loss_name, mb)] for mb in range(len(per_mb))]
            shares = [w * loss.detach().float() for w, loss in zip(weights, losses)]
            if cluster is not None:
                if tier is not None:
                    # every rank's files on its drive before the ranks agree: a write failing after
                    # that would leave one rank a step behind the others
                    tier.wait_written()
                everyone, failed = cluster.agree([share.item() for share in shares], failed=False)
                agreed = True
                if failed:
                    raise StepFailedElsewhere(f"Trainer.step: step {self.step_count} failed on rank(s) "
                                              f"{', '.join(map(str, failed))}; it was undone here too")
                shares = [torch.tensor(share, dtype=torch.float32) for share in everyone]
            loss = sum(shares)  # in microbatch order, over every rank's microbatches
            if not torch.isfinite(loss):
                raise NonFiniteLossError(
                    f"Trainer.step: the loss of step {self.step_count} is {loss.item()}; the step was undone "
                    "(weights and optimizer state are as before it). Lower the learning rate, check the batch, "
                    "or pass skip_nonfinite=True to skip such steps.")
            if self.max_grad_norm is not None:
                params = [p for group in groups.values() for p in group]
                seconds = _timed(self._clip_and_update, params, runtime.host_grads, undo)
                hm.stats.update_seconds = hm.stats.update_exposed_seconds = seconds
            elif tier is not None and hm is not self.hm:
                for param in (p for group in groups.values() for p in group):
                    param.grad = runtime.host_grads.get(id(param))
                seconds = _timed(self._update_through_tier, undo)
                hm.stats.update_seconds = hm.stats.update_exposed_seconds = seconds
            if cross is not None:
                cross.commit(write=True)
                hm.stats.network_bytes = dict(cross.bytes)
            if tier is not None:
                tier.wait_committed()  # done already: this step's updates waited for it
                # committed once its last writes are on the device, while the next step runs its forward
                self._pending = _PendingStep(self.step_count, undo, tier.finish(), hm.stats)
        except BaseException as error:
            workers.shutdown(wait=True)  # again: a second Ctrl-C may have cut the first wait short
            if tier is not None:
                tier.abort()
            if cross is not None and not isinstance(error, PeerError):
                self._fail_across(cross, turn[0], agreed, len(per_mb))
            undo.restore()
            if not self.atomic and undo.updated:
                error.add_note(f"harmony_fx: Trainer(atomic=False): {undo.updated} parameter(s) updated before the "
                               "failure keep their update (their optimizer state too); the others are as before")
            previous_undone = self._settle_pending(error)
            if isinstance(error, NonFiniteLossError) and self.skip_nonfinite and not previous_undone:
                self.skipped_steps.append(self.step_count)
                self.step_count += 1
                return loss
            raise
        self.step_count += 1
        return loss

    def flush(self) -> None:
        """Wait until the last step's optimizer state is on the NVMe tier (its commit; a step
        returns before its last writes end, which overlap the next step's forward). If those writes
        failed, that step is undone (weights, optimizer state, ``step_count`` as before it) and
        their error raised. Checkpoints, ``optimizer_state`` and ``close`` flush first."""
        error = self._settle_pending()
        if error is not None:
            raise error

    def _settle_pending(self, failure: BaseException | None = None) -> BaseException | None:
        """Wait for the last step's commit; if it failed, undo that step and return its error (noted
        on ``failure`` too, the error of a step that failed meanwhile)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = pending.io.committed.exception()  # a Ctrl-C here leaves the pending step as it is
        if error is None:
            pending.committed()
            return None
        self._tier.abort_pending()
        if pending.undo is not None:
            pending.undo.restore()
        self.step_count = pending.step
        note = (f"harmony_fx: the optimizer state of step {pending.step} could not be written to the NVMe tier, so "
                f"that step was undone too: weights, optimizer state and step_count ({pending.step}) are as before it")
        for raised in {id(e): e for e in (error, failure) if e is not None}.values():
            raised.add_note(note)
        return error

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A copy of everything the next steps depend on; later steps do not change it."""
        self.flush()
        return {
            "format": _CHECKPOINT_FORMAT,
            "version": _CHECKPOINT_VERSION,
            "step_count": self.step_count,
            "model": self._model_state(),
            # the optimizer's own state_dict shares its state tensors, which updates modify in place
            "optimizer": self._optimizer_state_dict(),
            "rng": _get_rng_states(),
        }

    def _model_state(self, copied: bool = True) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` (``copied``: its tensors cloned), with the fp32 masters on the NVMe
        tier read back into it (host memory holds their bf16 copies)."""
        state = {name: t.detach().clone() if copied else t for name, t in self.model.state_dict().items()}
        if self._tier is not None and self._tier.masters:
            for name, param in self.model.named_parameters(remove_duplicate=False):  # a tied weight: each name
                if id(param) in self._tier.masters and name in state:
                    state[name] = self._tier.stored_master(param)
        return state

    def _model_state_like(self) -> dict[str, torch.Tensor]:
        """The shapes and dtypes of ``_model_state()``, on the meta device (nothing read)."""
        state = {name: torch.empty_like(t, device="meta") for name, t in self.model.state_dict().items()}
        masters = self._tier.masters if self._tier is not None else frozenset()
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if name in state and id(param) in masters:  # its master's dtype: the gradient's
                state[name] = torch.empty_like(param, device="meta", dtype=grad_dtype(param))
        return state

    def _optimizer_state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()``, copied, with the state on the NVMe tier read back into it."""
        state_dict = copy.deepcopy(self.optimizer.state_dict())
        if self._tier is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            for index, param in enumerate(params):  # the indices torch's state_dict gives parameters
                stored = self._tier.stored(param)
                if stored:
                    state_dict["state"].setdefault(index, {}).update(stored)  # fresh tensors, read now
        return state_dict

    def optimizer_state(self, param: nn.Parameter) -> dict[str, Any]:
        """The optimizer's whole state for ``param``: what host memory holds, and what is on the
        NVMe tier (read back; between steps host memory holds only the first)."""
        self.flush()
        state = dict(self.optimizer.state.get(param, {}))
        if self._tier is not None and id(param) in self._tier.params:
            state.update(self._tier.stored(param))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict`` in place: the values are copied into the existing master tensors,
        which the compiled packs hold. A checkpoint of another model is refused before anything
        changes."""
        if state_dict.get("format") != _CHECKPOINT_FORMAT or state_dict.get("version") != _CHECKPOINT_VERSION:
            raise ValueError(f"not a {_CHECKPOINT_FORMAT} checkpoint of version {_CHECKPOINT_VERSION} "
                             f"(format {state_dict.get('format')!r}, version {state_dict.get('version')!r})")
        _check_same_model(self._model_state_like(), state_dict["model"])
        self.flush()
        if self._tier is not None:
            # the fp32 masters the tier holds: what the model loads into, and the dtype the optimizer
            # casts its state to; store_all moves them back
            self._tier.masters_to_host()
        try:
            # the optimizer first: it checks its parameter groups before changing anything
            self.optimizer.load_state_dict(state_dict["optimizer"])
        except BaseException:
            if self._tier is not None:
                self._tier.masters_from_host()
            raise
        self.model.load_state_dict(state_dict["model"])  # copy_ under no_grad: the tensors stay the same objects
        _set_rng_states(state_dict["rng"])
        self.step_count = state_dict["step_count"]
        if self._tier is not None:
            self._tier.store_all(self.step_count)  # the loaded state leaves host memory for the tier

    def save(self, path: str | os.PathLike) -> None:
        """A checkpoint. Across processes, or when ``path`` is a directory: a folder per step under
        ``path`` and a ``latest`` pointer (``torch.distributed.checkpoint``; see
        ``distributed.checkpoint``), readable at any number of processes. Otherwise one file:
        ``state_dict()`` written atomically (a temporary file in the same directory, so the rename
        stays on one file system, renamed over ``path``: a crash mid-write leaves the previous
        checkpoint whole)."""
        if self.cluster is not None or os.path.isdir(path):
            checkpoint.save(self, path)
            return
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                                   suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(self.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the checkpoint
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's file is private; a checkpoint is an ordinary file
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Restore this trainer from what ``save`` wrote: a file, a step folder, or a folder of step
        folders (the one its ``latest`` names), written by any number of processes."""
        if os.path.isdir(path):
            checkpoint.load(self, path)
            return
        # everything in a checkpoint is tensors and plain Python values: no pickled code runs
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def close(self) -> None:
        """Wait for the last step's state to reach the NVMe tier (``flush``), put the fp32 masters
        the tier held back into the model's parameters (which held their bf16 copies), and stop the
        device's stream threads (each step's update worker stops with the step)."""
        try:
            self.flush()
            if self._tier is not None:
                self._tier.masters_to_host()
        finally:
            self.hm.close()

    def _call_of(self, batch: Any) -> tuple[tuple, dict]:
        """The loss model's ``(args, kwargs)`` for ``batch`` (see the class docstring)."""
        if self._takes_target:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise ValueError("with a two-argument loss_fn(output, target), a batch is (inputs, target): inputs a "
                                 "tensor, a tuple of positional inputs or a dict of keyword inputs. For a model that "
                                 "returns its own loss, pass loss_fn=None and the batch alone.")
            inputs, target = batch
            args, kwargs = _as_call(inputs)
            return (*args, target), kwargs
        return _as_call(batch)

    def _size_weights(self, hm: HarmonyModule, total: Callable[[float], float] | None = None) -> list[float]:
        """Microbatch weights where the graph does not say how the loss reduces: by the sizes the
        batch was actually cut into (mean, over every rank's batch: ``total``), or all 1 (sum)."""
        sizes = [size or 1 for size in hm.mb_sizes]
        if self.loss_reduction == "sum":
            return [1.0] * len(sizes)
        whole = total(sum(sizes)) if total is not None else sum(sizes)
        return [size / whole for size in sizes]

    def _clip_and_update(self, params: Sequence[nn.Parameter], host_grads: dict, undo: "_Undo") -> None:
        """``max_grad_norm``: every gradient first (summed over the ranks), the global norm, then the
        update."""
        cross = self._cross
        if cross is None:
            for param in params:
                param.grad = host_grads.get(id(param))
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            if self._tier is None:
                _update(self.optimizer, None, undo)
            else:
                self._update_through_tier(undo)
            return
        for pack in cross.order:
            cross.reduce(pack, [host_grads.get(id(p)) for p in cross.buffers[pack].params])
        stepped = [q for pack in cross.order for q in cross.updated_params(cross.buffers[pack].params)]
        grads = [q.grad for q in stepped if q.grad is not None]
        squares = sum(float(g.double().pow(2).sum()) for g in grads)
        norm = (self.cluster.total(squares) if self.cluster.shard_optimizer else squares) ** 0.5
        coefficient = self.max_grad_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coefficient < 1:
            torch._foreach_mul_(grads, coefficient)
        _update(self.optimizer, None, undo)
        for pack in cross.order:
            cross.gather(pack)

    def _update_through_tier(self, undo: "_Undo") -> None:
        """The step's update after the backward, with optimizer state on the NVMe tier, where no
        program reads or writes it: clipping needs every gradient before any update, and a batch of
        another size than the example's is cut into other packs than the tier's files. Each tiered
        pack streams through its update in turn, the next one's read issued before this one steps
        (as the programs issue theirs, one pack ahead); then the rest."""
        tier = self._tier
        tier.wait_committed()  # the last step's files are the ones to read, and its undo copies go
        packs = sorted(tier.packs)
        opened = tier.read(packs[0]) if packs else None
        for index, pack in enumerate(packs):
            opened.result()
            if index + 1 < len(packs):
                opened = tier.read(packs[index + 1])
            tier.update(pack, lambda stepped: _update(self.optimizer, stepped, undo))
        rest = [p for group in self.optimizer.param_groups for p in group["params"] if id(p) not in tier.params]
        if rest:
            _update(self.optimizer, rest, undo)

    def _fail_across(self, cross: CrossProcessUpdates, taken: int, agreed: bool, microbatches: int) -> None:
        """This rank's step failed: it still takes its part in the collectives its peers wait for
        (the packs it had not reached, the gathers, the agreement), so that they undo the step too."""
        if self.max_grad_norm is None:
            for pack in cross.order[taken:]:
                cross.stand_in(pack)
        cross.commit(write=False)
        if not agreed:
            self.cluster.agree([0.0] * microbatches, failed=True)


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    """A model's ``(args, kwargs)`` from a dict of keyword inputs, a tuple/list of positional ones, or
    one tensor."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _check_same_model(expected: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    missing = sorted(expected.keys() - loaded.keys())
    unexpected = sorted(loaded.keys() - expected.keys())
    mismatched = [f"{name}: checkpoint {tuple(loaded[name].shape)} {loaded[name].dtype}, "
                  f"model {tuple(t.shape)} {t.dtype}"
                  for name, t in expected.items()
                  if name in loaded and (loaded[name].shape != t.shape or loaded[name].dtype != t.dtype)]
    problems = ([f"missing from the checkpoint: {', '.join(missing)}"] if missing else []) + \
               ([f"not in the model: {', '.join(unexpected)}"] if unexpected else []) + mismatched
    if problems:
        raise ValueError("the checkpoint is of a different model; " + "; ".join(problems))


def _get_rng_states() -> dict[str, Any]:
    """Every global generator a model or data pipeline commonly draws from. Stored as tensors and
    plain Python values, so ``torch.load(weights_only=True)`` reads them back."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    # only when CUDA is in use: asking for its states would otherwise initialise it
    if torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        _, key, pos, has_gauss, gauss = numpy.random.get_state()
        states["numpy"] = (key.tolist(), pos, has_gauss, gauss)  # a list, not an ndarray: weights_only
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))  # torch.load may hand back lists for tuples
    if "cuda" in states and torch.cuda.is_available():  # a GPU run resumed on a CPU has no CUDA RNG to set
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = _numpy()
    if numpy is not None and "numpy" in states:
        key, pos, has_gauss, gauss = states["numpy"]
        numpy.random.set_state(("MT19937", numpy.array(key, dtype=numpy.uint32), pos, has_gauss, gauss))


def _numpy():
    try:
        import numpy
    except ImportError:  # optional: without numpy there is no numpy RNG to keep
        return None
    return numpy


def _timed(fn: Callable, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def _state_bytes(optimizer: torch.optim.Optimizer) -> Callable[[nn.Parameter], int]:
    """Bytes of the optimizer's state tensors for a parameter, the ones the NVMe tier takes
    (``runtime.tier.on_tier_entry``), known before the first step makes them: per parameter group,
    an optimizer of the same class and settings steps a small parameter once, and the state it makes
    per element scales to each parameter."""
    per_element: dict[int, float] = {}
    accepted = inspect.signature(type(optimizer).__init__).parameters
    for index, group in enumerate(optimizer.param_groups):
        settings = {k: v for k, v in group.items() if k != "params" and k in accepted}
        dtype = group["params"][0].dtype if group["params"] else torch.float32
        probe = nn.Parameter(torch.zeros(8, dtype=dtype))
        probe.grad = torch.zeros_like(probe)
        try:
            twin = type(optimizer)([probe], **settings)
            twin.step()
        except Exception as error:  # noqa: BLE001 - any optimizer; say which one could not be sized
            raise ValueError(f"nvme_path=/host_memory=: cannot tell how much state {type(optimizer).__name__} keeps "
                             f"(stepping a copy of it failed: {error}); train without the tier") from error
        per_element[index] = sum(v.numel() * v.element_size() for v in twin.state[probe].values()
                                 if on_tier_entry(v)) / probe.numel()
    group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return lambda param: int(per_element.get(group_of.get(id(param)), 0.0) * param.numel())


class NonFiniteLossError(FloatingPointError, ValueError):
    """A step's loss is NaN or infinite (the step was undone, or skipped with ``skip_nonfinite``)."""


class _PendingStep:
    """A step that returned while its last writes to the NVMe tier go on: what undoes it is kept
    until it is committed, and then its tier figures go to its stats."""

    def __init__(self, step: int, undo: "_Undo", io, stats) -> None:
        self.step, self.undo, self.io, self.stats = step, undo, io, stats
        io.committed.add_done_callback(lambda committed: committed.exception() is None and self.committed())

    def committed(self) -> None:
        """Once the step is committed (its future's callback, or whoever waited for it first)."""
        self.undo = None  # its copies leave host memory
        stats, io = self.stats, self.io
        stats.tier_bytes, stats.tier_seconds, stats.tier_staged_peak = dict(io.bytes), io.seconds, io.peak_staged


class _Undo:
    """What a step changes on the host, kept so that a failed step can be put back (see the module
    docstring): ``save`` runs on the update worker right before each update."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                 buffers: Sequence[torch.Tensor], copies: bool = True, tier: StateTier | None = None,
                 store: dict[int, tuple] | None = None) -> None:
        self.optimizer = optimizer
        # per parameter (its id): the tensors its copies were made in last time, written into again
        self.store = {} if store is None else store
        self.copies = copies  # False (Trainer(atomic=False)): parameters and optimizer state are not kept
        # the NVMe tier: its committed file is the copy of the tensor state (and fp32 masters) it holds
        self.tier = tier
        self.updated = 0      # parameters updated without a copy
        # taken at the start: .grad is replaced (not written into) as each pack's gradients arrive
        self.grads = [(param, param.grad) for param in params]
        self.buffers = [(buffer, buffer.clone()) for buffer in buffers]
        self.saved: list[tuple[nn.Parameter, torch.Tensor | None, dict | None]] = []
        # parameters updated whose fp32 master is on the tier: the committed file restores their
        # bf16 copies, so they are put back even without copies (atomic=False)
        self.tiered_masters: list[nn.Parameter] = []

    def save(self, params: Sequence[nn.Parameter]) -> None:
        tier = self.tier
        masters = tier.masters if tier is not None else frozenset()
        self.tiered_masters += [param for param in params if id(param) in masters]
        if not self.copies:
            self.updated += sum(id(param) not in masters for param in params)
            return
        for param in params:
            state = self.optimizer.state.get(param)
            tiered = tier is not None and id(param) in tier.params
            kept_data, kept_state = self.store.get(id(param), (None, {}))
            copied = None if state is None else {
                k: _copy_into(kept_state.get(k), v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                for k, v in state.items() if not (tiered and on_tier_entry(v))}
            data = None if id(param) in masters else _copy_into(kept_data, param.detach())
            self.store[id(param)] = (data, copied or {})
            self.saved.append((param, data, copied))

    @torch.no_grad()
    def restore(self) -> None:
        for param in self.tiered_masters:
            param.copy_(self.tier.stored_master(param))  # the bf16 copy of the master the step read
        self.tiered_masters.clear()
        for param, data, state in reversed(self.saved):
            if data is not None:
                param.copy_(data)
            if state is None:
                self.optimizer.state.pop(param, None)  # it had no state before this step
            else:  # fresh tensors: the kept ones are written into again by the next step's copies
                self.optimizer.state[param] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                               for k, v in state.items()}
        self.saved.clear()
        for buffer, data in self.buffers:
            buffer.copy_(data)
        for param, grad in self.grads:
            param.grad = grad


def _copy_into(kept: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into ``kept`` where it has its shape, dtype and device, else a clone."""
    if kept is not None and kept.shape == value.shape and kept.dtype == value.dtype and kept.device == value.device:
        return kept.copy_(value)
    return value.clone()


def _check_tier_across(cluster: Cluster, max_grad_norm: float | None) -> None:
    """Across processes, the NVMe tier takes replicated optimizer state, updated per pack."""
    if cluster.shard_optimizer:
        raise ValueError("nvme_path= across processes keeps each rank's whole optimizer state on its own tier: "
                         "pass shard_optimizer=False, or leave it out (sharded state on the tier is not supported yet)")
    if max_grad_norm is not None:
        raise ValueError("nvme_path= across processes needs the per-pack updates, which max_grad_norm turns off "
                         "(in one process the tier then streams through the final update); clip without the "
                         "tier, or train in one process")


def _cluster(process_group, shard_optimizer: bool | None, timeout: float | None) -> Cluster | None:
    """The processes to train across: ``process_group``, else the default group if there is one
    with more than one process; ``None``: this process alone."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            if shard_optimizer:
                raise ValueError("shard_optimizer=True shards the optimizer over processes; this process trains "
                                 "alone (torch.distributed is not initialised, or has one process)")
            return None
    return Cluster(process_group, shard_optimizer, timeout)


def _land_and_update_across(copies, host_grads: dict, optimizer: torch.optim.Optimizer, undo: "_Undo",
                            cross: CrossProcessUpdates, pack: int, tier: StateTier | None = None) -> tuple[float, float]:
    """``_land_and_update`` across processes: the pack's gradients summed over the ranks first
    (a pack on the NVMe ``tier``: then streamed through its update as in one process)."""
    tier_waited = land(copies)
    grads = [host_grads.get(id(p)) for p in cross.buffers[pack].params]
    if tier is not None:
        tier_waited += _timed(tier.wait_committed)
    started = time.perf_counter()
    if tier is not None and pack in tier.packs:
        cross.step(pack, grads, lambda stepped: tier.update(pack, lambda one: _update(optimizer, one, undo)))
    else:
        cross.step(pack, grads, lambda stepped: _update(optimizer, stepped, undo))
    return time.perf_counter() - started, tier_waited


def _land_and_update(copies, host_grads: dict, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                     undo: _Undo, tier: StateTier | None = None, pack: int | None = None) -> tuple[float, float]:
    """On the update worker: wait for the weight-gradient copies, which sums them on the host, then
    step ``params`` with their summed gradients (a pack on the NVMe ``tier``: one parameter at a
    time, its state streaming in and out); returns the seconds the step itself took and those it
    waited for the tier. With a tier, the last step is committed first: only then are its copies
    for undoing it let go, so two steps' copies are never held at once."""
    tier_waited = land(copies)
    for param in params:
        param.grad = host_grads.get(id(param))
    if tier is not None:
        tier_waited += _timed(tier.wait_committed)
    if tier is not None and pack in tier.packs:
        return _timed(tier.update, pack, lambda stepped: _update(optimizer, stepped, undo)), tier_waited
    return _timed(_update, optimizer, params, undo), tier_waited


def _update(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter] | None, undo: _Undo) -> None:
    """Save what the update changes, then step ``params`` (``None``: every parameter)."""
    if params is None:
        undo.save([p for group in optimizer.param_groups for p in group["params"]])
        optimizer.step()
    else:
        undo.save(params)
        _step_subset(optimizer, params)


def _step_subset(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
