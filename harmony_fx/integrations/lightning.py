"""``HarmonyStrategy``: Lightning's ``Trainer`` trains a ``LightningModule`` through ``harmony_fx.Trainer``.

    trainer = L.Trainer(strategy=HarmonyStrategy(memory_budget="8GB", devices=["cuda:0"]), max_epochs=3)
    trainer.fit(model, train_loader, val_loader)

A strategy is the part of Lightning that decides where the model lives and how a step runs (Lightning
ships ``DeepSpeedStrategy`` and ``FSDPStrategy`` the same way). This one keeps the model in host
memory (the accelerator is the CPU: ``devices`` among harmony's options says which GPUs compute) and
replaces what Lightning's automatic optimization does for each batch, ``training_step``, ``backward``,
clipping and ``optimizer.step()``, with one ``harmony_fx.Trainer.step``: the forward and backward
under the memory budget, the user's optimizer on the host, overlapped with the backward.

Capture: ``training_step(batch, batch_idx)`` is the model's forward plus arbitrary code (a loss, a
reshape, ``self.log``), so it is wrapped as the forward of a module (``_StepModule``) and captured
whole, once, at the first batch: ``batch_idx`` keeps its first value, and what the step reads
through the module (``self.current_epoch``, from Lightning's trainer) is keyed as any attribute a
forward reads (a new epoch compiles the step again). ``self.log`` would store the graph's traced
tensors in Lightning's results, so while a step is captured its calls are recorded instead and
replayed after every step: a logged loss with the step's loss, a Python number as it is.
Validation, test and predict steps are compiled the same way and run forward-only; there the
logged tensors are outputs of the graph, replayed with their values.

Lightning still runs everything around the step: ``configure_optimizers`` (one optimizer, with its
LR schedulers, stepped by Lightning between harmony's steps), ``gradient_clip_val`` (harmony's
global-norm clipping, ``max_grad_norm``), checkpoints (the weights and optimizer state harmony holds,
plus its step counter and RNG states: a resumed run continues identically), loggers and callbacks.
``L.Trainer(precision="bf16-mixed")`` is bfloat16 autocast around every step harmony runs, as
Lightning's ``MixedPrecision`` wraps each step (fp32 weights, gradients and optimizer state), on the
device type harmony computes on. What a harmony step cannot honor is refused before training starts,
with what to do instead (see ``_refuse_unsupported`` and ``_precision_problems``).

The strategy is Lightning's DDP strategy less its DDP wrapper, so that several processes
(``L.Trainer(devices=N)``, torchrun) are launched, grouped and given their shares of the data as
Lightning does for DDP, while harmony sums the gradients; one process is as a single-device
strategy (no launcher, no process group, the loaders' own samplers).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils import _pytree as pytree

try:
    import lightning.pytorch as pl
except ImportError as error:  # an optional extra: say how to get it
    raise ImportError("harmony_fx.integrations.lightning needs Lightning: pip install 'harmony-fx[lightning]' "
                      "(or pip install lightning)") from error
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

import harmony_fx
from harmony_fx.config import HOST_STATE_OPTIONS, check_option_names, option_names, with_environment
from harmony_fx.runtime.devices import visible_gpus
from harmony_fx.training.checkpoint import get_rng_states, set_rng_states
from harmony_fx.user_frames import user_stacklevel

__all__ = ["HarmonyStrategy"]

# the harmony_fx.Trainer keywords the strategy passes through; the others are Lightning's to set
# (max_grad_norm: gradient_clip_val) or need several processes (process_group, shard_optimizer, ...)
_TRAINER_OPTIONS = ("loss_reduction", "skip_nonfinite", "atomic")
_REFUSED_OPTIONS = {
    "max_grad_norm": "set L.Trainer(gradient_clip_val=...) instead (harmony clips by the global norm as Lightning "
                     "does)",
    "process_group": "several processes are Lightning's to launch and group: L.Trainer(devices=N, num_nodes=M), "
                     "or torchrun; HarmonyStrategy trains across them",
}
_REFUSED_OPTIONS["shard_optimizer"] = _REFUSED_OPTIONS["collective_timeout"] = _REFUSED_OPTIONS["process_group"]
# the checkpoint key of harmony's own state (its step counter and RNG states; the weights and
# optimizer state are Lightning's "state_dict" and "optimizer_states")
_CHECKPOINT_KEY = "harmony_fx"
_PREFIX = "module."  # the LightningModule's names inside _StepModule


class HarmonyStrategy(DDPStrategy):
    """``L.Trainer(strategy=HarmonyStrategy(**options))``: every training step is a
    ``harmony_fx.Trainer`` step; validation, test and predict steps run forward-only through
    ``harmony_fx.compile``. ``options`` are ``harmony_fx.compile``'s (``memory_budget``, ``devices``,
    ``precision``, ``microbatches``, ...) and ``harmony_fx.Trainer``'s ``loss_reduction``,
    ``skip_nonfinite`` and ``atomic``; the ``HARMONY_FX_*`` environment variables set those not
    given (``config.ENVIRONMENT_VARIABLES``). The model stays in host memory.

    ``L.Trainer(precision="bf16-mixed")`` runs every step harmony runs under bfloat16 autocast, as
    Lightning does without harmony (fp32 weights); ``HarmonyStrategy(precision="bf16")`` is
    harmony's own bfloat16 (weights and transfers in bf16, fp32 masters on the host). Lightning's
    other precisions are refused (``_precision_problems``).

    Several processes (``L.Trainer(devices=N, num_nodes=M)``, or torchrun) are launched and
    grouped by Lightning as for its DDP strategy, each on its share of the data (its distributed
    sampler): the steps are a ``harmony_fx.Trainer`` across them, which sums each pack's gradients
    over the processes (the model is never wrapped in DDP), each computing on its own GPU
    (``cuda:LOCAL_RANK``, or a HostDevice) unless ``devices`` names others; the optimizer state stays
    whole on each, as Lightning saves it from rank 0. One process (the default) sets up no process group."""

    strategy_name = "harmony"

    def __init__(self, **options: Any) -> None:
        for name, instead in _REFUSED_OPTIONS.items():
            if name in options:
                raise TypeError(f"HarmonyStrategy does not take {name}: {instead}.")
        check_option_names(options, list(option_names()) + list(_TRAINER_OPTIONS), "HarmonyStrategy")
        options = with_environment(options)  # HARMONY_FX_MEMORY_BUDGET=8GiB python train.py; the code's win
        # the accelerator is the CPU whatever the machine has: Lightning keeps the model and the
        # batches there, and harmony moves what the plan says to the devices in ``options``; across
        # processes harmony's own gloo groups carry the host tensors
        super().__init__(accelerator=CPUAccelerator(), process_group_backend="gloo")
        self.trainer_options = {k: v for k, v in options.items() if k in _TRAINER_OPTIONS}
        self.compile_options = {k: v for k, v in options.items() if k not in _TRAINER_OPTIONS}
        self._harmony: harmony_fx.Trainer | None = None  # built at the first training batch
        self._step_module: _StepModule | None = None
        self._forward_only: dict[tuple, tuple[_StepModule, harmony_fx.HarmonyModule]] = {}
        self._resume: dict[str, Any] | None = None     # a checkpoint's harmony state, loaded at the first batch
        self._state: tuple[int, dict[str, Any]] | None = None  # (step_count, harmony's state_dict) for a checkpoint

    @property
    def harmony_trainer(self) -> harmony_fx.Trainer | None:
        """The ``harmony_fx.Trainer`` running the training steps (its ``stats``, ``plan``,
        ``explain()``), from the first training batch of a ``fit`` to its end; else ``None``."""
        return self._harmony

    # ------------------------------------------------------------------ setting up
    # one process (the default) is as Lightning's single-device strategy: no launcher (which sets
    # torch's thread count), no process group, the data loaders' own samplers
    @property
    def _across_processes(self) -> bool:
        return self.num_nodes * self.num_processes > 1

    def _configure_launcher(self) -> None:
        if self._across_processes:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        if self._across_processes:
            super().setup_environment()  # DDP's: the process group
        else:
            ParallelStrategy.setup_environment(self)

    def connect(self, model: "pl.LightningModule") -> None:
        super().connect(model)
        if not self._across_processes:
            # Lightning takes every DDPStrategy for distributed and would give the data loaders a
            # DistributedSampler of one replica, another order than their own sampler's
            model.trainer._accelerator_connector.use_distributed_sampler = False

    def setup(self, trainer: "pl.Trainer") -> None:
        self._close()
        # before Lightning's setup, which converts the module's weights for a '-true' precision
        _refuse(_precision_problems(trainer, self))
        if self._across_processes:
            super().setup(trainer)
        else:  # without DDP's start from rank 0's weights, which needs the process group
            ParallelStrategy.setup(self, trainer)
        _refuse_unsupported(trainer, self)

    def configure_ddp(self) -> None:
        """Nothing: harmony sums each pack's gradients over the processes itself."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # never wrapped in DistributedDataParallel (configure_ddp)

    def _own_devices(self) -> dict[str, Any]:
        """Across processes, each computes on its own GPU unless ``devices`` names others (harmony's
        default in one process, every GPU, would put every process on all of them)."""
        if not self._across_processes or self.compile_options.get("devices") is not None:
            return {}
        return {"devices": [f"cuda:{self.local_rank}"] if visible_gpus() else ["host:0"]}

    def _autocast(self) -> contextlib.AbstractContextManager:
        """``precision="bf16-mixed"``: bfloat16 autocast on the device types harmony computes on,
        as Lightning's ``MixedPrecision`` enters it on its accelerator's (here always the CPU, which
        holds the model while harmony's ``devices`` compute). harmony keys the captured graph on
        the autocast state and runs every pack's forward and recompute under it."""
        autocast = contextlib.ExitStack()
        if isinstance(self.precision_plugin, MixedPrecision):
            for device_type in _compute_device_types(self.compile_options.get("devices")):
                autocast.enter_context(torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False))
        return autocast

    # ------------------------------------------------------------------ training
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """One whole step (forward, backward, clipping, update) through harmony; returns the loss."""
        trainer = self.lightning_module.trainer
        if trainer.accumulate_grad_batches != 1:  # set since setup, by GradientAccumulationScheduler
            _refuse([f"accumulate_grad_batches={trainer.accumulate_grad_batches} (a GradientAccumulationScheduler sets "
                     "it during fit): harmony steps every batch it is given; give each step the whole batch instead "
                     "and let harmony split it: HarmonyStrategy(microbatches=...) gives the same update"])
        leaves, spec = _flatten_batch(batch, "training_step")
        with self._autocast():
            if self._harmony is None:
                self._harmony = self._build_trainer(leaves, spec, batch_idx)
            elif spec != self._step_module.spec:
                raise ValueError(f"HarmonyStrategy: the training batches changed structure ({self._step_module.spec} "
                                 f"before, {spec} now); give every batch the same structure (the same keys and "
                                 "nesting)")
            self._state = None
            loss = self._harmony.step(tuple(leaves))  # a batch of a new size captures training_step again
        self._step_module.replay_logs(self.lightning_module, loss=loss.detach())
        return loss

    def _build_trainer(self, leaves: list[torch.Tensor], spec: pytree.TreeSpec,
                       batch_idx: int) -> harmony_fx.Trainer:
        module = self.lightning_module
        self._step_module = _StepModule(module, "training_step", spec, (batch_idx,))
        clip = module.trainer.gradient_clip_val or None
        # across processes the optimizer state stays whole on each: Lightning saves rank 0's
        across = {"shard_optimizer": False} if self._across_processes else {}
        harmony = harmony_fx.Trainer(self._step_module, None, self.optimizers[0], tuple(leaves), max_grad_norm=clip,
                                     **across, **self.trainer_options, **self.compile_options, **self._own_devices())
        self._step_module.warn_unreplayable_logs()
        if self._resume is not None:
            # the checkpoint's values and step counter; its RNG states were put back at the restore
            harmony.load_state_dict({**self._resume, "rng": get_rng_states()})
            self._resume = None
        return harmony

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Nothing: harmony's step ran the backward already."""
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's closure runs ``training_step``, which is harmony's whole step, update included;
        the optimizer is not stepped again."""
        return closure()

    # ------------------------------------------------------------------ forward-only steps
    # Lightning passes (batch, batch_idx) and, with several dataloaders, dataloader_idx
    def validation_step(self, batch: Any, *indices: int) -> Any:
        return self._forward_only_step("validation_step", batch, indices)

    def test_step(self, batch: Any, *indices: int) -> Any:
        return self._forward_only_step("test_step", batch, indices)

    def predict_step(self, batch: Any, *indices: int) -> Any:
        return self._forward_only_step("predict_step", batch, indices)

    def _forward_only_step(self, method: str, batch: Any, indices: tuple[int, ...]) -> Any:
        """``method`` through a module compiled for it, one per dataloader and batch structure
        (Lightning calls it in eval mode under ``inference_mode``: a forward-only program). The
        batch is one microbatch: a forward-only program keeps nothing for a backward, so splitting
        saves little, and what a step logs need not be a mean or a sum (a maximum cannot be put
        together from microbatches')."""
        leaves, spec = _flatten_batch(batch, method)
        key = (method, spec, indices[1:])
        if key not in self._forward_only:
            step_module = _StepModule(self.lightning_module, method, spec, indices, logs_out=True)
            # the NVMe tier and host_memory are the optimizer's: a forward-only step holds no state
            options = {**{k: v for k, v in self.compile_options.items() if k not in HOST_STATE_OPTIONS},
                       **self._own_devices(), "microbatches": None}
            self._forward_only[key] = (step_module, harmony_fx.compile(step_module, **options))
        step_module, compiled = self._forward_only[key]
        with self._autocast():  # compiled at its first call, under the autocast it runs with
            output, logged = compiled(*leaves)
        step_module.replay_logs(self.lightning_module, values=logged)
        return output

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The weights harmony holds (with an NVMe tier, its fp32 masters read back)."""
        if self._harmony is None:
            return super().lightning_module_state_dict()
        return _unprefixed(self._harmony_state()["model"])

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._harmony is None:
            return super().optimizer_state(optimizer)
        return self._harmony_state()["optimizer"]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._harmony is not None:
            state = self._harmony_state()
            checkpoint[_CHECKPOINT_KEY] = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
        self._state = None
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's restore (weights, optimizer, schedulers and loops: before the first batch, so
        before harmony's trainer exists); harmony's step counter waits for it. The RNG states are
        put back now, as at the save, before the resumed epoch's DataLoader draws its seed from them
        (at the first batch they came after that draw: dropout resumed on other numbers)."""
        super().load_optimizer_state_dict(checkpoint)
        own = checkpoint.get(_CHECKPOINT_KEY)
        if own is not None:
            set_rng_states(own["rng"])
            self._resume = {**own, "model": _prefixed(checkpoint["state_dict"]),
                            "optimizer": checkpoint["optimizer_states"][0]}

    def _harmony_state(self) -> dict[str, Any]:
        """harmony's ``state_dict()``, once per step (a checkpoint asks for its weights and its
        optimizer state separately)."""
        if self._state is None or self._state[0] != self._harmony.step_count:
            self._state = (self._harmony.step_count, self._harmony.state_dict())
        return self._state[1]

    # ------------------------------------------------------------------ ending
    def teardown(self) -> None:
        self._close()
        super().teardown()

    def _close(self) -> None:
        """Stop what harmony runs (the NVMe tier's writes, the device threads) and drop the
        compiled modules: the next ``fit`` builds them again for its own optimizer."""
        harmony, self._harmony, self._step_module, self._state, self._resume = self._harmony, None, None, None, None
        compiled, self._forward_only = self._forward_only, {}
        try:
            if harmony is not None:
                harmony.close()
        finally:
            for _, module in compiled.values():
                if "compiled" in vars(module):  # compiled at its first call
                    module.close()


class _StepModule(nn.Module):
    """A LightningModule's ``training_step`` (or ``validation_step``, ...) as a module's forward, so
    that harmony captures the step and the loss it computes as one graph.

    The batch arrives as its tensors (``spec`` rebuilds the structure ``training_step`` expects). The
    step's ``self.log`` calls, recorded while it is captured, are kept in ``record``; with
    ``logs_out`` the logged tensors are also outputs of the graph (``(step output, logged tensors)``)."""

    def __init__(self, module: "pl.LightningModule", method: str, spec: pytree.TreeSpec, step_args: tuple,
                 logs_out: bool = False) -> None:
        super().__init__()
        self.module = module
        self.method = method
        self.spec = spec
        self.step_args = step_args
        self.logs_out = logs_out
        self.record = _Record()

    def forward(self, *leaves: torch.Tensor) -> Any:
        batch = pytree.tree_unflatten(list(leaves), self.spec)
        with _logs_recorded(self.module) as logged:
            output = getattr(self.module, self.method)(batch, *self.step_args)
        self.record.logged = logged
        if self.logs_out:
            return output, tuple(entry.value for entry in logged if isinstance(entry.value, torch.Tensor))
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"HarmonyStrategy: {self.method} returned {type(output).__name__}; harmony captures the "
                             "step once and runs it for every batch, so it must return the loss (a tensor, or a dict "
                             "with a 'loss' tensor): it cannot skip a batch by returning None")
        self.record.loss_id = id(loss)
        return loss

    def warn_unreplayable_logs(self) -> None:
        dropped = [entry.name for entry in self.record.logged
                   if isinstance(entry.value, torch.Tensor) and id(entry.value) != self.record.loss_id]
        if dropped:
            warnings.warn(f"HarmonyStrategy: {self.method} logs {', '.join(map(repr, dropped))}, tensors that are not "
                          "the loss it returns; a harmony step returns only the loss, so they are not logged. Log "
                          "them in validation_step (whose logged tensors are outputs of its graph).",
                          stacklevel=user_stacklevel())

    def replay_logs(self, module: "pl.LightningModule", loss: torch.Tensor | None = None,
                    values: tuple = ()) -> None:
        """Log what the captured step logged: the loss with ``loss``, the logged tensors of a
        forward-only step with ``values`` (in order), Python numbers as they were."""
        values = iter(values)
        for entry in self.record.logged:
            if not isinstance(entry.value, torch.Tensor):
                value = entry.value
            elif self.logs_out:
                value = next(values)
            elif id(entry.value) == self.record.loss_id:
                value = loss
            else:
                continue  # warned about when captured
            module.log(entry.name, value, *entry.args, **entry.kwargs)


class _Record:
    """What the last capture of a step logged, and the id of the loss it returned. A plain object on
    purpose: ``torch.export`` puts a module's attributes back after tracing, containers included
    (copies of them), but keeps an object's identity, so what the trace writes into it stays."""

    def __init__(self) -> None:
        self.logged: list[_Logged] = []
        self.loss_id: int | None = None


class _Logged:
    """One ``self.log(name, value, ...)`` call of a captured step."""

    def __init__(self, name: str, value: Any, args: tuple, kwargs: dict) -> None:
        self.name, self.value, self.args, self.kwargs = name, value, args, kwargs


@contextlib.contextmanager
def _logs_recorded(module: nn.Module) -> Iterator[list[_Logged]]:
    """``module.log`` records its calls instead of logging (``log_dict`` calls ``log``) until the
    end: under capture the logged values are the graph's traced tensors."""
    logged: list[_Logged] = []

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        logged.append(_Logged(name, value, args, kwargs))

    own = vars(module).get("log")  # an instance's own log, if something set one
    module.log = record
    try:
        yield logged
    finally:
        if own is None:
            del module.log
        else:
            module.log = own


def _flatten_batch(batch: Any, method: str) -> tuple[list[torch.Tensor], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten(batch)
    others = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)})
    if others:
        raise ValueError(f"HarmonyStrategy: the batches {method} gets hold {', '.join(others)} values besides "
                         "tensors; harmony captures the step once, so every value in a batch must be a tensor (turn "
                         "the others into tensors in the DataLoader's collate_fn, or drop them)")
    return leaves, spec


def _prefixed(state: Mapping[str, Any]) -> dict[str, Any]:
    return {_PREFIX + name: value for name, value in state.items()}


def _unprefixed(state: Mapping[str, Any]) -> dict[str, Any]:
    return {name[len(_PREFIX):]: value for name, value in state.items()}


def _overrides(module: "pl.LightningModule", name: str) -> bool:
    return getattr(type(module), name) is not getattr(pl.LightningModule, name)


def _refuse_unsupported(trainer: "pl.Trainer", strategy: HarmonyStrategy) -> None:
    """What a harmony step cannot do as Lightning would, refused before training starts."""
    problems = _training_problems(trainer, strategy) if trainer.state.fn == TrainerFn.FITTING else []
    _refuse(problems)


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ValueError("HarmonyStrategy cannot train this as asked:\n- " + "\n- ".join(problems))


def _precision_problems(trainer: "pl.Trainer", strategy: HarmonyStrategy) -> list[str]:
    """Lightning's precision, where a harmony step cannot honor it: '32-true' and 'bf16-mixed'
    (autocast, ``HarmonyStrategy._autocast``) are honored."""
    plugin = strategy.precision_plugin
    if type(plugin) is Precision:
        return []
    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        if strategy.compile_options.get("precision", "fp32") != "fp32":
            return [f"precision='bf16-mixed' (bfloat16 autocast, as L.Trainer without harmony) and "
                    f"HarmonyStrategy(precision={strategy.compile_options['precision']!r}) (harmony's own "
                    "weights-and-transfers precision) are two kinds of mixed precision; pass one of them"]
        return []
    if trainer.precision == "16-mixed":
        why = ("float16 autocast needs a gradient scaler (loss scaling), which a harmony step does not run; use "
               "precision='bf16-mixed' (bfloat16 autocast, no scaler)")
    elif trainer.precision in ("bf16-true", "16-true"):
        why = ("it converts the module's weights to half precision, so there are no fp32 weights for the optimizer "
               "to update; use precision='bf16-mixed' (bfloat16 autocast, fp32 weights), or leave '32-true' and "
               "pass HarmonyStrategy(precision='bf16') (bf16 compute and transfers, fp32 masters on the host)")
    else:
        why = "HarmonyStrategy honors precision='32-true' and 'bf16-mixed'"
    return [f"precision={trainer.precision!r}: {why}"]


def _compute_device_types(devices: Any) -> set[str]:
    """The torch device types harmony computes on for its ``devices`` option, read as
    ``runtime.devices.resolve_devices`` reads it (a HostDevice, ``host:N``, computes on the CPU)."""
    if devices is None or isinstance(devices, int):
        return {"cuda" if visible_gpus() else "cpu"}
    names = [devices] if isinstance(devices, str) else [str(name) for name in devices]
    return {"cuda" if name.partition(":")[0] == "cuda" else "cpu" for name in names}


def _training_problems(trainer: "pl.Trainer", strategy: HarmonyStrategy) -> list[str]:
    """What ``fit`` asks for that a harmony step cannot do (validating or testing needs none of it)."""
    module = strategy.lightning_module
    problems = []
    if not module.automatic_optimization:
        problems.append("manual optimization (automatic_optimization = False): harmony's step runs the backward and "
                        "the update itself; use automatic optimization (return the loss from training_step)")
    scheduled = [callback for callback in trainer.callbacks if isinstance(callback, GradientAccumulationScheduler)]
    if scheduled:
        problems.append(f"a GradientAccumulationScheduler ({scheduled[0].scheduling}) sets accumulate_grad_batches "
                        "during fit: harmony steps every batch it is given; give each step the whole batch instead "
                        "(a DataLoader batch that many times larger) and let harmony split it "
                        "(HarmonyStrategy(microbatches=...))")
    if trainer.accumulate_grad_batches != 1:
        problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}: give each step the whole batch "
                        "instead (a DataLoader batch that many times larger) and let harmony split it: "
                        f"HarmonyStrategy(microbatches={trainer.accumulate_grad_batches}) gives the same update")
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, GradClipAlgorithmType.NORM):
        problems.append(f"gradient_clip_algorithm='{trainer.gradient_clip_algorithm.value}': harmony clips by the "
                        "global norm only; use gradient_clip_algorithm='norm'")
    for hook, why in (("backward", "harmony runs the backward of the captured training_step"),
                      ("configure_gradient_clipping", "harmony clips inside its step; set gradient_clip_val"),
                      ("on_before_optimizer_step", "harmony updates each pack inside its step, as its gradients "
                                                   "are complete"),
                      ("on_after_backward", "the backward runs inside harmony's step")):
        if _overrides(module, hook):
            problems.append(f"{type(module).__name__}.{hook} is overridden but is never called ({why}); remove it")
    given = sum(type(optimizer).__name__ != "_MockOptimizer" for optimizer in strategy.optimizers)  # None: a mock
    if given != 1:
        problems.append(f"configure_optimizers gave {given} optimizers: harmony steps exactly one (one torch.optim "
                        "optimizer over the module's parameters, with any LR schedulers)")
    return problems
