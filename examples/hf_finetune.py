"""Fine-tune a Hugging Face model under a memory budget: one change, ``HarmonyTrainer`` for ``Trainer``.

    pip install 'harmony-fx[hf]'
    python examples/hf_finetune.py
    torchrun --nproc_per_node=2 examples/hf_finetune.py     # each process on its share of the data

A small Llama from its config (random weights: nothing is downloaded) learns to continue counting
sequences (each token the last plus a stride of its own). It is fine-tuned twice with the same
``TrainingArguments`` (AdamW, linear warmup and decay, ``max_grad_norm``, gradient accumulation,
evaluation): by ``transformers.Trainer`` (eager PyTorch, the whole model on the device) and by
``HarmonyTrainer`` under half the device memory one eager step needs, the model cut into packs that
stream through the device while it stays in host memory. Then the same with ``peft`` LoRA adapters
on the attention projections. The script prints each run's final losses side by side (equal to
about six digits) and exits 1 if they differ. Under torchrun, ``transformers.Trainer`` runs with DDP
and ``HarmonyTrainer`` sums each pack's gradients over the processes, each on its own GPU (or the
host); rank 0 prints. On a machine with GPUs, pass ``--devices cuda:0`` in one process (and a real
budget, ``--budget 8GiB``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import transformers

from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.integrations.huggingface import HarmonyTrainer

VOCAB, SEQ = 256, 32


class Counting(torch.utils.data.Dataset):
    """Sequences ``start, start + stride, start + 2 stride, ...`` (mod ``VOCAB``), labelled as a causal LM's."""

    def __init__(self, samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (samples, 1), generator=generator)
        stride = torch.randint(1, 8, (samples, 1), generator=generator)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def build_model(lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        import peft

        adapters = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, adapters)
    return model


def fine_tune(trainer_class, lora: bool, args, output_dir: str, **kwargs) -> tuple[float, float, transformers.Trainer]:
    """Train; return the last logged training loss, the final evaluation loss, and the trainer."""
    arguments = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, gradient_accumulation_steps=2,
        learning_rate=1e-2 if lora else 3e-3, lr_scheduler_type="linear", warmup_steps=args.steps // 5,
        max_grad_norm=1.0, optim="adamw_torch", logging_steps=1, eval_strategy="steps", eval_steps=args.steps,
        save_strategy="no", report_to=[], seed=0, disable_tqdm=True, use_cpu=args.devices is None,
        dataloader_pin_memory=False)
    trainer = trainer_class(model=build_model(lora), args=arguments, train_dataset=Counting(512, seed=0),
                            eval_dataset=Counting(32, seed=1), **kwargs)
    trainer.remove_callback(transformers.PrinterCallback)  # the table below says it shorter
    trainer.train()
    history = trainer.state.log_history
    return ([entry["loss"] for entry in history if "loss" in entry][-1],
            [entry["eval_loss"] for entry in history if "eval_loss" in entry][-1], trainer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", default="0.5", help="the device memory budget: a fraction of what one eager "
                                                        "step needs, or a size such as 8GiB")
    parser.add_argument("--devices", nargs="*", help="the devices harmony computes on (default: the host)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: more threads only add synchronisation
    transformers.logging.set_verbosity_error()

    samples = Counting(args.batch, seed=0)  # one batch, for the device memory one eager step needs
    batch = {name: torch.stack([samples[i][name] for i in range(args.batch)]) for name in samples[0]}
    need = eager_training_bytes(build_model(lora=False), (), lambda out: out.loss, batch)
    try:
        budget = int(need * float(args.budget))
    except ValueError:
        budget = args.budget
    options = {"memory_budget": budget, **({"devices": args.devices} if args.devices else {})}

    rows, failed = [], False
    with tempfile.TemporaryDirectory() as folder:
        for lora in (False, True):
            name = "LoRA (peft)" if lora else "full fine-tune"
            eager_loss, eager_eval, _ = fine_tune(transformers.Trainer, lora, args, folder)
            loss, eval_loss, trainer = fine_tune(HarmonyTrainer, lora, args, folder, harmony_options=options)
            plan = trainer.harmony.plan
            moved = trainer.harmony.stats.as_dict()["bytes_by_kind"]
            rows.append((name, eager_loss, loss, eager_eval, eval_loss, len(plan.packs),
                         max(plan.predicted_peak.values()), moved.get("d2h/wgrad", 0)))
            failed |= abs(loss - eager_loss) > 1e-4 * abs(eager_loss) or abs(eval_loss - eager_eval) > 1e-4 * eager_eval

    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun every process has the same figures
        return 1 if failed else 0
    shown = f"{budget / 2**20:.2f} MiB" if isinstance(budget, int) else budget
    print(f"\none eager step needs {need / 2**20:.2f} MiB on the device; harmony's budget: {shown}")
    print(f"{'':16s}{'final loss':>22s}{'final eval loss':>26s}")
    print(f"{'':16s}{'Trainer':>11s}{'Harmony':>11s}{'Trainer':>13s}{'Harmony':>13s}   packs, peak, gradient bytes a step")
    for name, eager_loss, loss, eager_eval, eval_loss, packs, peak, grads in rows:
        print(f"{name:16s}{eager_loss:11.6f}{loss:11.6f}{eager_eval:13.6f}{eval_loss:13.6f}   "
              f"{packs}, {peak / 2**20:.2f} MiB, {grads / 2**20:.3f} MiB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
