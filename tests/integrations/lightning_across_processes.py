"""What each process of ``test_lightning``'s torchrun test runs: Lightning's DDP strategy and
``HarmonyStrategy`` on the same module, seeds and data, each process on its share (Lightning's
distributed sampler); writes what it saw to ``<out>/rank<r>.json``.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.integrations.lightning_across_processes OUT
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

import lightning as L
import torch
import torch.distributed as dist

from harmony_fx.integrations.lightning import HarmonyStrategy
from tests.integrations.test_lightning import CLIP, Regressor, _budget, _data


class _Packs(L.Callback):
    def __init__(self) -> None:
        self.packs: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.packs.append(len(trainer.strategy.harmony_trainer.hm.packs))


def _fit(strategy, callbacks=()) -> tuple[Regressor, L.Trainer]:
    torch.manual_seed(0)
    module = Regressor()
    train, _ = _data()
    accelerator = {"accelerator": "cpu"} if strategy == "ddp" else {}  # HarmonyStrategy's is the CPU
    trainer = L.Trainer(max_epochs=2, strategy=strategy, **accelerator, devices=2, gradient_clip_val=CLIP,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks))
    trainer.fit(module, train)
    return module, trainer


def main(out: pathlib.Path) -> None:
    torch.set_num_threads(1)
    ddp, _ = _fit("ddp")
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, ddp.losses)
    packs = _Packs()
    harmony, trainer = _fit(HarmonyStrategy(memory_budget=_budget(), microbatches=2), [packs])
    results = {"ddp mean losses": [sum(step) / len(step) for step in zip(*losses)],
               "harmony losses": harmony.losses,
               "ddp parameters": [float(p.double().sum()) for p in ddp.parameters()],
               "harmony parameters": [float(p.double().sum()) for p in harmony.parameters()],
               "packs": min(packs.packs), "wrapped in": type(trainer.strategy.model).__name__}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
