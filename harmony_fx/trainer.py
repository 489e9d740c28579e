"""``harmony_fx.Trainer``: one whole iteration per ``step``, the optimizer on the host, overlapped.

The loss is part of the compiled graph (``training.loss``). Each pack's weight gradients go to the
host once per iteration; as soon as every pack that uses a parameter has added its share, the
host's optimizer updates that parameter on a worker thread while the device goes on with the
backward of the packs before it (``training.updates``). ``max_grad_norm`` needs every gradient
before any update (the norm is global), so with clipping the update runs after the backward, not
overlapped with it.

A step is all or nothing (``training.transaction``): if anything fails, the weights, buffers and
optimizer state are as before it, and every ``param.grad`` is ``None``. The weight gradients land
on the host in the tensors that held the last step's (one set of them, not two), so after a
successful step ``param.grad`` holds that step's gradients until the next step writes into it.

With ``nvme_path`` (and ``host_memory``), the optimizer state of the packs the plan chooses lives
on an NVMe tier between updates (``runtime.tier``): each such pack's update streams it in and out
one parameter at a time, the program's ``READ``/``WRITE`` actions around it (with ``max_grad_norm``,
and on a batch of another size than the example's, the programs update nothing, and the final
update streams each pack in turn; across processes each rank has its own tier, and the ranks agree
on a step once every rank's files are written). ``step`` returns before its last writes end (they
overlap the next step's forward); a write that fails then undoes that step when the next step,
``flush``, a checkpoint or ``close`` finds out.

Checkpoints: ``training.checkpoint`` (one file) and ``training.checkpoint_folders`` (folders any
number of processes read).
"""
from __future__ import annotations

import inspect
import os
import pathlib
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from harmony_fx.api import HarmonyModule, refuse_compiled_modules
from harmony_fx.compiler.driver import refuse_meta_state
from harmony_fx.compiler.host_memory import OptimizerFacts
from harmony_fx.config import CompileOptions, check_option_names, option_names
from harmony_fx.distributed.cluster import Cluster
from harmony_fx.distributed.updates import CrossProcessUpdates
from harmony_fx.runtime.host import GradientBuffers
from harmony_fx.runtime.tier import StateTier, on_tier_entry
from harmony_fx.training import checkpoint_folders
from harmony_fx.training.checkpoint import TrainingState, load_file, save_file
from harmony_fx.training.loss import BatchLoss, LossModel
from harmony_fx.training.stats import StepStats
from harmony_fx.training.transaction import PendingStep, StepTransaction, Undo
from harmony_fx.training.updates import PackUpdates, StepHooks, Updater, clear_stale_grads, steps_per_parameter

__all__ = ["Trainer", "NonFiniteLossError"]


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
        if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
            raise TypeError(f"harmony_fx.Trainer steps an optimizer over the model's parameters (a torch.optim "
                            f"optimizer, e.g. torch.optim.AdamW(model.parameters())); got {optimizer!r}. To run the "
                            "forward and backward without one, use harmony_fx.compile(model, ...) and a loop of your own.")
        if skip_nonfinite and not atomic:
            raise ValueError("skip_nonfinite=True needs atomic=True: skipping a step puts back the updates the "
                             "backward already made, from the copies atomic=False does not keep")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise TypeError(f"{type(optimizer).__name__} steps with a closure that evaluates the loss again "
                            "(optimizer.step(closure)); harmony_fx.Trainer runs the forward and backward once a "
                            "step and updates each pack as its gradients arrive: use an optimizer whose step "
                            "takes no closure (SGD, Adam, AdamW, ...), or harmony_fx.compile with your own loop.")
        if getattr(optimizer, "is_second_order", False) is True:  # timm's convention (AdaHessian)
            raise TypeError(f"{type(optimizer).__name__} is a second-order optimizer: its step differentiates the "
                            "gradients again (Hessian-vector products, after loss.backward(create_graph=True)); "
                            "harmony_fx.Trainer computes first-order gradients once a step and keeps no graph of "
                            "them: use a first-order optimizer (AdamW, SGD, ...).")
        refuse_meta_state(model)  # named as the user names it, before the loss wraps it
        refuse_compiled_modules(model, "harmony_fx.Trainer")
        # what is captured and trained: the model, and a loss_fn that is a module (learnable loss weights)
        captured = {id(p) for p in LossModel(model, loss_fn).parameters()}
        foreign = [i for group in optimizer.param_groups for i, p in enumerate(group["params"]) if id(p) not in captured]
        if foreign:
            raise ValueError(f"the optimizer holds {len(foreign)} parameter(s) that are neither the model's nor its "
                             "loss_fn's (an nn.Module); build it over model.parameters() (and the loss module's), or "
                             "make what they belong to part of the model (harmony_fx updates the host parameters "
                             "of what it captures).")
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        # each pack updated as its gradients arrive: not with a global norm to clip by, nor with an
        # optimizer whose step is more than each parameter's own update, nor with step pre-hooks,
        # which see every gradient before the step (stepped once, at the end)
        self._per_pack = (max_grad_norm is None and steps_per_parameter(optimizer)
                          and not StepHooks.has_pre_hooks(optimizer))
        self.skip_nonfinite = skip_nonfinite
        self.atomic = atomic
        self.skipped_steps: list[int] = []  # the step numbers skipped for a non-finite loss
        self.loss_reduction = loss_reduction
        self._loss_model = LossModel(model, loss_fn)
        args, kwargs = self._loss_model.call_of(example_batch)
        if isinstance(options.get("batch_dims"), dict):
            # the user names the model's own arguments; the loss model takes them as *args, **kwargs
            options = {**options, "batch_dims": self._loss_model.batch_dims(options["batch_dims"], args, kwargs)}
        compile_options = CompileOptions(**options)
        if compile_options.nvme_path is not None and not steps_per_parameter(optimizer):
            raise ValueError(f"nvme_path= streams the optimizer state through each parameter's own update, one "
                             f"parameter at a time, which {type(optimizer).__name__} (not one of torch.optim's) may not "
                             "be: use a torch.optim optimizer with the tier, or train without nvme_path")
        if compile_options.nvme_path is not None and shard_optimizer is None:
            shard_optimizer = False  # the tier takes each rank's whole state (sharded state on it: not yet)
        self.cluster = _cluster(process_group, shard_optimizer, collective_timeout)
        if self.cluster is not None:  # every rank starts from rank 0's model, as under DDP (Cluster.take_rank0s)
            self.cluster.take_rank0s([*self._loss_model.parameters(), *self._loss_model.buffers()],
                                     "the start from rank 0's parameters and buffers")
        if compile_options.nvme_path is not None and self.cluster is not None:
            _check_tier_across(self.cluster, self._per_pack)
        facts = None
        if compile_options.nvme_path is not None or compile_options.host_memory is not None:
            facts = OptimizerFacts(_state_bytes(optimizer), keeps_copies=atomic, masters_may_move=self.cluster is None)
        self.hm = HarmonyModule(self._loss_model, args, kwargs, compile_options,
                                trainer=True, updates=self._per_pack, optimizer=facts)
        self._groups = self.hm.update_groups()
        # the undo copies' memory, kept from step to step: copying into it costs half of cloning,
        # which faults in fresh pages for every parameter and optimizer state every step
        self._undo_store: dict[int, tuple] = {}
        # the host tensors each step's weight gradients land in, the last step's .grad. Across
        # processes, replicated: views of each pack's flat buffer, all-reduced in place
        # (distributed.updates); sharded, nothing lends them, and the gradients land in new tensors
        self._grad_buffers = GradientBuffers()
        self._last_hm = self.hm  # the module that ran the last step (one per batch size)
        self._stats: StepStats | None = None  # the last step's, once its iteration ran
        self.step_count = 0
        self._tier: StateTier | None = None  # the optimizer state on NVMe (nvme_path=)
        self._pending: PendingStep | None = None  # the last step, until its state is on the tier
        names = {id(p): name for name, p in model.named_parameters()}
        if self.hm.plan.tier_packs:
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
            self.cluster.same_everywhere(
                [(pack, [names[id(p)] for p in params]) for pack, params in sorted(self._groups.items())],
                "how the model is cut into packs, planned for each rank's example batch; give every rank an example "
                "batch of the same shapes (batch size and sequence length: a first batch padded alike on every rank, "
                "e.g. padding='max_length' or pad_to_multiple_of; later batches may differ), the same memory_budget "
                "and options (or the same pack_boundaries)")
            self._cross = CrossProcessUpdates(self.cluster, optimizer, self._groups, self._grad_buffers,
                                              pin_memory=any(d.torch_device.type == "cuda" for d in self.hm.devices))
        self._updater = Updater(optimizer, max_grad_norm, self._tier, self._cross, self._grad_buffers)
        self._state = TrainingState(model, optimizer, self._tier, self._cross, self.cluster)
        # the model's and optimizer's own state_dict() read the tier too (the hooks hold the trainer weakly)
        flush = weakref.WeakMethod(self.flush)
        self._tier_hooks = self._state.hook_tier(lambda: flush()()) if self._tier is not None else []

    # ------------------------------------------------------------------ what people look at
    @property
    def plan(self):
        return self.hm.plan

    @property
    def stats(self) -> StepStats:
        """The last step's measured figures: the iteration's (bytes moved, peaks, busy time) and the
        step's own (the update's time, bytes sent to other processes, the NVMe tier's figures).
        With an NVMe tier, ``tier_bytes``, ``tier_seconds`` and ``tier_staged_peak`` are filled in
        once the step is committed, while the next step runs (``flush()`` waits for it); reading
        them does not wait, so logging every step keeps the overlap."""
        return self._stats if self._stats is not None else StepStats(self._last_hm.stats)

    @property
    def code(self) -> str:
        return self.hm.code

    def explain(self) -> str:
        return self.hm.explain()

    def record_timeline(self, on: bool = True, *, memory: bool = True) -> None:
        """Record the next steps' timelines (for ``save_trace`` and ``plot_memory``); ``memory=False``:
        the spans alone, without counting a HostDevice's memory (see ``HarmonyModule.record_timeline``)."""
        self.hm.record_timeline(on, memory=memory)

    def save_trace(self, path) -> None:
        """The last step's measured timeline as a Chrome trace."""
        self._last_hm.save_trace(path)

    def plot_memory(self, path) -> None:
        """Memory over the last step per device, measured and predicted, as a PNG."""
        self._last_hm.plot_memory(path)

    # ------------------------------------------------------------------ training
    def step(self, batch: tuple, *, loss_scale: float = 1.0,
             microbatch_weights: Sequence[float] | None = None) -> torch.Tensor:
        """One iteration on ``batch``; returns the batch's loss, times ``loss_scale`` as its gradients
        are (for a caller that adds up its batches' losses, as transformers' Trainer does under
        gradient accumulation where the model's loss ignores ``num_items_in_batch``).
        ``microbatch_weights``: each microbatch's loss weight in the batch's (one per microbatch, in
        order), where the graph's own weights (the whole batch's mean, say) are not what the caller
        computes: a caller whose microbatches are its own batches, each loss a mean of its own,
        adding them up (weights of 1). All or
        nothing: if anything fails (including Ctrl-C), the weights, buffers and optimizer state are
        as before the call, and every ``param.grad`` is ``None``. After it, ``param.grad`` holds this
        step's gradients (as the optimizer stepped them, clipped with ``max_grad_norm``), in tensors
        the next step writes its gradients into."""
        if self._per_pack and not steps_per_parameter(self.optimizer):
            raise ValueError(f"{type(self.optimizer).__name__}.step was replaced on the optimizer after the Trainer "
                             "was made; the Trainer steps it once per pack, which would run the new step once a pack: "
                             "replace it before making the Trainer (which then steps it once, after the backward), "
                             "or set optimizer.harmony_steps_per_parameter = True if it is each parameter's own update")
        if self._per_pack and StepHooks.has_pre_hooks(self.optimizer):
            raise ValueError("a step pre-hook was registered (on the optimizer, or torch's global one) after the "
                             "Trainer was made, which updates each pack during the backward, before the pre-hook "
                             "could see every gradient: register it before making the Trainer (which then steps "
                             "the optimizer once, after the backward, the pre-hooks right before)")
        if self._cross is not None:  # before any collective: hooks added since the Trainer was made too
            self._cross.refuse_gradient_hooks(self.model)
        args, kwargs = self._loss_model.call_of(batch)
        hm = self._module_for(args, kwargs)
        if self._pending is not None and self._pending.io.committed.done():
            self.flush()  # the last step's state is on the tier, or that step is undone and this raises
        groups = self._groups if hm is self.hm else hm.update_groups()
        per_mb = hm.split_inputs(args, kwargs)
        if microbatch_weights is not None and len(microbatch_weights) != len(per_mb):
            raise ValueError(f"Trainer.step: microbatch_weights has {len(microbatch_weights)} weight(s) for the "
                             f"batch's {len(per_mb)} microbatches (sizes {list(hm.mb_sizes)}): give one per microbatch")
        undo = Undo(self.optimizer, [p for group in groups.values() for p in group], hm.compiled.written_buffers(),
                    copies=self.atomic, tier=self._tier,
                    # with the tier a step's undo lives on until its files are committed, which may be
                    # after the next step's copies: each step's its own then
                    store=self._undo_store if self._tier is None else None)
        transaction = StepTransaction(self.step_count, undo, self._tier, self.cluster, self._cross)
        batch_loss = BatchLoss(hm, per_mb, self.loss_reduction, transaction.total, loss_scale, microbatch_weights)
        updates = PackUpdates(self._updater, groups, hm.update_arrivals, undo)
        clear_stale_grads(self.optimizer, groups)  # frozen since the last step: no gradient, as eager's
        self._last_hm, self._stats = hm, None
        loss = None
        hooks = StepHooks(self.optimizer)
        try:
            hooks.hold()
            with updates:
                runtime = hm.run_iteration(per_mb, updates.on_pack, batch_loss.output_grads,
                                           self._on_tier if self._tier is not None else None, self._grad_buffers)
                updates.finish(runtime)
            stats = self._stats = StepStats(hm.stats, update_exposed_seconds=updates.exposed_seconds)
            stats.update_seconds, stats.tier_wait_seconds = updates.results()  # re-raises an update's error
            # in microbatch order, over every rank's microbatches
            loss = sum(transaction.agree(batch_loss.shares(runtime.host_values)))
            if not torch.isfinite(loss):
                raise NonFiniteLossError(
                    f"Trainer.step: the loss of step {self.step_count} is {loss.item()}; the step was undone "
                    "(weights and optimizer state are as before it). Lower the learning rate, check the batch, "
                    "or pass skip_nonfinite=True to skip such steps.", loss.item())
            # the programs update nothing with clipping (the norm is global), nor with the tier on a
            # batch cut into other packs than its files
            if not self._per_pack or (self._tier is not None and hm is not self.hm):
                started = time.perf_counter()
                stats.grad_norm = self._updater.update_all(groups, runtime.host_grads, undo, hooks.run_pre)
                stats.update_seconds = stats.update_exposed_seconds = time.perf_counter() - started
            if self.cluster is not None:
                # each rank updated its buffers (BatchNorm statistics) from its own share: rank 0's
                # everywhere, as DDP's broadcast_buffers, so that the replicas stay one model
                for buffer in hm.compiled.written_buffers():
                    self.cluster.broadcast(buffer, "rank 0's buffers the forward updated")
            stats.undo_seconds = undo.seconds
            self._pending = transaction.commit(stats)
            hooks.release(done=True)
        except BaseException as error:
            hooks.release(done=False)
            updates.shutdown()
            # with clipping no pack took its turn in the backward: the ranks' collectives start after they agree
            transaction.fail(error, updates.turns if self._per_pack else None, len(per_mb))
            previous_undone = self._settle_pending(error)
            if isinstance(error, NonFiniteLossError) and self.skip_nonfinite and not previous_undone:
                self.skipped_steps.append(self.step_count)
                self.step_count += 1
                return loss
            raise
        self.step_count += 1
        return loss

    def microbatch_sizes(self, batch: tuple) -> list[int | None]:
        """The samples of each microbatch ``step`` cuts ``batch`` into, in order (``[None]``: one, the
        whole batch); a batch of a size not seen before is planned here, as ``step`` would plan it."""
        args, kwargs = self._loss_model.call_of(batch)
        return list(self._module_for(args, kwargs).mb_sizes)

    def _module_for(self, args: tuple, kwargs: dict) -> HarmonyModule:
        """The compiled module for this batch: the example's, or one planned for its size. The
        tier's files are the example's packs: a batch of another size, cut into other packs,
        updates nothing in its programs, and its final update streams the tier."""
        if self._tier is None:
            return self.hm.for_batch(args, kwargs)
        size = self.hm.calls.batch_size_of(args, kwargs)
        if self.cluster is not None and size is not None:
            raise ValueError(f"Trainer(nvme_path=...) across processes trains on batches of the example's size; this "
                             f"batch has {size} samples (drop the last, smaller batch, e.g. "
                             "DataLoader(drop_last=True)): its packs differ from the tier's files")
        return self.hm.for_batch(args, kwargs, updates=False)

    def _on_tier(self, runtime, what: str, pack: int):
        runtime.links.on_abort(self._tier.fail)  # a failed device never hands some updates over
        return self._tier.read(pack) if what == "read" else self._tier.write(pack)

    def flush(self) -> None:
        """Wait until the last step's optimizer state is on the NVMe tier (its commit; a step
        returns before its last writes end, which overlap the next step's forward). If those writes
        failed, that step is undone (weights, optimizer state, ``step_count`` as before it) and
        their error raised. Checkpoints, ``optimizer_state`` and ``close`` flush first."""
        error = self._settle_pending()
        if error is not None:
            raise error

    def _settle_pending(self, failure: BaseException | None = None) -> BaseException | None:
        """The last step's commit waited for; if it failed, that step is undone and its error
        returned."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = pending.settle(self._tier, failure)
        if error is not None:
            self.step_count = pending.step
        return error

    # ------------------------------------------------------------------ checkpoints
    def __reduce__(self):
        """A Trainer owns devices' threads and host buffers: it is not copied or pickled (``copy.deepcopy``,
        ``torch.save``); its state is."""
        raise TypeError("a harmony_fx.Trainer is not copied or pickled (it owns the devices' threads and its host "
                        "buffers): save its state with trainer.save(path) (or trainer.state_dict()), and restore it "
                        "into a new Trainer with trainer.load(path); copy the model itself (trainer.model) for an "
                        "EMA or a teacher.")

    def __deepcopy__(self, memo: dict):
        self.__reduce__()

    def state_dict(self) -> dict[str, Any]:
        """A copy of everything the next steps depend on; later steps do not change it."""
        self.flush()
        return self._state.state_dict(self.step_count)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict`` in place: the values are copied into the existing master tensors,
        which the compiled packs hold. A checkpoint of another model is refused before anything
        changes."""
        self.flush()
        self.step_count = self._state.load_state_dict(state_dict)

    def optimizer_state(self, param: nn.Parameter) -> dict[str, Any]:
        """The optimizer's whole state for ``param``: what host memory holds, and what is on the
        NVMe tier (read back; between steps host memory holds only the first)."""
        self.flush()
        return self._state.optimizer_state(param)

    def save(self, path: str | os.PathLike) -> None:
        """A checkpoint. Across processes, or when ``path`` is a directory: a folder per step under
        ``path`` and a ``latest`` pointer (``torch.distributed.checkpoint``), readable at any
        number of processes. Otherwise one file, written atomically (a crash mid-write leaves the
        previous checkpoint whole)."""
        if self.cluster is not None or os.path.isdir(path):
            self.flush()  # the last step's state on the NVMe tier first (or that step undone)
            checkpoint_folders.save(self._state, self.step_count, path)
            return
        save_file(self.state_dict(), path)

    def load(self, path: str | os.PathLike) -> None:
        """Restore this trainer from what ``save`` wrote: a file, a step folder, or a folder of step
        folders (the one its ``latest`` names), written by any number of processes."""
        if os.path.isdir(path):
            self.flush()  # the tier's last step settled before its state is replaced
            self.step_count = checkpoint_folders.load(self._state, path)
            return
        self.load_state_dict(load_file(path))

    def close(self) -> None:
        """Wait for the last step's state to reach the NVMe tier (``flush``), put the fp32 masters
        the tier held back into the model's parameters (which held their bf16 copies) and its
        optimizer state back into the optimizer (which needs host memory for all of it), and stop the
        device's stream threads (each step's update worker stops with the step) and, across
        processes, the two gloo groups the Trainer made (their threads joined)."""
        try:
            self.flush()
            if self._tier is not None:
                self._tier.masters_to_host()
                self._tier.state_to_host()
        finally:
            for hook in self._tier_hooks:
                hook.remove()
            try:
                self.hm.close()
            finally:
                if self.cluster is not None:
                    self.cluster.close()


class NonFiniteLossError(FloatingPointError, ValueError):
    """A step's loss is NaN or infinite (the step was undone, or skipped with ``skip_nonfinite``);
    ``loss``: that value."""

    def __init__(self, message: str, loss: float = float("nan")) -> None:
        super().__init__(message)  # args: the message alone, so a pickled copy (another rank's) unpickles
        self.loss = loss


def _state_bytes(optimizer: torch.optim.Optimizer) -> Callable[[nn.Parameter], int]:
    """Bytes of the optimizer's state tensors for a parameter, the ones the NVMe tier takes
    (``runtime.tier.on_tier_entry``), known before the first step makes them: per parameter group
    and number of dims (Muon steps matrices only; Adafactor factors them), an optimizer of the same
    class and settings steps a small parameter of that many dims once, and the state it makes per
    element scales to each parameter."""
    per_element: dict[tuple[int, int], float] = {}
    accepted = inspect.signature(type(optimizer).__init__).parameters
    for index, group in enumerate(optimizer.param_groups):
        settings = {k: v for k, v in group.items() if k != "params" and k in accepted}
        kinds = {(max(p.ndim, 1), p.dtype) for p in group["params"]} or {(1, torch.float32)}
        for ndim, dtype in kinds:
            probe = nn.Parameter(torch.zeros((8,) * ndim, dtype=dtype))
            probe.grad = torch.zeros_like(probe)
            try:
                twin = type(optimizer)([probe], **settings)
                twin.step()
            except Exception as error:  # noqa: BLE001 - any optimizer; say which one could not be sized
                raise ValueError(f"nvme_path=/host_memory=: cannot tell how much state {type(optimizer).__name__} "
                                 f"keeps (stepping a copy of it on a {ndim}-dim parameter failed: {error}); train "
                                 "without nvme_path and host_memory") from error
            per_element[index, ndim] = sum(v.numel() * v.element_size() for v in twin.state[probe].values()
                                           if on_tier_entry(v)) / probe.numel()
    group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    return lambda param: int(per_element.get((group_of.get(id(param)), max(param.ndim, 1)), 0.0) * param.numel())


def _check_tier_across(cluster: Cluster, per_pack: bool) -> None:
    """Across processes, the NVMe tier takes replicated optimizer state, updated per pack."""
    if cluster.shard_optimizer:
        raise ValueError("nvme_path= across processes keeps each rank's whole optimizer state on its own tier: "
                         "pass shard_optimizer=False, or leave it out (sharded state on the tier is not supported yet)")
    if not per_pack:
        raise ValueError("nvme_path= across processes needs the per-pack updates, which max_grad_norm (or an "
                         "optimizer other than torch's own, or its step pre-hooks) turns off (in one process the "
                         "tier then streams through the final update); clip without the tier, or train in one process")


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
