"""``HarmonyTrainer``: the Hugging Face ``Trainer`` with each step run by ``harmony_fx.Trainer``.

The one change to an HF training script is the class (as TRL's ``SFTTrainer`` is a ``Trainer``)::

    from harmony_fx.integrations.huggingface import HarmonyTrainer

    trainer = HarmonyTrainer(model=model, args=TrainingArguments(...), train_dataset=..., eval_dataset=...,
                             harmony_options={"memory_budget": "8GiB", "devices": ["cuda:0"]})
    trainer.train()

transformers runs everything around the step as it always does (the data loader and collator, the
optimizer and LR schedule it builds from ``TrainingArguments``, logging, callbacks, evaluation,
checkpoints); four of its hooks are overridden:

* the model is never moved to a GPU (``_move_model_to_device``, and ``accelerate`` is told not to
  place it, wrap its forward in autocast or split the batch over GPUs: ``_build_accelerator_args``);
  ``harmony_options["devices"]`` says which devices compute;
* ``training_step`` collects the ``gradient_accumulation_steps`` batches of an optimizer step and,
  at the last one, runs them as one ``harmony_fx.Trainer.step`` (they are its microbatches, by
  default): forward and backward under the memory budget, the user's optimizer on the host,
  overlapped with the backward, ``max_grad_norm`` as harmony's global-norm clipping. The loss it
  returns is the accumulated batch's, as transformers computes it (summed over labelled tokens and
  divided by their number in the whole accumulated batch), so the logged loss is the same;
* the optimizer transformers steps after ``training_step`` is a stand-in (``_SteppedByHarmony``):
  its ``step()`` does nothing, as harmony has updated the parameters, and everything else (the
  parameter groups the LR scheduler sets, ``state_dict`` for checkpoints) is the real optimizer's;
  ``_clip_grad_norm`` reports the norm harmony clipped by;
* ``prediction_step`` (``evaluate``, ``predict``) runs the model forward-only through
  ``harmony_fx.compile``: each batch shape is compiled once and kept.

Checkpoints are transformers' own (weights, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``): harmony's state between steps is the model's host tensors and the
optimizer's state, which those files hold, so ``resume_from_checkpoint`` continues identically.

Under torchrun (or ``accelerate launch``) each process steps on its share of the data as a
``harmony_fx.Trainer`` across the processes, which sums each pack's gradients over them; accelerate
does not wrap the model in DDP (``create_accelerator_and_postprocess``), and each process's
microbatches weigh as transformers' DDP step weighs its loss (``_scale_across_processes``).

What a harmony step cannot honor is refused when the trainer is made, with what to do instead
(``_refusals``; the texts are listed in ``docs/integrations.md``). Harmony's options come from
``harmony_options`` over the ``HARMONY_FX_*`` environment variables (``config.options_from_environment``).
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from typing import Any, Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import transformers
except ImportError as error:  # an optional extra: say how to get it
    raise ImportError("harmony_fx.integrations.huggingface needs transformers and accelerate: "
                      "pip install 'harmony-fx[hf]'") from error

from harmony_fx.api import HarmonyModule, compile as harmony_compile
from harmony_fx.compiler.driver import MicrobatchesComputeApart
from harmony_fx.compiler.packing import BudgetTooSmallError
from harmony_fx.config import HOST_STATE_OPTIONS, check_option_names, option_names, with_environment
from harmony_fx.frontend.capture import CaptureError, buffers_put_back
from harmony_fx.ir.values import fakes_of
from harmony_fx.trainer import NonFiniteLossError, Trainer
from harmony_fx.user_frames import user_stacklevel

__all__ = ["HarmonyTrainer"]

DOOR = "HarmonyTrainer(harmony_options=...)"
# harmony_fx.Trainer's own keywords that harmony_options may hold; the others are TrainingArguments'
# (max_grad_norm) or need several processes
_TRAINER_OPTIONS = ("skip_nonfinite", "atomic")
# keys a padded batch may hold besides the input ids, and what their padding is
_PAD_VALUES = {"labels": -100, "attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1}


class HarmonyTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose steps run through ``harmony_fx.Trainer`` (module docstring).

    ``harmony_options``: ``harmony_fx.compile``'s options (``memory_budget``, ``devices``,
    ``microbatches``, ``precision``, ...) and ``harmony_fx.Trainer``'s ``skip_nonfinite`` and
    ``atomic``; the ``HARMONY_FX_*`` environment variables fill in those it does not name.
    ``TrainingArguments(bf16=True)`` is bfloat16 autocast around each step and evaluation, as
    ``transformers.Trainer`` computes (fp32 weights; harmony runs every pack's forward and recompute
    under it); ``harmony_options={"precision": "bf16"}`` is harmony's own bfloat16 (weights and
    transfers in bf16, fp32 masters on the host). ``microbatches`` defaults to
    ``gradient_accumulation_steps``. Every other argument is ``transformers.Trainer``'s.

    ``harmony`` is the ``harmony_fx.Trainer`` once the first step made it (``harmony.stats``: the
    last step's bytes moved and peaks), ``None`` before.
    """

    def __init__(self, *args: Any, harmony_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        # the next __init__ in the class's MRO: transformers.Trainer's, or that of the Trainer subclass it
        # is combined with (class HarmonySFTTrainer(HarmonyTrainer, trl.SFTTrainer)), whose parameters
        # (peft_config, ref_model) and their order are its own
        signature = inspect.signature(super().__init__)
        call = signature.bind(*args, **kwargs)
        training_args = call.arguments.get("args") or transformers.TrainingArguments(output_dir="tmp_trainer")
        bound = {**call.arguments, "self": self}
        options = dict(harmony_options or {})
        check_option_names(options, [*option_names(), *_TRAINER_OPTIONS], DOOR, elsewhere={
            "max_grad_norm": "transformers' own: set TrainingArguments(max_grad_norm=...)",
            "loss_reduction": "decided by transformers, which weighs a step's batches itself"})
        options = with_environment(options)
        _refuse_unsupported(training_args, bound, options)
        self._harmony_options = _with_training_arguments(options, training_args)
        # one process drives every GPU harmony uses: never nn.DataParallel over them (transformers
        # does the same for a model placed across GPUs); read before Trainer.__init__ sizes batches
        _ = training_args.n_gpu
        training_args._n_gpu = min(training_args._n_gpu, 1)
        self.harmony: Trainer | None = None
        self._host_optimizer: torch.optim.Optimizer | None = None  # the real one (create_optimizer)
        self._forward_module: HarmonyModule | None = None
        self._window: list[dict] = []  # the batches of the optimizer step under way
        self._reads_num_items: bool | None = None  # whether the model's loss reads num_items_in_batch
        self._with_compute_loss: _WithComputeLoss | None = None  # the model inside a compute_loss override
        self._warned_one_mean = False  # _warn_of_one_mean said it once
        if "args" in signature.parameters:
            call.arguments["args"] = training_args
        super().__init__(*call.args, **call.kwargs)

    # ------------------------------------------------------------------ the model stays on the host
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Never: harmony streams the weights to the devices it computes on."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # under torchrun harmony sums each pack's gradients over the processes itself (harmony_fx.Trainer
        # across processes): accelerate's prepare must not wrap the model in DistributedDataParallel,
        # whose reducer would hold gradient buckets the size of every trainable parameter (host memory
        # harmony never uses) and whose constructor sends the whole model. Its evaluation mode prepares
        # a model as for training but for that wrapping.
        prepare_model = self.accelerator.prepare_model

        def prepare_model_unwrapped(model: nn.Module, device_placement: bool | None = None,
                                    evaluation_mode: bool = False) -> nn.Module:
            return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

        self.accelerator.prepare_model = prepare_model_unwrapped
        # evaluation hands transformers the compiled module (prediction_step): unwrapped, it is the model,
        # whose class transformers reads (a causal LM's labels are shifted for label smoothing)
        unwrap_model = self.accelerator.unwrap_model

        def unwrap_compiled(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            return unwrap_model(model.model if isinstance(model, HarmonyModule) else model, *args, **kwargs)

        self.accelerator.unwrap_model = unwrap_compiled

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        arguments = super()._build_accelerator_args(**kwargs)
        # accelerate would move the model and each batch to the GPU and wrap the forward in autocast:
        # harmony moves what each pack needs, and the step runs under this trainer's own autocast
        arguments.update(device_placement=False, mixed_precision="no")
        return arguments

    # ------------------------------------------------------------------ the optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """transformers' optimizer (from ``TrainingArguments``, or the one passed in ``optimizers``),
        kept for harmony; transformers gets a stand-in that harmony has already stepped."""
        optimizer = super().create_optimizer(model)
        # a second train() gets back what the first left: accelerate's wrapper around the stand-in,
        # whose step does nothing (taken for the real one, no parameter moved again)
        if not any(isinstance(link, _SteppedByHarmony) for link in _optimizer_chain(optimizer)):
            self._host_optimizer = optimizer
            self.optimizer = _SteppedByHarmony(optimizer)
        return self.optimizer

    def train(self, *args: Any, **kwargs: Any):
        # a callback may change the gradients between the backward and the step, where transformers
        # calls on_pre_optimizer_step: harmony updated each pack during its backward, before that
        editing = [type(c).__name__ for c in self.callback_handler.callbacks
                   if type(c).on_pre_optimizer_step is not transformers.TrainerCallback.on_pre_optimizer_step]
        if editing:
            raise ValueError(f"HarmonyTrainer cannot honor the callback {editing[0]}.on_pre_optimizer_step: harmony "
                             "updates each pack during the backward, before transformers calls it, so a change it "
                             "makes to the gradients would not reach the update. Change them with a hook on the "
                             "parameter instead (param.register_hook(lambda grad: ...)), which harmony runs on each "
                             "step's gradient before the update, or remove the callback.")
        # each train() captures the model anew: resume_from_checkpoint (or model_init) replaces
        # what the last one's programs were made from
        self._close_harmony()
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ a step
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Collect the optimizer step's batches; at its last, run them as one harmony step and
        return the whole step's loss (each earlier batch returns 0, so transformers' running sum
        is the step's loss). The model gets ``num_items_in_batch`` where transformers gives it (the
        whole step's labelled tokens, which its loss divides its sum by): every microbatch has it
        whole. Where the step's batches are its microbatches, each microbatch's loss weighs as
        transformers weighs its batch's: 1 where it adds the batches' losses as they are
        (``loss_is_scaled_for_ga``: it passed ``num_items_in_batch``), else one over their number;
        where the microbatches cut each batch further, a mean of the model's own is weighed back
        into its batch's (``_weights_of_batch_means``). Otherwise (a microbatch spans batches) the
        graph's own reduction of the whole batch, times the number of batches where transformers
        adds losses that ignore ``num_items_in_batch``."""
        self._window.append(inputs)
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        batches, self._window = self._window, []
        batch = _one_batch(batches, self._pad_token_id(), self._padding_side())
        passed = (self.model_accepts_loss_kwargs or self.compute_loss_func is not None) and num_items_in_batch is not None
        if passed:
            batch["num_items_in_batch"] = torch.as_tensor(num_items_in_batch).detach().cpu()
        self.model.train()
        decided = getattr(self, "loss_is_scaled_for_ga", None)
        # transformers' rule; where it is false, it divides each batch's loss by their number
        adds = passed if decided is None else decided
        outside, world = self._scale_across_processes(passed), self.args.world_size
        apart = self._batches_are_microbatches(batches)
        with (self._autocast(), warnings.catch_warnings(), self._compute_loss_captured(),
              self._nonfinite_named()):
            if apart:
                # the microbatches are transformers' own batches, each computed apart as it computes them (its
                # dropout draws, a contrastive loss over each batch, BatchNorm's statistics): nothing to warn of.
                # Where they cut a batch (an epoch's last step), harmony's warning is the caller's to see
                warnings.simplefilter("ignore", MicrobatchesComputeApart)
            harmony = self._harmony_for(batch)
            if apart:
                weight = (1.0 if adds else 1.0 / len(batches)) * outside / world
                loss = harmony.step(batch, microbatch_weights=[weight] * len(batches))
            else:
                own_mean = not passed or not self._reads_num_items_in(batch)
                means_apart = own_mean and len(batches) > 1  # transformers adds the batches' own means
                weights = _weights_of_batch_means(harmony.microbatch_sizes(batch), batch, batches, adds) \
                    if means_apart else None
                if weights is not None:
                    loss = harmony.step(batch, microbatch_weights=[w * outside / world for w in weights])
                else:
                    if means_apart:
                        self._warn_of_one_mean(batches)
                    # a mean of the model's own is over every process's batch already (harmony's normaliser
                    # counts every rank's): no 1/world. A loss over num_items_in_batch is each rank's sum,
                    # which harmony adds over the ranks where transformers' DDP step averages them: 1/world
                    scale = (len(batches) if adds and own_mean else 1) * outside / (1 if own_mean else world)
                    loss = harmony.step(batch, loss_scale=scale)
        return loss.detach().to(self.args.device)

    @contextlib.contextmanager
    def _nonfinite_named(self):
        """A non-finite loss named by the step transformers logs (``global_step + 1``), not harmony's own
        count (from 0, and anew at every ``train()``: a resumed run names neither), with the option
        where this door takes it (``harmony_options``)."""
        try:
            yield
        except NonFiniteLossError as error:
            raise NonFiniteLossError(
                f"HarmonyTrainer: the loss of step {self.state.global_step + 1} (transformers' count, as logged) is "
                f"{error.loss}; the step was undone (weights and optimizer state are as before it). Lower the learning "
                "rate, check the step's batches, or pass harmony_options={'skip_nonfinite': True} to skip such "
                "steps (transformers.Trainer would step on).", error.loss) from error

    def _scale_across_processes(self, passed: bool) -> int:
        """Under torchrun, what transformers multiplies each process's loss by outside the model: the
        number of processes where ``num_items_in_batch`` counts every process's labelled tokens
        (``average_tokens_across_devices``) and reached the loss, as its DDP step averages the
        processes' gradients (1/N) and so needs N times each; harmony sums them, so each process's
        weights are this over N. Inside a ``compute_loss`` harmony captures, transformers' own code
        multiplies (in the graph): 1 here. Else 1."""
        world = self.args.world_size
        if world == 1 or not (self.args.average_tokens_across_devices and passed) or self._trained() is not self.model:
            return 1
        return world

    @contextlib.contextmanager
    def _compute_loss_captured(self):
        """Around a harmony step, which may capture a ``compute_loss`` override with the model (its first
        step, a new batch shape): what the override records besides the loss while it is captured (TRL's
        metrics, ``.item()`` of a FakeTensor) is a symbol of the capture, not a number, and is dropped from
        the trainer's attributes (``_drop_symbols``), so that the log and ``trainer_state.json`` hold no
        symbol; an override that cannot be captured (a Python branch on such a value) is refused with
        what to do."""
        before = dict(vars(self))
        try:
            yield
        except CaptureError as error:
            trained = self._trained()
            if not isinstance(trained, _WithComputeLoss) or self.compute_loss_func is not None:
                raise
            owner = next(cls for cls in type(self).__mro__ if cls is not HarmonyTrainer and "compute_loss" in vars(cls))
            raise CaptureError(
                f"{error}\nHarmonyTrainer captures {owner.__qualname__}.compute_loss with the model, once, and trains "
                "on the loss it returns; it could not be captured (above). Where it does more than compute the loss "
                "(TRL's trainers compute the metrics they log with .item() and branch on them), give your class a "
                "compute_loss that computes the loss alone; for the loss the model computes from its labels "
                "(SFTTrainer's default, loss_type='nll'): def compute_loss(self, model, inputs, return_outputs=False, "
                "num_items_in_batch=None): return transformers.Trainer.compute_loss(self, model, inputs, "
                "return_outputs, num_items_in_batch)"
            ) from error
        finally:
            _drop_symbols(self, before)

    def _warn_of_one_mean(self, batches: list[dict]) -> None:
        """Once per trainer: the step's batches ran as one batch and the loss is the model's own mean
        (it ignores ``num_items_in_batch``), so it is the mean over all the step's samples or labelled
        tokens where transformers adds each batch's own mean: the two differ where the batches count
        differently (sizes, labelled tokens). Where every batch counts alike they are the same: no warning."""
        counts = [_counted(batch) for batch in batches]
        if self._warned_one_mean or len(set(counts)) == 1:
            return
        self._warned_one_mean = True
        microbatches, accumulated = self._microbatches(), self.args.gradient_accumulation_steps
        sizes = [_samples(batch) for batch in batches]
        if microbatches != accumulated:
            why, advice = (f"harmony_options microbatches={microbatches!r}, "
                           f"not gradient_accumulation_steps={accumulated}",
                           "leave microbatches out of harmony_options (it defaults to gradient_accumulation_steps)")
        elif len(set(sizes)) > 1:
            why, advice = (f"its batches differ in size ({sizes}: an epoch's last step)",
                           "pass TrainingArguments(dataloader_drop_last=True) to step only on whole batches")
        else:
            why, advice = (f"it holds {len(batches)} of gradient_accumulation_steps={accumulated} batches: an epoch's "
                           "last step", "give the epoch a multiple of gradient_accumulation_steps batches")
        warnings.warn(f"HarmonyTrainer: the {len(batches)} batches of a step ran as one batch ({why}), and the model's "
                      "loss is a mean of its own (it does not read num_items_in_batch): harmony's loss and gradients "
                      f"are the mean over the step's {sum(counts)} labelled tokens or samples, where "
                      "transformers.Trainer "
                      f"adds each batch's own mean (over {counts}), so they differ from transformers'. To step as "
                      f"transformers does, {advice}.", UserWarning, stacklevel=user_stacklevel())

    def _batches_are_microbatches(self, batches: list[dict]) -> bool:
        """Whether harmony cuts the step's batch into exactly its batches: as many microbatches as
        batches, all of one size (an even cut). An epoch's last step may hold fewer, or a smaller one."""
        return len({_samples(batch) for batch in batches}) == 1 and self._microbatches() == len(batches)

    def _microbatches(self) -> Any:
        """harmony's microbatches: harmony_options' own, else gradient_accumulation_steps."""
        return self._harmony_options.get("microbatches", self.args.gradient_accumulation_steps)

    def _reads_num_items_in(self, batch: dict) -> bool:
        """Whether the loss harmony trains on reads ``num_items_in_batch`` (a FakeTensor run of the
        forward, once)."""
        if self._reads_num_items is None:
            self._reads_num_items = _forward_reads(self._trained(), batch, "num_items_in_batch")
        return self._reads_num_items

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm harmony clipped by (``max_grad_norm``), for the log; NaN for a
        step ``skip_nonfinite`` skipped (no gradients were taken)."""
        norm = self.harmony.stats.grad_norm
        return torch.tensor(float("nan") if norm is None else norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """Without clipping transformers takes the norm of the parameters' gradients: NaN, as with
        clipping, for a step ``skip_nonfinite`` skipped (it has none: 0.0 would read as a step)."""
        skipped = self.harmony is not None and self.harmony.skipped_steps[-1:] == [self.harmony.step_count - 1]
        if grad_norm is None and skipped:
            return float("nan")
        return super()._get_grad_norm(model, grad_norm)

    def _harmony_for(self, batch: dict) -> Trainer:
        if self.harmony is None:
            if self.optimizer is None:
                self.create_optimizer()
            options = dict(self._harmony_options)
            options.setdefault("microbatches", self.args.gradient_accumulation_steps)
            max_grad_norm = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
            # across processes the optimizer state stays whole on every process: transformers saves
            # optimizer.pt from the main process alone
            across = {"shard_optimizer": False} if self.args.world_size > 1 else {}
            try:
                self.harmony = Trainer(self._trained(), None, self._host_optimizer, batch,
                                       max_grad_norm=max_grad_norm, **across, **options)
            except BudgetTooSmallError as error:
                if "microbatches" not in self._harmony_options:
                    error.add_note(
                        "HarmonyTrainer: each of transformers' batches is one microbatch (microbatches="
                        "gradient_accumulation_steps). For smaller microbatches with the same samples a step, lower "
                        "per_device_train_batch_size and raise gradient_accumulation_steps alike.")
                raise
        return self.harmony

    def _trained(self) -> nn.Module:
        """What harmony captures and trains: the model, or with a subclass's ``compute_loss``
        override, a ``compute_loss_func`` or label smoothing, the model inside ``compute_loss``
        (``_WithComputeLoss``), so that the loss it computes is the one trained on, as in transformers.
        The override may come before ``HarmonyTrainer`` in the MRO (a subclass) or after it (a class of
        both, ``class HarmonySFTTrainer(HarmonyTrainer, trl.SFTTrainer)``): ``HarmonyTrainer``'s own
        only hands transformers' on."""
        owner = next(cls for cls in type(self).__mro__ if cls is not HarmonyTrainer and "compute_loss" in vars(cls))
        if owner is transformers.Trainer and self.compute_loss_func is None and self.label_smoother is None:
            return self.model
        if self._with_compute_loss is None or self._with_compute_loss.model is not self.model:
            self._with_compute_loss = _WithComputeLoss(self.model, self.compute_loss)
        return self._with_compute_loss

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """transformers' ``prediction_step`` with the model's forward run by harmony, forward-only
        (``evaluate``, ``predict``): each batch shape is compiled on its first call and kept."""
        self.model.eval()  # harmony compiles the call in the model's state (dropout off)
        with self._autocast():
            return super().prediction_step(self._forward(), inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        """transformers' own, with the count of labelled tokens in host memory, where harmony's inputs
        are. ``prediction_step`` calls it, and the captured step where a subclass overrides it and
        calls it in turn."""
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.detach().cpu()
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _forward(self) -> HarmonyModule:
        if self._forward_module is None:
            # the NVMe tier and host_memory are the optimizer's: a forward holds no state
            options = {k: v for k, v in self._harmony_options.items()
                       if k not in (*_TRAINER_OPTIONS, *HOST_STATE_OPTIONS)}
            self._forward_module = harmony_compile(self.model, **options)
        return self._forward_module

    def _prepare_input(self, data: Any) -> Any:
        """Batches stay in host memory: harmony copies each microbatch to the device that runs it."""
        return data

    # ------------------------------------------------------------------ helpers
    def _autocast(self):
        """``bf16=True``: autocast on the device type harmony computes on (a HostDevice: the CPU's),
        as accelerate applies it around transformers' forward; harmony keys the call by it."""
        return torch.autocast(self.args.device.type, dtype=torch.bfloat16, enabled=bool(self.args.bf16))

    def _pad_token_id(self) -> int:
        for source in (self.processing_class, getattr(self.model, "config", None)):
            pad = getattr(source, "pad_token_id", None)
            if isinstance(pad, int):
                return pad
        return 0

    def _padding_side(self) -> str:
        return getattr(self.processing_class, "padding_side", "right")

    def _close_harmony(self) -> None:
        for compiled in (self.harmony, self._forward_module):
            if compiled is not None:
                compiled.close()
        self.harmony, self._forward_module, self._window = None, None, []


def _optimizer_chain(optimizer: Any) -> list:
    """``optimizer`` and each optimizer it wraps (accelerate's ``AcceleratedOptimizer.optimizer``)."""
    chain = []
    while optimizer is not None and optimizer not in chain:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


class _SteppedByHarmony(torch.optim.Optimizer):
    """What transformers holds as its optimizer: ``step()`` does nothing (harmony stepped the real
    optimizer during the backward); the parameter groups, state and ``state_dict`` are the real
    optimizer's, so the LR scheduler, the log and checkpoints see and change the real one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # not Optimizer.__init__, which would make parameter groups of its own
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def step(self, closure: Any = None) -> None:
        """Nothing: harmony's step updated the parameters."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


def _with_training_arguments(options: dict[str, Any], args: transformers.TrainingArguments) -> dict[str, Any]:
    """Harmony's options with what ``TrainingArguments`` says about them. Under torchrun each process
    computes on its own GPU (``cuda:LOCAL_RANK``, transformers' ``args.device``; without GPUs, a
    HostDevice) unless ``devices`` names others: harmony's default in one process, every GPU, would
    put every process on all of them."""
    if args.bf16 and options.get("precision") is not None:
        raise ValueError(f"{DOOR}: TrainingArguments(bf16=True) (bfloat16 autocast, as transformers.Trainer) and "
                         f"harmony_options precision={options['precision']!r} (harmony's own weights-and-transfers "
                         "precision) are two kinds of mixed precision; pass one of them")
    if args.world_size > 1 and options.get("devices") is None:
        options = {**options, "devices": [str(args.device)] if args.device.type == "cuda" else ["host:0"]}
    return options


class _WithComputeLoss(nn.Module):
    """The model inside the trainer's ``compute_loss`` (a subclass's override: class weights, a
    penalty on the outputs) as one module whose forward returns that loss: harmony captures the
    override with the model. ``num_items_in_batch`` reaches it as transformers passes it."""

    def __init__(self, model: nn.Module, compute_loss) -> None:
        super().__init__()
        self.model = model
        self.compute_loss = compute_loss

    def forward(self, **inputs: Any) -> torch.Tensor:
        num_items_in_batch = inputs.pop("num_items_in_batch", None)
        return self.compute_loss(self.model, inputs, num_items_in_batch=num_items_in_batch)


def _refusals(args: transformers.TrainingArguments, trainer_arguments: Mapping[str, Any],
              options: Mapping[str, Any]) -> list[str]:
    """What a harmony step cannot honor, each with what to do instead."""
    refused = []
    if args.fp16 or getattr(args, "fp16_full_eval", False):
        refused.append("fp16/fp16_full_eval: harmony computes in bfloat16 (no loss scaling); pass bf16=True instead")
    if getattr(args, "bf16_full_eval", False):
        refused.append("bf16_full_eval=True casts the model's weights, which are harmony's fp32 masters; "
                       "pass bf16=True (evaluation then computes in bf16 too)")
    if args.torch_compile:
        refused.append("torch_compile=True: HarmonyTrainer compiles the model itself; drop torch_compile")
    if args.deepspeed or args.fsdp or getattr(args, "parallelism_config", None) is not None:
        refused.append("deepspeed/fsdp/parallelism_config: harmony places the model itself; drop them and set "
                       "harmony_options={'devices': [...], 'memory_budget': ...}")
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        refused.append("activation (gradient) checkpointing: harmony chooses what to recompute under its "
                       "memory budget; drop activation_checkpointing/gradient_checkpointing (pass "
                       "gradient_checkpointing=False where it is on by default, as in TRL's SFTConfig, DPOConfig, ...)")
    if args.auto_find_batch_size:
        refused.append("auto_find_batch_size=True: harmony fits a batch to the memory budget by its microbatches; "
                       "set per_device_train_batch_size and harmony_options={'memory_budget': ...}")
    if getattr(args, "use_liger_kernel", False):
        refused.append("use_liger_kernel=True replaces the model's modules with fused kernels harmony cannot "
                       "split into packs; drop it")
    optim = str(getattr(args.optim, "value", args.optim))  # an OptimizerNames member once parsed
    if any(kind in optim.lower() for kind in ("lomo", "galore", "apollo")):
        refused.append(f"optim={optim!r} updates inside the backward or projects gradients itself; harmony "
                       "runs an ordinary torch optimizer on the host: choose e.g. optim='adamw_torch'")
    from transformers.trainer_seq2seq import Seq2SeqTrainer  # the class itself, wherever its name was rebound

    if getattr(args, "predict_with_generate", False) and not isinstance(trainer_arguments.get("self"), Seq2SeqTrainer):
        refused.append("predict_with_generate=True: HarmonyTrainer is a transformers.Trainer, whose evaluation "
                       "returns logits, not generated tokens; make a class of both, class HarmonySeq2SeqTrainer("
                       "HarmonyTrainer, Seq2SeqTrainer): pass (its loss runs through harmony, generate() eagerly "
                       "on the host model, outside the memory budget), or pass predict_with_generate=False")
    return refused


def _refuse_unsupported(args: transformers.TrainingArguments, trainer_arguments: Mapping[str, Any],
                        options: Mapping[str, Any]) -> None:
    refused = _refusals(args, trainer_arguments, options)
    if refused:
        raise ValueError("HarmonyTrainer cannot honor " + "; ".join(refused) + ".")


def _symbolic(value: Any) -> bool:
    """A value of a capture: a symbolic number (``.item()`` of a FakeTensor) or a tensor without data."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(value, (FakeTensor, FunctionalTensor))


def _drop_symbols(trainer: HarmonyTrainer, before: Mapping[str, Any]) -> None:
    """Take the capture's values out of ``trainer``'s attributes: an attribute that became one gets its
    value from ``before`` back (a token count), and one is removed from the dicts and lists an
    attribute holds, two levels deep (TRL's ``_metrics[mode][name]`` lists), with a list it leaves
    empty (a mean over it would divide by 0)."""
    def emptied(container: Any, depth: int) -> bool:
        """Drop the symbols in ``container``; whether that left it empty."""
        if isinstance(container, dict):
            for key in [key for key, value in container.items()
                        if _symbolic(value) or depth and emptied(value, depth - 1)]:
                del container[key]
        elif isinstance(container, list) and any(_symbolic(value) for value in container):
            container[:] = [value for value in container if not _symbolic(value)]
            return not container
        return False

    for name, value in list(vars(trainer).items()):
        if _symbolic(value):
            if name in before:
                setattr(trainer, name, before[name])
            else:
                delattr(trainer, name)
        else:
            emptied(value, 2)


def _forward_reads(model: nn.Module, batch: dict[str, Any], key: str) -> bool:
    """Whether ``model(**batch)`` reads the tensor ``batch[key]`` in any op, on FakeTensors; where
    the forward cannot run on them (a value read by Python), taken as read: the loss as harmony's
    graph computes it, unscaled."""
    read = False

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal read
            read = read or any(leaf is watched for leaf in pytree.tree_leaves((args, kwargs)))
            return func(*args, **(kwargs or {}))

    try:
        with buffers_put_back(model), fakes_of(batch) as fake:
            watched = fake[key]
            with _Watch():
                model(**fake)
    except Exception:  # noqa: BLE001 - FakeTensors' refusals; the modes are left by their own exits
        return True
    return read


def _weights_of_batch_means(sizes: list[int | None], batch: dict[str, Any], batches: list[dict[str, Any]],
                            adds: bool) -> list[float] | None:
    """Each microbatch's weight where harmony's microbatches (``sizes``) cut each of the step's batches
    further (more microbatches than batches, or an epoch's last step of fewer batches), so that each
    batch's loss is its own mean as transformers computes it: a microbatch's mean over the ``n``
    labelled tokens (or samples) it counts weighs ``n`` over its batch's count, divided by the number
    of batches where transformers divides by it (``adds`` false). ``None`` where a microbatch spans
    two batches, or counts nothing (its mean is 0/0)."""
    if None in sizes:
        return None
    ends = list(itertools.accumulate(sizes))
    batch_ends = list(itertools.accumulate(_samples(b) for b in batches))
    if not set(batch_ends) <= set(ends):
        return None
    scale = 1.0 if adds else 1.0 / len(batches)
    weights = []
    for start, end in zip([0, *ends], ends):
        owner = next(j for j, batch_end in enumerate(batch_ends) if end <= batch_end)
        counted = _counted({key: value[start:end] for key, value in batch.items()
                            if isinstance(value, torch.Tensor) and value.dim() > 0})
        if counted == 0:
            return None
        weights.append(scale * counted / _counted(batches[owner]))
    return weights


def _counted(batch: dict[str, Any]) -> int:
    """What a mean loss over ``batch`` divides by, as far as the batch says: its labelled tokens (integer
    ``labels`` other than -100), else its samples."""
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        return int((labels != _PAD_VALUES["labels"]).sum())
    return _samples(batch)


def _samples(batch: dict[str, Any]) -> int:
    """The samples of ``batch``: the length of its first tensor."""
    return len(next(value for value in batch.values() if isinstance(value, torch.Tensor)))


def _one_batch(batches: list[dict[str, Any]], pad_token_id: int, padding_side: str) -> dict[str, Any]:
    """The batches of one optimizer step as one batch (harmony's microbatches), each key's tensors
    concatenated along the batch. Batches padded to different lengths (``DataCollatorWithPadding``)
    are padded to the longest first, on the tokenizer's side, with ``-100`` labels and a zero
    attention mask, so the padding is masked out as the collator's own is."""
    if len(batches) == 1:
        return dict(batches[0])
    whole = {}
    for key in batches[0]:
        values = [batch[key] for batch in batches]
        if not all(isinstance(value, torch.Tensor) for value in values):
            if any(value != values[0] for value in values[1:]):
                raise ValueError(f"the batches of one optimizer step differ in their non-tensor input {key!r}; "
                                 "harmony runs them as one batch: make it the same in every batch")
            whole[key] = values[0]
            continue
        whole[key] = torch.cat(_padded(key, values, pad_token_id, padding_side, batches))
    return whole


def _padded(key: str, values: list[torch.Tensor], pad_token_id: int, padding_side: str,
            batches: list[dict[str, Any]]) -> list[torch.Tensor]:
    if all(value.shape[1:] == values[0].shape[1:] for value in values):
        return values
    if values[0].dim() < 2 or any(value.shape[2:] != values[0].shape[2:] for value in values):
        raise ValueError(f"the batches of one optimizer step have {key!r} of shapes "
                         f"{[tuple(v.shape) for v in values]}, which differ past the sequence dim; harmony runs "
                         "them as one batch: give them one shape (e.g. padding='max_length')")
    if "attention_mask" not in batches[0] and "position_ids" in batches[0] and values[0].shape[0] == 1:
        # padding-free batches: each one row of sequences laid end to end, told apart by their
        # position_ids; padding one to another's length would add a sequence of padding
        raise ValueError(f"the batches of one optimizer step are padding-free (one row of "
                         f"{sorted({v.shape[1] for v in values})} tokens, sequences told apart by position_ids: "
                         "DataCollatorWithFlattening, TRL's padding_free or packing) and harmony runs them as one "
                         "batch, which would need them of one length: use gradient_accumulation_steps=1 with a larger "
                         "per_device_train_batch_size, or batches of one length (TRL's packing_strategy='wrapped')")
    if "attention_mask" not in batches[0] or padding_side != "right":
        fix = ("pad on the right (tokenizer.padding_side = 'right' for training)" if "attention_mask" in batches[0]
               else "pass the attention mask")
        raise ValueError("the batches of one optimizer step are padded to different lengths "
                         f"({sorted({v.shape[1] for v in values})}) and harmony runs them as one batch, padded to the "
                         f"longest: that keeps the numbers only with an attention_mask and right padding. So {fix}, "
                         "or pad every batch to one length (padding='max_length', max_length=...; "
                         "pad_to_multiple_of only where it makes them one)")
    length = max(value.shape[1] for value in values)
    fill = _PAD_VALUES.get(key, pad_token_id if key == "input_ids" else 0)
    return [torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, length - value.shape[1]), value=fill)
            for value in values]
