"""``HarmonyTrainer`` against ``transformers.Trainer`` without harmony: the same seeds, data and
``TrainingArguments`` (AdamW, linear warmup, ``max_grad_norm=1.0`` that clips,
``gradient_accumulation_steps=2``, an evaluation in the middle), each step's logged loss within 1e-5
relative; a run resumed from its checkpoint continues as the unbroken one; the same with a ``peft``
LoRA model, whose gradient traffic is the adapters' bytes; batches padded to changing lengths; the
environment's options; and what the integration refuses."""
from __future__ import annotations

import math
import functools
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import harmony_fx

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from harmony_fx.integrations.huggingface import HarmonyTrainer  # noqa: E402
from harmony_fx.testing.hf_models import IGNORE_INDEX, VOCAB, build_hf_model  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
RTOL = 1e-5
STEPS = 10
SEQ = 16


class _Tokens(torch.utils.data.Dataset):
    """Random token sequences, labelled as a causal LM's (the input ids), the tail of some ignored;
    ``lengths``: each sample's own length (the collator pads), else all ``SEQ`` long."""

    def __init__(self, size: int, seed: int, lengths: list[int] | None = None) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.lengths = lengths or [SEQ] * size
        self.ids = [torch.randint(2, VOCAB, (n,), generator=generator) for n in self.lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        ids = self.ids[index]
        if len(set(self.lengths)) > 1:
            return {"input_ids": ids.tolist()}  # DataCollatorWithPadding pads lists
        labels = ids.clone()
        labels[SEQ - index % 5:] = IGNORE_INDEX
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _arguments(output_dir, **overrides) -> transformers.TrainingArguments:
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                    gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=3e-3, lr_scheduler_type="linear",
                    warmup_steps=3, max_grad_norm=1.0, optim="adamw_torch", weight_decay=0.01, logging_steps=1,
                    eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=5, report_to=[],
                    seed=0, disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
    return transformers.TrainingArguments(**{**settings, **overrides})


def _train(trainer_class, model, output_dir, resume=None, train_data=None, collator=None, **kwargs):
    """Train, and return the trainer and the log: each step's (loss, learning rate, grad norm), and
    each evaluation's (step, eval loss)."""
    trainer = trainer_class(model=model, args=_arguments(output_dir, **kwargs.pop("arguments", {})),
                            train_dataset=train_data or _Tokens(64, seed=0), eval_dataset=_Tokens(8, seed=1),
                            data_collator=collator, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    steps = {entry["step"]: (entry["loss"], entry["learning_rate"], entry["grad_norm"])
             for entry in history if "loss" in entry}
    evaluations = [(entry["step"], entry["eval_loss"]) for entry in history if "eval_loss" in entry]
    return trainer, steps, evaluations


def _assert_same_steps(steps: dict, expected: dict, rtol: float = RTOL) -> None:
    assert steps.keys() == expected.keys()
    for step, ((loss, lr, norm), (ref_loss, ref_lr, ref_norm)) in zip(steps, zip(steps.values(), expected.values())):
        assert loss == pytest.approx(ref_loss, rel=rtol), f"step {step}: loss {loss} != eager's {ref_loss}"
        assert lr == pytest.approx(ref_lr, rel=1e-9), f"step {step}: learning rate {lr} != eager's {ref_lr}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"step {step}: grad norm {norm} != eager's {ref_norm}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The eager run, harmony's (saving at step 5 and 10), and harmony's resumed from step 5."""
    eager = _train(transformers.Trainer, build_hf_model("llama"), tmp_path_factory.mktemp("eager"))
    folder = tmp_path_factory.mktemp("harmony")
    harmony = _train(HarmonyTrainer, build_hf_model("llama"), folder, harmony_options={"memory_budget": "1MiB"})
    resumed = _train(HarmonyTrainer, build_hf_model("llama", seed=7), tmp_path_factory.mktemp("resumed"),
                     resume=str(folder / "checkpoint-5"), harmony_options={"memory_budget": "1MiB"})
    return eager, harmony, resumed


def test_each_step_equals_transformers_trainer(runs):
    (_, eager_steps, eager_evaluations), (trainer, steps, evaluations), _ = runs
    assert len(steps) == STEPS
    _assert_same_steps(steps, eager_steps)
    assert max(norm for _, _, norm in steps.values()) > 1.0, "max_grad_norm=1.0 never clipped: the test shows nothing"
    assert [step for step, _ in evaluations] == [step for step, _ in eager_evaluations] == [5, 10]
    for (step, loss), (_, expected) in zip(evaluations, eager_evaluations):
        assert loss == pytest.approx(expected, rel=RTOL), f"evaluation at step {step}"
    # harmony ran it: in packs under the budget, its microbatches the accumulated batches
    assert len(trainer.harmony.plan.packs) > 1
    assert trainer.harmony.hm.num_microbatches == 2
    assert not trainer.accelerator.device_placement


def test_two_devices_without_gradient_accumulation_step_as_transformers_trainer(tmp_path):
    """The default gradient_accumulation_steps=1 is one microbatch: the two devices run it as a
    pipeline (it was refused as data parallelism, which needs a microbatch per device)."""
    arguments = {"gradient_accumulation_steps": 1, "per_device_train_batch_size": 8, "max_steps": 3}
    _, expected, _ = _train(transformers.Trainer, build_hf_model("llama"), tmp_path / "eager", arguments=arguments)
    trainer, steps, _ = _train(HarmonyTrainer, build_hf_model("llama"), tmp_path / "harmony", arguments=arguments,
                               harmony_options={"memory_budget": "1MiB", "devices": ["host:0", "host:1"]})
    _assert_same_steps(steps, expected)
    assert trainer.harmony.hm.device_microbatches == [(0,), (0,)]


def test_a_resumed_run_continues_as_the_unbroken_one(runs):
    """Resumed from step 5 in a new trainer over a differently seeded model: the checkpoint's
    weights, optimizer, scheduler and RNG states make steps 6-10 (and the evaluation at 10) those
    of the unbroken run; the log of steps 1-5 is the checkpoint's."""
    _, (_, steps, evaluations), (resumed, resumed_steps, resumed_evaluations) = runs
    assert resumed.harmony.step_count == STEPS - 5  # the steps harmony ran after resuming
    _assert_same_steps(resumed_steps, steps, rtol=1e-6)
    assert [step for step, _ in resumed_evaluations] == [step for step, _ in evaluations]
    assert [loss for _, loss in resumed_evaluations] == pytest.approx([loss for _, loss in evaluations], rel=1e-6)


def test_checkpoints_with_the_optimizer_state_on_the_nvme_tier_resume_as_the_unbroken_run(runs, tmp_path):
    """``harmony_options={"nvme_path": ...}``: transformers' checkpoint files hold the whole optimizer
    state, the tier's read back (it was refused: they held host memory's alone); a run resumed from
    step 5 continues as the unbroken run without a tier."""
    _, (_, steps, evaluations), _ = runs
    options = {"memory_budget": "1MiB", "nvme_path": str(tmp_path / "tier")}
    folder = tmp_path / "tiered"
    trainer, tiered_steps, _ = _train(HarmonyTrainer, build_hf_model("llama"), folder, harmony_options=options)
    assert trainer.harmony.plan.tier_packs
    _assert_same_steps(tiered_steps, steps, rtol=1e-6)
    saved = torch.load(folder / "checkpoint-5" / "optimizer.pt", weights_only=True)["state"]
    assert len(saved) == len(list(trainer.model.parameters())) and all("exp_avg" in s for s in saved.values())
    options["nvme_path"] = str(tmp_path / "tier-resumed")
    _, resumed_steps, resumed_evaluations = _train(HarmonyTrainer, build_hf_model("llama", seed=7), tmp_path / "resumed",
                                                   resume=str(folder / "checkpoint-5"), harmony_options=options)
    _assert_same_steps(resumed_steps, steps, rtol=1e-6)
    assert [loss for _, loss in resumed_evaluations] == pytest.approx([loss for _, loss in evaluations], rel=1e-6)


def test_lora_equals_transformers_trainer_and_moves_only_the_adapters_gradients(tmp_path, monkeypatch):
    """A ``peft`` LoRA model: the same losses as eager's; the weight gradients leaving the device
    are the adapters' bytes, and the optimizer holds state for them alone. The options come from
    the environment this time (HARMONY_FX_MEMORY_BUDGET)."""
    peft = pytest.importorskip("peft")

    def lora_model():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(build_hf_model("llama"), config)

    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 4}
    _, eager_steps, _ = _train(transformers.Trainer, lora_model(), tmp_path / "eager", arguments=arguments)
    monkeypatch.setenv("HARMONY_FX_MEMORY_BUDGET", "1MiB")
    model = lora_model()
    trainer, steps, _ = _train(HarmonyTrainer, model, tmp_path / "harmony", arguments=arguments)
    _assert_same_steps(steps, eager_steps)
    assert trainer.harmony.hm.options.memory_budget == 2**20
    adapters = [param for name, param in model.named_parameters() if "lora_" in name]
    adapter_bytes = sum(param.numel() * param.element_size() for param in adapters)
    assert adapter_bytes < sum(p.numel() * p.element_size() for p in model.parameters()) / 10
    assert trainer.harmony.stats.as_dict()["bytes_by_kind"]["d2h/wgrad"] == adapter_bytes
    assert {id(param) for param in trainer.optimizer.state} == {id(param) for param in adapters}


def test_batches_padded_to_changing_lengths_equal_eager(tmp_path):
    """``DataCollatorWithPadding``: every batch is padded to its own longest sequence; the two
    batches of an optimizer step are padded to the longer one (masked out) and run as one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]")
    padding = transformers.DataCollatorWithPadding(tokenizer)

    def collate(features):
        batch = dict(padding(features))
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return batch

    # each optimizer step's two batches of 4 have other lengths (9 and 12, 14 and 7, 16 and 11)
    data = _Tokens(24, seed=3, lengths=[5, 9, 7, 6, 12, 4, 8, 10, 14, 3, 6, 9, 7, 5, 6, 4, 16, 8, 9, 7, 11, 10, 5, 6])
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3, "train_sampling_strategy": "sequential"}
    _, eager_steps, _ = _train(transformers.Trainer, build_hf_model("llama"), tmp_path / "eager", train_data=data,
                               collator=collate, arguments=arguments)
    trainer, steps, _ = _train(HarmonyTrainer, build_hf_model("llama"), tmp_path / "harmony", train_data=data,
                               collator=collate, arguments=arguments)
    _assert_same_steps(steps, eager_steps)
    assert len(trainer.harmony.hm.variants) == 3  # one program per step's length (12, 14, 16)


def test_padding_free_batches_of_a_step_are_refused_saying_what_to_do(tmp_path):
    """``DataCollatorWithFlattening`` (TRL's ``padding_free``): each batch is one row of sequences
    end to end; two of different lengths cannot be one batch, and padding one would add a sequence of
    padding. The advice was to pass the attention mask or pad every batch alike, which such a
    collator cannot do."""
    data = _Tokens(8, seed=3, lengths=[5, 9, 7, 6, 12, 4, 8, 10])
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 1, "per_device_train_batch_size": 2,
                 "train_sampling_strategy": "sequential"}
    with pytest.raises(ValueError, match=r"padding-free \(one row of \[\d+, \d+\] tokens.*"
                                         r"gradient_accumulation_steps=1 with a larger per_device_train_batch_size"):
        _train(HarmonyTrainer, build_hf_model("llama"), tmp_path, train_data=data,
               collator=transformers.DataCollatorWithFlattening(), arguments=arguments,
               harmony_options={"memory_budget": "1MiB"})


class _Labelled(torch.utils.data.Dataset):
    """Random token sequences with a class each, for a sequence classifier."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(2, VOCAB, (size, SEQ), generator=generator)
        self.labels = torch.randint(0, 3, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def _classifier():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))


class _InBatchNegatives(torch.nn.Module):
    """A contrastive loss over each batch (every sample scored against every other): a batch of
    transformers' gradient accumulation is computed apart, and so is each harmony microbatch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.project = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 16)

    def forward(self, input_ids, attention_mask=None, labels=None):
        z = F.normalize(self.project(self.embed(input_ids).mean(1)), dim=-1)
        return {"loss": F.cross_entropy(z @ z.T / 0.1, torch.arange(len(z)))}


def test_batches_computed_apart_step_as_transformers_and_warn_of_nothing(tmp_path):
    """The microbatches are transformers' own batches: the warning that a cut may differ from the
    whole batch (true of harmony_fx.compile's microbatches) said something false here."""
    import warnings

    import harmony_fx

    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    _, eager_steps, _ = _train(transformers.Trainer, _InBatchNegatives(), tmp_path / "eager", arguments=arguments)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, steps, _ = _train(HarmonyTrainer, _InBatchNegatives(), tmp_path / "harmony", arguments=arguments,
                             harmony_options={"memory_budget": "64KiB"})
    _assert_same_steps(steps, eager_steps)
    assert not [w for w in caught if issubclass(w.category, harmony_fx.MicrobatchesComputeApart)]


def test_a_classifier_whose_loss_ignores_num_items_adds_its_batch_losses_as_transformers_does(tmp_path):
    """BERT's sequence classification head takes ``**kwargs`` (so transformers neither divides its
    loss by the accumulation steps nor has it divided by ``num_items_in_batch``) and computes a
    plain mean: transformers' step adds the two batches' means. Harmony's loss was their mean,
    half of transformers' (and so were the gradients): now the same, step by step."""
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    _, eager_steps, _ = _train(transformers.Trainer, _classifier(), tmp_path / "eager", train_data=_Labelled(32),
                               arguments=arguments)
    _, steps, _ = _train(HarmonyTrainer, _classifier(), tmp_path / "harmony", train_data=_Labelled(32),
                         arguments=arguments)
    _assert_same_steps(steps, eager_steps)


@pytest.mark.parametrize("overrides,match", [
    ({"torch_compile": True}, r"torch_compile=True: HarmonyTrainer compiles the model itself; drop torch_compile"),
    ({"auto_find_batch_size": True}, r"auto_find_batch_size=True: harmony fits a batch to the memory budget"),
    ({"gradient_checkpointing": True}, r"activation \(gradient\) checkpointing: .*\(pass gradient_checkpointing=False "
                                       r"where it is on by default, as in TRL's SFTConfig"),
])
def test_what_a_harmony_step_cannot_honor_is_refused_with_what_to_do(tmp_path, overrides, match):
    with pytest.raises(ValueError, match="HarmonyTrainer cannot honor " + match):
        HarmonyTrainer(model=build_hf_model("llama"), args=_arguments(tmp_path, **overrides),
                       train_dataset=_Tokens(8, seed=0))


class _ClassWeighted:
    """The imbalanced-classes recipe: cross entropy weighing the classes, read from the logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs.logits, labels, weight=torch.tensor([0.2, 1.0, 3.0]))
        return (loss, outputs) if return_outputs else loss


class _Penalised:
    """transformers' own loss, plus a penalty on the logits (an override calling super())."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss + 0.1 * outputs.logits.logsumexp(-1).square().mean()
        return (loss, outputs) if return_outputs else loss


def _class_weighted_loss(outputs, labels, num_items_in_batch=None):
    return F.cross_entropy(outputs.logits, labels, weight=torch.tensor([0.2, 1.0, 3.0]))


def test_label_smoothing_is_captured_with_the_model(tmp_path):
    """transformers smooths the labels in compute_loss, outside the model (it was refused); its
    evaluation shifts a causal LM's labels as transformers does, which it decides from the model's
    class (the compiled module's was unshifted: 0.5 below eager's)."""
    arguments = {"eval_strategy": "steps", "eval_steps": 3, "save_strategy": "no", "max_steps": 3,
                 "label_smoothing_factor": 0.1}
    _, eager_steps, eager_evaluations = _train(transformers.Trainer, build_hf_model("llama"), tmp_path / "eager",
                                               arguments=arguments)
    _, steps, evaluations = _train(HarmonyTrainer, build_hf_model("llama"), tmp_path / "harmony", arguments=arguments,
                                   harmony_options={"memory_budget": "1MiB"})
    _assert_same_steps(steps, eager_steps)
    assert [step for step, _ in evaluations] == [step for step, _ in eager_evaluations] == [3]
    assert evaluations[0][1] == pytest.approx(eager_evaluations[0][1], rel=RTOL)


def test_transformers_trainer_given_the_compiled_module_smooths_a_causal_lms_shifted_labels(tmp_path):
    """``transformers.Trainer(model=hm)``: transformers decides from the model's class name whether to
    shift the labels it smooths; it read the compiled module's and smoothed them unshifted (5.22
    against 4.86 at the first step, silently)."""
    import harmony_fx

    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 2, "label_smoothing_factor": 0.1}
    _, eager_steps, _ = _train(transformers.Trainer, build_hf_model("llama"), tmp_path / "eager", arguments=arguments)
    hm = harmony_fx.compile(build_hf_model("llama"), memory_budget="1MiB")
    _, steps, _ = _train(transformers.Trainer, hm, tmp_path / "harmony", arguments=arguments)
    _assert_same_steps(steps, eager_steps)


def test_a_compute_loss_func_is_what_the_step_trains_on(tmp_path):
    """``compute_loss_func`` was refused; it is captured with the model, as an override is."""
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    _, eager_steps, _ = _train(transformers.Trainer, _classifier(), tmp_path / "eager", train_data=_Labelled(32),
                               arguments=arguments, compute_loss_func=_class_weighted_loss)
    _, steps, _ = _train(HarmonyTrainer, _classifier(), tmp_path / "harmony", train_data=_Labelled(32),
                         arguments=arguments, compute_loss_func=_class_weighted_loss,
                         harmony_options={"memory_budget": "1MiB"})
    _assert_same_steps(steps, eager_steps)


@pytest.mark.parametrize("override", ["class-weighted", "penalised"])
def test_a_compute_loss_override_is_what_the_step_trains_on(tmp_path, override):
    """The step trained on the model's own loss, ignoring the override (used in evaluation alone):
    now the override is captured with the model, and the steps are transformers' with it."""
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    if override == "class-weighted":
        mixin, model_of, data = _ClassWeighted, _classifier, {"train_data": _Labelled(32)}
    else:
        mixin, model_of, data = _Penalised, functools.partial(build_hf_model, "llama"), {}
    _, eager_steps, _ = _train(type("Eager", (mixin, transformers.Trainer), {}), model_of(), tmp_path / "eager",
                               arguments=arguments, **data)
    _, steps, _ = _train(type("Harmony", (mixin, HarmonyTrainer), {}), model_of(), tmp_path / "harmony",
                         arguments=arguments, harmony_options={"memory_budget": "1MiB"}, **data)
    _assert_same_steps(steps, eager_steps)
    _, plain_steps, _ = _train(transformers.Trainer, model_of(), tmp_path / "plain", arguments=arguments, **data)
    assert steps[1][0] != pytest.approx(plain_steps[1][0], rel=1e-4)  # the override changed the loss


class _NoLossKwargs(torch.nn.Module):
    """A model whose forward takes no ``**kwargs``: transformers passes it no ``num_items_in_batch``
    and divides each batch's mean loss by the accumulation steps."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_hf_model("llama")

    def forward(self, input_ids, attention_mask, labels):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_a_model_without_loss_kwargs_steps_as_transformers_divides_its_batch_means(tmp_path):
    """Its batches hold different counts of labelled tokens: harmony weighed each by its count (the
    whole step's mean), where transformers adds each batch's own mean over the accumulation steps."""
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    _, eager_steps, _ = _train(transformers.Trainer, _NoLossKwargs(), tmp_path / "eager",
                               arguments=arguments)
    _, steps, _ = _train(HarmonyTrainer, _NoLossKwargs(), tmp_path / "harmony", arguments=arguments,
                         harmony_options={"memory_budget": "1MiB"})
    _assert_same_steps(steps, eager_steps)


def test_neftune_noise_is_drawn_in_the_graph_as_transformers_draws_it(tmp_path):
    """NEFTune's noise comes from a forward hook on the embeddings, which the capture keeps (it was
    refused): batches of one length step as transformers' do, the noise included."""
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3, "neftune_noise_alpha": 5.0}
    _, eager_steps, _ = _train(transformers.Trainer, build_hf_model("llama"), tmp_path / "eager", arguments=arguments)
    trainer, steps, _ = _train(HarmonyTrainer, build_hf_model("llama"), tmp_path / "harmony", arguments=arguments,
                               harmony_options={"memory_budget": "1MiB"})
    _assert_same_steps(steps, eager_steps)
    _, quiet_steps, _ = _train(transformers.Trainer, build_hf_model("llama"), tmp_path / "quiet",
                               arguments={**arguments, "neftune_noise_alpha": None})
    assert steps[1][0] != pytest.approx(quiet_steps[1][0], rel=1e-6)  # the noise was there


def test_an_unknown_harmony_option_names_the_nearest(tmp_path):
    with pytest.raises(TypeError, match=r"'memory_budgt' \(did you mean 'memory_budget'\?\)"):
        HarmonyTrainer(model=build_hf_model("llama"), args=_arguments(tmp_path), train_dataset=_Tokens(8, seed=0),
                       harmony_options={"memory_budgt": "1GiB"})


def test_harmony_imports_without_the_hf_extra():
    """With transformers, accelerate and peft hidden, ``import harmony_fx`` (and the integrations
    package) works, and the integration's ImportError says which extra to install."""
    hide = ("import sys\n"
            "class Hidden:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('transformers', 'accelerate', 'peft'):\n"
            "            raise ImportError(f'hidden: {name}')\n"
            "sys.meta_path.insert(0, Hidden())\n")
    check = ("import harmony_fx, harmony_fx.integrations, harmony_fx.backend\n"
             "try:\n"
             "    import harmony_fx.integrations.huggingface\n"
             "except ImportError as error:\n"
             "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", hide + check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install 'harmony-fx[hf]'" in result.stdout


def test_bf16_is_autocast_as_in_transformers_trainer(tmp_path):
    """``bf16=True``: each step runs under bfloat16 autocast as transformers' does (fp32 weights),
    through harmony's packs under half the budget; the losses are eager's, and not fp32's."""
    arguments = {"bf16": True, "max_steps": 4, "eval_strategy": "no", "save_strategy": "no"}
    _, eager_steps, _ = _train(transformers.Trainer, build_hf_model("llama"), tmp_path / "eager", arguments=arguments)
    trainer, steps, _ = _train(HarmonyTrainer, build_hf_model("llama"), tmp_path / "harmony", arguments=arguments,
                               harmony_options={"memory_budget": "1MiB"})
    _, fp32_steps, _ = _train(transformers.Trainer, build_hf_model("llama"), tmp_path / "fp32",
                              arguments={**arguments, "bf16": False})
    _assert_same_steps(steps, eager_steps)
    assert [loss for loss, _, _ in steps.values()] != [loss for loss, _, _ in fp32_steps.values()]
    assert len(trainer.harmony.plan.packs) > 1
    assert next(iter(trainer.model.parameters())).dtype == torch.float32


def test_harmonys_own_bf16_trains_llama_from_fp32_masters(tmp_path):
    """``harmony_options={"precision": "bf16"}`` on Llama (fp32 casts in its norms, rotary
    embeddings and attention): the first step's loss is the model's in bfloat16, and the updates
    land in fp32 masters (values bf16 cannot hold)."""
    arguments = {"max_steps": 4, "eval_strategy": "no", "save_strategy": "no"}
    trainer, steps, _ = _train(HarmonyTrainer, build_hf_model("llama"), tmp_path / "harmony", arguments=arguments,
                               harmony_options={"precision": "bf16", "memory_budget": "1MiB"})
    _, in_bf16, _ = _train(transformers.Trainer, build_hf_model("llama").to(torch.bfloat16), tmp_path / "bf16",
                           arguments=arguments)
    losses, bf16_losses = [loss for loss, _, _ in steps.values()], [loss for loss, _, _ in in_bf16.values()]
    assert losses[0] == pytest.approx(bf16_losses[0], rel=1e-3)
    assert len(trainer.harmony.plan.packs) > 1
    params = list(trainer.model.parameters())
    assert all(param.dtype == torch.float32 for param in params)
    assert all((param.detach() != param.detach().bfloat16().float()).any() for param in params)


def test_bf16_and_harmonys_own_precision_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="two kinds of mixed precision"):
        HarmonyTrainer(model=build_hf_model("llama"), args=_arguments(tmp_path, bf16=True),
                       train_dataset=_Tokens(8, seed=0), harmony_options={"precision": "bf16"})


def test_lora_over_a_bf16_base_keeps_and_moves_the_frozen_weights_in_bf16(tmp_path):
    """The usual way to halve the frozen weights' bytes: the base in bfloat16, the adapters in fp32.
    Harmony keeps the model's own tensors as its host masters and moves each weight in its dtype: the
    planned weight bytes are the model's own (2 per frozen parameter), the measured copies equal the
    plan, the weight gradients leaving the device are the fp32 adapters' bytes, and the losses
    equal eager's on the same mixed model."""
    peft = pytest.importorskip("peft")

    def lora_model():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(build_hf_model("llama").to(torch.bfloat16), config)
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
        return model

    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    _, eager_steps, _ = _train(transformers.Trainer, lora_model(), tmp_path / "eager", arguments=arguments)
    model = lora_model()
    trainer, steps, _ = _train(HarmonyTrainer, model, tmp_path / "harmony", arguments=arguments,
                               harmony_options={"memory_budget": "1MiB"})
    _assert_same_steps(steps, eager_steps)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16} and {p.dtype for p in adapters} == {torch.float32}
    # the packs' weights: every parameter in its own dtype, and the buffers the graph reads (of
    # the model's: the rotary frequencies)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert param_bytes <= sum(pack.weight_bytes for pack in trainer.harmony.plan.packs) <= param_bytes + buffer_bytes
    moved = trainer.harmony.stats.as_dict()["bytes_by_kind"]
    assert moved == trainer.harmony.plan.predicted_bytes
    assert moved["d2h/wgrad"] == sum(p.numel() * p.element_size() for p in adapters)


def test_a_masked_lm_whose_loss_ignores_num_items_adds_its_batch_means_over_their_own_tokens(tmp_path):
    """BERT's masked-LM head takes ``**kwargs`` but its loss is a mean over the batch's own labelled
    tokens: transformers' step adds the two batches' means, which weigh a token by its own batch's
    count. The batches of one step are harmony's microbatches, each loss weighed 1 as transformers
    weighs it (the tails of some samples ignored: the batches hold different counts)."""
    def masked_lm():
        torch.manual_seed(0)
        return build_hf_model("bert")

    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    _, eager_steps, _ = _train(transformers.Trainer, masked_lm(), tmp_path / "eager", arguments=arguments)
    _, steps, _ = _train(HarmonyTrainer, masked_lm(), tmp_path / "harmony", arguments=arguments,
                         harmony_options={"memory_budget": "1MiB"})
    _assert_same_steps(steps, eager_steps)


def test_a_step_run_as_one_batch_over_a_mean_of_its_own_warns_where_it_differs_from_transformers(tmp_path):
    """With microbatches other than gradient_accumulation_steps the step's batches run as one batch:
    a loss that is the model's own mean (BERT's masked LM, over labelled tokens the two batches count
    differently) is then the mean over the whole step, not transformers' sum of the batches' means.
    That was silent; now a warning says so, once, and how to step as transformers does. A classifier
    whose batches count alike steps as transformers does and is not warned about."""
    import warnings

    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 2}
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"batches of a step ran as one batch \(harmony_options microbatches=1, not "
                      r"gradient_accumulation_steps=2\).*leave microbatches out of harmony_options") as caught:
        _train(HarmonyTrainer, build_hf_model("bert"), tmp_path / "masked", arguments=arguments,
               harmony_options={"memory_budget": "1MiB", "microbatches": 1})
    assert len([w for w in caught if "ran as one batch" in str(w.message)]) == 1
    _, eager_steps, _ = _train(transformers.Trainer, _classifier(), tmp_path / "eager", train_data=_Labelled(32),
                               arguments=arguments)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, steps, _ = _train(HarmonyTrainer, _classifier(), tmp_path / "classifier", train_data=_Labelled(32),
                             arguments=arguments, harmony_options={"microbatches": 1})
    _assert_same_steps(steps, eager_steps)
    assert not [w for w in caught if "ran as one batch" in str(w.message)]


def test_a_mean_of_its_own_over_microbatches_cutting_each_batch_steps_as_transformers_adds_batch_means(tmp_path):
    """More microbatches than batches (4 for a step of 2 batches of 4): each microbatch lies in one
    batch, and weighs its labelled tokens over its batch's, so each batch's loss is its own mean as
    transformers adds them (BERT's masked LM, the batches counting differently). It differed and
    warned before. A cut across the batches (3 microbatches: 3, 3, 2) still warns."""
    import warnings

    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    torch.manual_seed(0)
    _, eager_steps, _ = _train(transformers.Trainer, build_hf_model("bert"), tmp_path / "eager", arguments=arguments)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, steps, _ = _train(HarmonyTrainer, build_hf_model("bert"), tmp_path / "four", arguments=arguments,
                             harmony_options={"memory_budget": "1MiB", "microbatches": 4})
    _assert_same_steps(steps, eager_steps)
    assert not [w for w in caught if "ran as one batch" in str(w.message)]
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"ran as one batch \(harmony_options microbatches=3"):
        _train(HarmonyTrainer, build_hf_model("bert"), tmp_path / "three", arguments={**arguments, "max_steps": 1},
               harmony_options={"memory_budget": "1MiB", "microbatches": 3})


class _Pairs(torch.utils.data.Dataset):
    """Source and target token sequences for a sequence-to-sequence model."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(2, VOCAB, (size, SEQ), generator=generator)
        self.labels = torch.randint(2, VOCAB, (size, 6), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[index]}


def test_predict_with_generate_is_refused_unless_the_trainer_is_also_a_seq2seq_trainer(tmp_path):
    """HarmonyTrainer alone is a transformers.Trainer: Seq2SeqTrainingArguments(predict_with_generate=True)
    was ignored and the evaluation handed logits to a compute_metrics that decodes generated tokens.
    Now refused, naming the class that honors it; that class (HarmonyTrainer and Seq2SeqTrainer)
    trains and evaluates, generation included, as Seq2SeqTrainer does."""
    def t5():
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
            dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))

    def arguments(folder):
        return transformers.Seq2SeqTrainingArguments(
            output_dir=str(tmp_path / folder), per_device_train_batch_size=4, per_device_eval_batch_size=4,
            gradient_accumulation_steps=2, max_steps=2, learning_rate=3e-3, predict_with_generate=True,
            generation_max_length=8, logging_steps=1, eval_strategy="no", save_strategy="no", report_to=[],
            disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)

    with pytest.raises(ValueError, match=r"HarmonyTrainer cannot honor predict_with_generate=True: .*"
                                         r"class HarmonySeq2SeqTrainer\(HarmonyTrainer, Seq2SeqTrainer\)"):
        HarmonyTrainer(model=t5(), args=arguments("refused"), train_dataset=_Pairs(16))

    class HarmonySeq2SeqTrainer(HarmonyTrainer, transformers.Seq2SeqTrainer):
        pass

    results = []
    for trainer_class, options in ((transformers.Seq2SeqTrainer, {}),
                                   (HarmonySeq2SeqTrainer, {"harmony_options": {"memory_budget": "256KiB"}})):
        trainer = trainer_class(model=t5(), args=arguments(trainer_class.__name__), train_dataset=_Pairs(16),
                                eval_dataset=_Pairs(8), **options)
        trainer.train()
        prediction = trainer.predict(_Pairs(8))
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        results.append((losses, prediction.predictions, prediction.metrics["test_loss"]))
    (eager_losses, eager_tokens, eager_loss), (losses, tokens, loss) = results
    assert losses == pytest.approx(eager_losses, rel=RTOL)
    assert loss == pytest.approx(eager_loss, rel=RTOL)
    assert (tokens == eager_tokens).all()  # generated tokens, not logits


class _Answers(torch.utils.data.Dataset):
    """Question answering: a start or end position past the sequence is ignored (transformers
    clamps it to ignore_index), so the start and end losses are means over different counts."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [{"input_ids": torch.randint(2, VOCAB, (SEQ,), generator=generator),
                       "start_positions": torch.tensor([3, 20, 5, 1][i % 4]),
                       "end_positions": torch.tensor([6, 8, 30, 2][i % 4])} for i in range(count)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def _answerer():
    torch.manual_seed(0)
    return transformers.BertForQuestionAnswering(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def test_a_loss_of_two_means_over_different_counts_steps_as_transformers_weighs_its_batches(tmp_path):
    """The step's batches are weighed as transformers weighs them, whatever the graph's loss adds:
    the compile refused the question-answering head, whose two means one weight per batch cannot
    put back together (and the advice, microbatches=1, trains on another loss)."""
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    _, eager_steps, _ = _train(transformers.Trainer, _answerer(), tmp_path / "eager", train_data=_Answers(32),
                               arguments=arguments)
    _, steps, _ = _train(HarmonyTrainer, _answerer(), tmp_path / "harmony", train_data=_Answers(32),
                         arguments=arguments, harmony_options={"memory_budget": "600KiB"})
    _assert_same_steps(steps, eager_steps)


class _UnlabelledAfterTheFirst(torch.utils.data.Dataset):
    """Batches after the first have no labelled token: their loss is 0/0, NaN."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = [torch.randint(2, VOCAB, (SEQ,), generator=generator) for _ in range(12)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        labels = self.ids[index].clone() if index < 4 else torch.full((SEQ,), IGNORE_INDEX)
        return {"input_ids": self.ids[index], "labels": labels}


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_skip_nonfinite_skips_the_steps_it_says_and_the_run_goes_on(tmp_path, max_grad_norm):
    """transformers reads the clipped norm after every step (max_grad_norm=1.0 by default): a step
    harmony skipped has none, and the run died on torch.tensor(None). Without clipping it takes the
    norm of the parameters' gradients, which a skipped step leaves None: it logged 0.0, as a step."""
    arguments = _arguments(tmp_path, gradient_accumulation_steps=1, max_steps=3, eval_strategy="no",
                           save_strategy="no", train_sampling_strategy="sequential", max_grad_norm=max_grad_norm)
    trainer = HarmonyTrainer(model=build_hf_model("llama"), args=arguments, train_dataset=_UnlabelledAfterTheFirst(),
                             harmony_options={"memory_budget": "1MiB", "skip_nonfinite": True})
    trainer.train()
    assert trainer.harmony.skipped_steps == [1, 2]
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert norms[0] > 0 and all(math.isnan(norm) for norm in norms[1:])


def test_a_nonfinite_loss_is_named_by_transformers_step_and_the_option_this_door_takes(tmp_path):
    """The second step's batch has no labelled token (its loss is nan): the error named harmony's own
    count from 0 ("step 1", where transformers logs step 2; anew at every train(), so a resumed run
    named neither) and said "pass skip_nonfinite=True", which HarmonyTrainer takes in harmony_options."""
    arguments = _arguments(tmp_path, gradient_accumulation_steps=1, max_steps=3, eval_strategy="no",
                           save_strategy="no", train_sampling_strategy="sequential")
    trainer = HarmonyTrainer(model=build_hf_model("llama"), args=arguments, train_dataset=_UnlabelledAfterTheFirst(),
                             harmony_options={"memory_budget": "1MiB"})
    with pytest.raises(harmony_fx.NonFiniteLossError, match=r"the loss of step 2 \(transformers' count, as logged\) "
                       r"is nan;.*harmony_options=\{'skip_nonfinite': True\}"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_training_again_on_the_same_trainer_moves_the_parameters_as_transformers_does(tmp_path):
    """A second train() (more epochs, a second phase): transformers hands back accelerate's wrapper
    around harmony's stand-in optimizer, which was taken for the real one: every step of the second
    run logged a loss and moved no parameter."""
    def twice(trainer_class, folder, **kwargs):
        model = build_hf_model("llama")
        trainer = trainer_class(model=model, args=_arguments(folder, eval_strategy="no", save_strategy="no",
                                                             max_steps=3),
                                train_dataset=_Tokens(64, seed=0), **kwargs)
        trainer.train()
        before = [p.detach().clone() for p in model.parameters()]
        trainer.train()
        moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), before))
        steps = [(entry["loss"], entry["learning_rate"], entry["grad_norm"])
                 for entry in trainer.state.log_history if "loss" in entry]
        return moved, dict(enumerate(steps))

    eager_moved, eager_steps = twice(transformers.Trainer, tmp_path / "eager")
    moved, steps = twice(HarmonyTrainer, tmp_path / "harmony", harmony_options={"memory_budget": "1MiB"})
    assert moved > 0 and eager_moved > 0
    _assert_same_steps(steps, eager_steps)


class _ZeroTheFirstLayersGradients(transformers.TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        for param in model.parameters():
            param.grad = None
            break


def test_a_callback_changing_gradients_before_the_step_is_refused_with_the_hook_to_use(tmp_path):
    """Harmony updates each pack during the backward, before transformers calls it: the change it made
    was silently not honored (a block meant to stay fixed moved)."""
    trainer = HarmonyTrainer(model=build_hf_model("llama"), args=_arguments(tmp_path, eval_strategy="no",
                                                                           save_strategy="no", max_steps=1),
                             train_dataset=_Tokens(16, seed=0), harmony_options={"memory_budget": "1MiB"})
    trainer.add_callback(_ZeroTheFirstLayersGradients())
    with pytest.raises(ValueError, match=r"_ZeroTheFirstLayersGradients\.on_pre_optimizer_step.*register_hook"):
        trainer.train()


def test_under_torchrun_each_step_equals_transformers_trainer_with_ddp(tmp_path):
    """Two processes (torchrun, gloo): ``HarmonyTrainer`` sums each pack's gradients over them where
    ``transformers.Trainer`` has DDP average them; each step's loss and gradient norm, each
    evaluation and the final parameters are eager's on every process, for a loss over every process's
    labelled tokens, one over each process's own (``average_tokens_across_devices=False``) and a
    classifier's batch mean whose head each process initialised with its own seed, and an epoch's last
    step holding fewer batches than gradient_accumulation_steps (it was world_size times eager's); a
    run resumed from the checkpoint rank 0 saved continues as the unbroken one."""
    from tests.distributed.launch import torchrun

    ranks = torchrun("tests.integrations.across_processes", tmp_path)
    for results in ranks:
        for case in ("llama", "classifier", "per-process tokens", "last step of one batch"):
            eager, harmony = results[f"{case} eager"], results[f"{case} harmony"]
            assert harmony["packs"] > 1
            assert eager["wrapped in"] == "DistributedDataParallel" and harmony["wrapped in"] != eager["wrapped in"]
            assert harmony["steps"].keys() == eager["steps"].keys() and len(eager["steps"]) == 4
            for step, ((loss, norm), (eager_loss, eager_norm)) in zip(eager["steps"], zip(harmony["steps"].values(),
                                                                                          eager["steps"].values())):
                assert loss == pytest.approx(eager_loss, rel=RTOL), f"{case}, step {step}"
                assert norm == pytest.approx(eager_norm, rel=1e-4), f"{case}, step {step}"
            assert harmony["evaluations"] == pytest.approx(eager["evaluations"], rel=RTOL)
            assert harmony["parameters"] == pytest.approx(eager["parameters"], rel=1e-4, abs=1e-4), case
        assert len(results["llama eager"]["evaluations"]) == 2
        assert max(norm for _, norm in results["llama eager"]["steps"].values()) > 1.0  # max_grad_norm clipped
        resumed, unbroken = results["llama resumed"], results["llama harmony"]
        if resumed is None:  # transformers 5.17 loads to cpu:N, where torch 2.11 cannot (its own resume fails)
            assert tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)
            continue
        assert resumed["steps"].keys() == unbroken["steps"].keys()
        assert sum(resumed["steps"].values(), []) == pytest.approx(sum(unbroken["steps"].values(), []), rel=1e-6)
        assert resumed["parameters"] == pytest.approx(unbroken["parameters"], rel=1e-6)
    assert ranks[0]["llama harmony"]["parameters"] == ranks[1]["llama harmony"]["parameters"]  # one model


class _WithReference(transformers.Trainer):
    """A Trainer subclass of the kind TRL's are: an argument of its own before ``args`` (DPOTrainer's
    ``ref_model``) and a ``compute_loss`` of its own (the model's loss plus a term from the reference)."""

    def __init__(self, model, ref_model=None, args=None, **kwargs):
        self.ref_model = ref_model
        super().__init__(model=model, args=args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss + 0.1 * outputs.logits.logsumexp(-1).square().mean()
        return (loss, outputs) if return_outputs else loss


def test_a_trainer_subclass_after_harmony_trainer_gets_its_arguments_and_its_compute_loss_is_trained_on(tmp_path):
    """``class HarmonyX(HarmonyTrainer, X)`` (as docs/integrations.md says, and as TRL's trainers are
    combined): X's own arguments were refused (bound to transformers.Trainer's signature: a TypeError
    naming ``ref_model``), and X's compute_loss was skipped for the model's own loss, silently (it
    followed HarmonyTrainer's own in the MRO)."""
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}
    reference = build_hf_model("llama", seed=1)
    _, eager_steps, _ = _train(_WithReference, build_hf_model("llama"), tmp_path / "eager", arguments=arguments,
                               ref_model=reference)
    combined = type("HarmonyWithReference", (HarmonyTrainer, _WithReference), {})
    trainer, steps, _ = _train(combined, build_hf_model("llama"), tmp_path / "harmony", arguments=arguments,
                               ref_model=reference, harmony_options={"memory_budget": "1MiB"})
    assert trainer.ref_model is reference
    _assert_same_steps(steps, eager_steps)


class _CallsSuper:
    """An override that computes transformers' own loss (``loss *= num_processes`` in place, at its end)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_an_epochs_last_short_step_through_a_compute_loss_override_steps_as_transformers(tmp_path):
    """11 samples in batches of 4, 2 a step: each epoch's last step is one batch of 3, which harmony cuts
    into microbatches and weighs by how the loss reduces. transformers' compute_loss ends in an in-place
    ``loss *= 1``, which the analysis did not read: the microbatches were averaged, and that step's loss
    and gradients were a third of transformers', silently (the warning saying so was filtered)."""
    arguments = {"eval_strategy": "no", "save_strategy": "no", "max_steps": -1, "num_train_epochs": 2}
    data = functools.partial(_Tokens, 11, seed=0)
    _, eager_steps, _ = _train(type("Eager", (_CallsSuper, transformers.Trainer), {}), build_hf_model("llama"),
                               tmp_path / "eager", train_data=data(), arguments=arguments)
    _, steps, _ = _train(type("Harmony", (_CallsSuper, HarmonyTrainer), {}), build_hf_model("llama"),
                         tmp_path / "harmony", train_data=data(), arguments=arguments,
                         harmony_options={"memory_budget": "1MiB"})
    assert len(steps) == 4
    _assert_same_steps(steps, eager_steps)


class _Metered:
    """An override that records metrics as TRL's trainers do: ``.item()`` of tensors, into a dict of
    lists that ``log`` averages, and a running count; while harmony captures it they are symbols."""

    def __init__(self, *args, **kwargs):
        self.metrics = {}
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        self.metrics.setdefault("logit_mean", []).append(outputs.logits.mean().item())
        self.tokens = getattr(self, "tokens", 0) + inputs["attention_mask"].sum().item()
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, start_time=None):
        logs.update({key: sum(values) / len(values) for key, values in self.metrics.items()})
        self.metrics = {}
        super().log(logs, start_time)


def test_what_a_captured_compute_loss_records_besides_the_loss_is_dropped_not_left_as_symbols(tmp_path):
    """The capture's ``.item()`` values (SymFloat, SymInt) stayed in the trainer's attributes: the log
    showed them (``FloatTrueDiv(zuf0, 1.0)``) and writing trainer_state.json at a checkpoint raised
    inside torch ("Cannot access data pointer of Tensor")."""
    arguments = {"eval_strategy": "no", "save_strategy": "steps", "save_steps": 2, "max_steps": 3}
    trainer_class = type("Harmony", (_Metered, HarmonyTrainer), {})
    trainer, steps, _ = _train(trainer_class, build_hf_model("llama"), tmp_path / "harmony", arguments=arguments,
                               harmony_options={"memory_budget": "1MiB"})
    _, eager_steps, _ = _train(type("Eager", (_Metered, transformers.Trainer), {}),
                               build_hf_model("llama"), tmp_path / "eager", arguments=arguments)
    _assert_same_steps(steps, eager_steps)
    assert (tmp_path / "harmony" / "checkpoint-2" / "trainer_state.json").exists()
    numbers = [value for entry in trainer.state.log_history for value in entry.values()]
    assert all(isinstance(value, (int, float, str)) for value in numbers)
    assert isinstance(getattr(trainer, "tokens", 0), int)


class _BranchesOnAValue:
    """An override that branches on a tensor's value to log it, as TRL's SFTTrainer and DPOTrainer do."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.last = loss.item() if loss > 0 else 0.0
        return loss


def test_a_compute_loss_that_cannot_be_captured_is_refused_with_what_to_do(tmp_path):
    from harmony_fx.frontend.capture import CaptureError

    with pytest.raises(CaptureError, match=r"HarmonyTrainer captures _BranchesOnAValue.compute_loss with the model.*"
                                           r"give your class a compute_loss that computes the loss alone"):
        _train(type("Harmony", (_BranchesOnAValue, HarmonyTrainer), {}), build_hf_model("llama"), tmp_path,
               arguments={"eval_strategy": "no", "save_strategy": "no", "max_steps": 1},
               harmony_options={"memory_budget": "1MiB"})


def _trl_words(size: int, seed: int):
    """A tokenizer over a few words and a dataset of short texts of them, for TRL's trainers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = "the cat sat on a mat and dog ran to park while birds sang of joy in warm sun".split()
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.train_from_iterator([" ".join(words)],
                                  trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")
    generator = torch.Generator().manual_seed(seed)
    rows = [" ".join(words[i] for i in torch.randint(len(words), (int(n),), generator=generator))
            for n in torch.randint(4, 12, (size,), generator=generator)]
    return fast, rows


def test_trl_trainers_combined_with_harmony_trainer_train_on_their_own_loss_or_are_refused_saying_how(tmp_path):
    """TRL's RewardTrainer (its Bradley-Terry loss over chosen and rejected) steps as without harmony;
    SFTTrainer's compute_loss (metrics it branches on) is refused with a compute_loss to use instead,
    which then steps as SFTTrainer."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from harmony_fx.frontend.capture import CaptureError

    tokenizer, texts = _trl_words(24, seed=0)
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=3e-3,
                  logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, use_cpu=True,
                  gradient_checkpointing=False, bf16=False, max_length=16)

    def model(classifier=False):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=64, use_cache=False,
                                          pad_token_id=tokenizer.pad_token_id, num_labels=1)
        return (transformers.LlamaForSequenceClassification if classifier else transformers.LlamaForCausalLM)(config)

    def losses(trainer_class, data, config, classifier=False, **kwargs):
        trainer = trainer_class(model=model(classifier), args=config, train_dataset=data, processing_class=tokenizer,
                                **kwargs)
        trainer.train()
        return {e["step"]: (e["loss"], e["learning_rate"], e["grad_norm"])
                for e in trainer.state.log_history if "loss" in e}

    options = {"harmony_options": {"memory_budget": "1MiB"}}
    pairs = datasets.Dataset.from_list([{"chosen": a, "rejected": b} for a, b in zip(texts[::2], texts[1::2])])
    config = trl.RewardConfig(**common)
    _assert_same_steps(losses(type("H", (HarmonyTrainer, trl.RewardTrainer), {}), pairs, config, True, **options),
                       losses(trl.RewardTrainer, pairs, config, True))

    text = datasets.Dataset.from_list([{"text": t} for t in texts])
    config = trl.SFTConfig(**common)
    with pytest.raises(CaptureError, match="HarmonyTrainer captures SFTTrainer.compute_loss"):
        losses(type("H", (HarmonyTrainer, trl.SFTTrainer), {}), text, config, **options)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return transformers.Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    advised = type("H", (HarmonyTrainer, trl.SFTTrainer), {"compute_loss": compute_loss})
    _assert_same_steps(losses(advised, text, config, **options), losses(trl.SFTTrainer, text, config))


@pytest.mark.parametrize("mask, side, fix", [
    (True, "left", r"So pad on the right \(tokenizer\.padding_side = 'right'"),
    (False, "right", r"So pass the attention mask"),
])
def test_batches_of_one_step_padded_apart_are_refused_saying_which_fix_applies(mask, side, fix):
    """The advice listed every fix (pad_to_multiple_of among them, which a script passing 8 already
    did) whichever was missing."""
    from harmony_fx.integrations.huggingface import _one_batch

    batches = [{"input_ids": torch.ones(2, length, dtype=torch.long)} for length in (16, 24)]
    for batch in batches if mask else ():
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with pytest.raises(ValueError, match=rf"padded to different lengths \(\[16, 24\]\).*{fix}"):
        _one_batch(batches, pad_token_id=0, padding_side=side)


def test_a_budget_refusal_says_how_to_get_smaller_microbatches_through_transformers(tmp_path):
    """Each of transformers' batches is one microbatch: the refusal spoke of "more microbatches" without
    saying how to get them here (sweep ww)."""
    import harmony_fx

    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        _train(HarmonyTrainer, build_hf_model("llama"), tmp_path, harmony_options={"memory_budget": 1},
               arguments={"eval_strategy": "no", "save_strategy": "no", "max_steps": 1})
    assert any("lower per_device_train_batch_size and raise gradient_accumulation_steps" in note
               for note in refused.value.__notes__)
