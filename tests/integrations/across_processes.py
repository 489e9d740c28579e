"""What each process of ``test_huggingface``'s torchrun test runs: ``transformers.Trainer`` (DDP, as
accelerate prepares it) and ``HarmonyTrainer`` (harmony sums each pack's gradients over the processes)
on the same data and seeds, each process on its share; writes its logs to ``<out>/rank<r>.json``.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.integrations.across_processes OUT
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import transformers

from harmony_fx.integrations.huggingface import HarmonyTrainer
from harmony_fx.testing.hf_models import build_hf_model
from tests.integrations.test_huggingface import _Labelled, _Tokens, _arguments, _classifier

STEPS = 4


def _run(trainer_class, model, output_dir, train_data, resume=None, budget="1MiB", **overrides) -> dict:
    harmony = {"harmony_options": {"memory_budget": budget}} if trainer_class is HarmonyTrainer else {}
    trainer = trainer_class(model=model, args=_arguments(output_dir, max_steps=STEPS, eval_steps=2, save_steps=2,
                                                         **overrides),
                            train_dataset=train_data, eval_dataset=_Tokens(8, seed=1), **harmony)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    return {"steps": {entry["step"]: (entry["loss"], entry["grad_norm"]) for entry in history if "loss" in entry},
            "evaluations": [entry["eval_loss"] for entry in history if "eval_loss" in entry],
            "parameters": [float(p.detach().double().sum()) for p in model.parameters()],
            "packs": len(trainer.harmony.plan.packs) if trainer_class is HarmonyTrainer else None,
            "wrapped in": type(trainer.model_wrapped).__name__}


def main(out: pathlib.Path) -> None:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    rank = int(os.environ["RANK"])
    results = {}
    for name, trainer_class in (("eager", transformers.Trainer), ("harmony", HarmonyTrainer)):
        # a causal LM whose loss divides by the labelled tokens of every process's batches (transformers'
        # average_tokens_across_devices), clipped, evaluated and saved at step 2
        results[f"llama {name}"] = _run(trainer_class, build_hf_model("llama"), out / name, _Tokens(64, seed=0))
        # a classifier whose loss is its batch's own mean, each process's model initialised with its
        # own seed (DDP and harmony start every process from rank 0's)
        torch.manual_seed(rank)
        results[f"classifier {name}"] = _run(trainer_class, _classifier().apply(_reinitialised), out / f"c{name}",
                                             _Labelled(32), budget="320KiB", save_strategy="no", eval_strategy="no")
        results[f"per-process tokens {name}"] = _run(trainer_class, build_hf_model("llama"), out / f"t{name}",
                                                     _Tokens(64, seed=0), save_strategy="no", eval_strategy="no",
                                                     average_tokens_across_devices=False)
        # 28 samples a process in batches of 4: the epoch's 4th step holds one batch of gradient_accumulation_steps=2
        # (the loss over num_items_in_batch, each process's sum, which DDP averages: it was world_size times eager's)
        results[f"last step of one batch {name}"] = _run(trainer_class, build_hf_model("llama"), out / f"l{name}",
                                                         _Tokens(56, seed=0), save_strategy="no", eval_strategy="no")
    try:
        results["llama resumed"] = _run(HarmonyTrainer, build_hf_model("llama", seed=7), out / "resumed",
                                        _Tokens(64, seed=0), resume=str(out / "harmony" / "checkpoint-2"))
    except RuntimeError as error:
        # transformers 5.17 loads the optimizer state to args.device, cpu:N on CPUs, which torch 2.11
        # cannot restore to: transformers.Trainer's own resume fails alike there
        if "don't know how to restore data location" not in str(error):
            raise
        results["llama resumed"] = None
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def _reinitialised(module: torch.nn.Module) -> None:
    if isinstance(module, torch.nn.Linear):
        module.reset_parameters()


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
