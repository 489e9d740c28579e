"""Train a LightningModule under a memory budget: one change, ``L.Trainer(strategy=HarmonyStrategy(...))``.

    pip install 'harmony-fx[lightning]'
    python examples/lightning_train.py

The same module, seeds and data are trained twice: with Lightning's own strategy (the whole model on
the device, eager PyTorch) and with ``HarmonyStrategy`` under half the memory one eager step needs,
the model cut into packs that stream through the device while the model stays in host memory. Both
runs use the module's own ``configure_optimizers`` (AdamW with a cosine schedule stepped every
batch), gradient clipping and validation; the script prints both runs' final losses, equal to six
digits. On a machine with GPUs, pass ``devices=["cuda:0"]`` (and a real budget, ``"8GiB"``).
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.integrations.lightning import HarmonyStrategy

FEATURES, CLASSES, WIDTH, DEPTH = 16, 4, 128, 4


class Classifier(L.LightningModule):
    """An MLP that learns which of ``CLASSES`` random directions a point lies closest to."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        layers = [nn.Linear(FEATURES, WIDTH), nn.GELU()]
        for _ in range(DEPTH - 1):
            layers += [nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))
        self.steps = steps

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, label = batch
        loss = nn.functional.cross_entropy(self(x), label)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, label = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, label))
        self.log("val_accuracy", (logits.argmax(-1) == label).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def data(samples: int, batch: int) -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(CLASSES, FEATURES, generator=generator)
    x = torch.randn(samples, FEATURES, generator=generator)
    label = (x @ directions.T).argmax(-1)
    split = samples * 3 // 4
    return (DataLoader(TensorDataset(x[:split], label[:split]), batch_size=batch, shuffle=True,
                       generator=torch.Generator().manual_seed(1)),
            DataLoader(TensorDataset(x[split:], label[split:]), batch_size=batch))


class Plan(L.Callback):
    """What harmony planned for the training steps: the device peak and how many packs the model is cut into."""

    peak, packs = 0, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        harmony = trainer.strategy.harmony_trainer
        self.peak = max(self.peak, *harmony.plan.predicted_peak.values())
        self.packs = len(harmony.hm.packs)


def train(strategy, args, callbacks=()) -> dict[str, float]:
    torch.manual_seed(0)
    train_loader, val_loader = data(args.samples, args.batch)
    module = Classifier(steps=args.epochs * len(train_loader))
    trainer = L.Trainer(strategy=strategy, max_epochs=args.epochs, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=list(callbacks))
    trainer.fit(module, train_loader, val_loader)
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.5, help="the memory budget, a fraction of eager's need")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: more threads only add synchronisation

    x, label = next(iter(data(args.samples, args.batch)[0]))
    need = eager_training_bytes(Classifier(1), (x,), lambda logits: nn.functional.cross_entropy(logits, label))
    budget = int(need * args.budget)

    eager = train("auto", args)
    plan = Plan()
    harmony = train(HarmonyStrategy(memory_budget=budget, microbatches=2), args, [plan])

    print(f"\none eager step needs {need / 2**10:.0f} KiB on the device; harmony's budget {budget / 2**10:.0f} KiB: "
          f"{plan.packs} packs, a peak of {plan.peak / 2**10:.0f} KiB")
    print(f"{'':22s}{'L.Trainer()':>14s}{'HarmonyStrategy':>18s}")
    for name in ("train_loss", "val_loss", "val_accuracy"):
        print(f"final {name:16s}{eager[name]:14.6f}{harmony[name]:18.6f}")
    difference = abs(harmony["train_loss"] - eager["train_loss"]) / abs(eager["train_loss"])
    print(f"relative difference of the final training loss: {difference:.1e}")
    return 0 if difference <= 1e-4 and 0 < plan.peak <= budget else 1


if __name__ == "__main__":
    sys.exit(main())
