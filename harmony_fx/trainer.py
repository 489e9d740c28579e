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
"""
from __future__ import annotations

import collections
import concurrent.futures
import inspect
import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from harmony_fx.api import HarmonyModule
from harmony_fx.config import CompileOptions
from harmony_fx.runtime.executor import Runtime
from harmony_fx.schedule.actions import Key, KeyKind

__all__ = ["Trainer"]


class _LossModel(nn.Module):
    """``model`` and ``loss_fn`` as one module, so both are captured in one graph."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs_and_target):
        *inputs, target = inputs_and_target
        return self.loss_fn(self.model(*inputs), target)


class Trainer:
    """``trainer.step((inputs, target))`` runs forward, backward and the optimizer step.

    ``inputs``: a tensor or a tuple of tensors passed positionally to the model; ``target``: what
    ``loss_fn(output, target)`` takes. Both are split into microbatches along dim 0 (the loss of
    the batch is the size-weighted mean of the microbatch losses, as for a ``mean`` reduction; pass
    ``loss_reduction="sum"`` for a summed loss). Other options are those of ``harmony_fx.compile``.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: torch.optim.Optimizer, example_batch: tuple, *, max_grad_norm: float | None = None,
                 loss_reduction: str = "mean", **options: Any) -> None:
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
        self.loss_reduction = loss_reduction
        inputs, target = self._unpack(example_batch)
        if isinstance(options.get("batch_dims"), dict):
            # name the model's own arguments; the loss model sees (*inputs, target) as one *args
            names = list(inspect.signature(model.forward).parameters)[: len(inputs)]
            dims = tuple(options["batch_dims"].get(name, 0) for name in names) + (0,)
            options = {**options, "batch_dims": {"inputs_and_target": dims}}
        self.hm = HarmonyModule(_LossModel(model, loss_fn), (*inputs, target), {}, CompileOptions(**options),
                                _trainer=True, _updates=max_grad_norm is None)
        (self._loss_name,) = self.hm.signature.model_outputs
        self._groups = self.hm.update_groups()
        self._workers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harmony-update")
        self.step_count = 0

    # ------------------------------------------------------------------ what people look at
    @property
    def plan(self):
        return self.hm.plan

    @property
    def stats(self):
        return self.hm.stats

    @property
    def code(self) -> str:
        return self.hm.code

    def explain(self) -> str:
        return self.hm.explain()

    # ------------------------------------------------------------------ training
    def step(self, batch: tuple) -> torch.Tensor:
        inputs, target = self._unpack(batch)
        per_mb = self.hm._split_inputs((*inputs, target), {})
        sizes = [flat[0].shape[0] for flat in per_mb]
        weights = [size / sum(sizes) if self.loss_reduction == "mean" else 1.0 for size in sizes]
        loss_val = self.hm._nodes[self._loss_name].meta["val"]
        output_grads = {Key(KeyKind.GRAD, self._loss_name, mb): torch.full(loss_val.shape, w, dtype=loss_val.dtype)
                        for mb, w in enumerate(weights)}
        pending: list[concurrent.futures.Future] = []

        arrivals: collections.Counter = collections.Counter()
        arrivals_lock = threading.Lock()

        def on_update(runtime: Runtime, pack_index: int) -> None:
            # data-parallel: the gradients are complete once every device has sent its share
            with arrivals_lock:
                arrivals[pack_index] += 1
                if arrivals[pack_index] < self.hm.update_arrivals:
                    return
                params = self._groups.get(pack_index, [])
                for param in params:
                    param.grad = runtime.host_grads.get(id(param))
                pending.append(self._workers.submit(_timed, _step_subset, self.optimizer, params))

        runtime = None
        try:
            runtime = self.hm.run_iteration(per_mb, on_update, output_grads)
        finally:
            waited_from = time.perf_counter()
            update_seconds = sum(future.result() for future in pending)  # re-raises an update's error here
            self.stats.update_exposed_seconds = time.perf_counter() - waited_from
            self.stats.update_seconds = update_seconds
        if self.max_grad_norm is not None:
            params = [p for group in self._groups.values() for p in group]
            for param in params:
                param.grad = runtime.host_grads.get(id(param))
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            seconds = _timed(self.optimizer.step)
            self.stats.update_seconds = self.stats.update_exposed_seconds = seconds
        self.step_count += 1
        losses = [runtime.host_values[Key(KeyKind.ACT, self._loss_name, mb)] for mb in range(len(per_mb))]
        return sum(w * loss.detach().float() for w, loss in zip(weights, losses))

    def close(self) -> None:
        """Stop the update worker and the device's stream threads."""
        self._workers.shutdown(wait=True)
        self.hm.close()

    @staticmethod
    def _unpack(batch: tuple) -> tuple[tuple, Any]:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("a batch is (inputs, target): inputs a tensor or a tuple of tensors, target what "
                             "loss_fn(output, target) takes")
        inputs, target = batch
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target


def _timed(fn: Callable, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


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
