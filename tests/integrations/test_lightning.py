"""``HarmonyStrategy`` against Lightning's own ``L.Trainer()``: the same seeds, data and module, each
step's loss equal within 1e-5 relative (AdamW, a per-step LR scheduler, gradient clipping that bites),
under a budget that cuts the model into packs; a checkpoint resumed in a new trainer continues as the
unbroken run; validation logs what eager logs, forward-only; what the strategy cannot do is refused."""
from __future__ import annotations

import ast
import importlib
import pathlib
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")

from harmony_fx.analysis.memory import eager_training_bytes  # noqa: E402
from harmony_fx.integrations.lightning import HarmonyStrategy  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
RTOL = 1e-5
CLIP = 0.5
BATCH = 16


class Regressor(L.LightningModule):
    """A small MLP on a regression task, logging its loss in training and validation."""

    def __init__(self) -> None:
        super().__init__()
        hidden = [layer for _ in range(5) for layer in (nn.Linear(64, 64), nn.Tanh())]
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), *hidden, nn.Linear(64, 1))
        self.losses: list[float] = []      # each training step's loss, as Lightning's loop saw it
        self.grad_norms: list[float] = []  # filled by _GradNorms in the eager run

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        self.log("constant", 3.0)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        error = self(x) - y
        self.log("val_loss", error.pow(2).mean())
        self.log_dict({"val_abs": error.abs().mean(), "val_max": error.abs().max()})

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return {"prediction": self(batch[0])}

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _GradNorms(L.Callback):
    """The eager run's gradient norm before clipping, to show the clipping bit."""

    def on_before_optimizer_step(self, trainer, module, optimizer):
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()]))
        module.grad_norms.append(float(norm))


class _Peaks(L.Callback):
    """Each harmony step's measured device peak and its pack count (from the strategy's trainer)."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.packs: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        harmony = trainer.strategy.harmony_trainer
        self.peaks.append(max(harmony.stats.peak_bytes.values()))
        self.packs.append(len(harmony.hm.packs))


class _Compiled(L.Callback):
    """Which steps the strategy compiled, and whether their programs are forward-only."""

    def __init__(self) -> None:
        self.methods: set[str] = set()
        self.forward_only: set[bool] = set()

    def _seen(self, trainer) -> None:
        for step_module, module in trainer.strategy._forward_only.values():
            self.methods.add(step_module.method)
            self.forward_only.add(module.compiled.signature.forward_only)

    def on_validation_batch_end(self, trainer, *args):
        self._seen(trainer)

    def on_test_batch_end(self, trainer, *args):
        self._seen(trainer)

    def on_predict_batch_end(self, trainer, *args):
        self._seen(trainer)


def _data(samples: int = 64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=generator)
    y = (x[:, :4].sum(1, keepdim=True) - x[:, 4:].prod(1, keepdim=True)) * 3
    return (DataLoader(TensorDataset(x, y), batch_size=BATCH),
            DataLoader(TensorDataset(x[:32], y[:32]), batch_size=BATCH))


def _fit(strategy, epochs: int, callbacks=(), ckpt_path=None, module_class=None, **trainer_options):
    torch.manual_seed(0)
    module = (module_class or Regressor)()
    train, val = _data()
    trainer = L.Trainer(max_epochs=epochs, strategy=strategy, gradient_clip_val=CLIP, logger=False,
                        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
                        callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, **trainer_options)
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return module, trainer


def _budget() -> int:
    """Half of what one eager step of the module needs on a device: harmony has to cut it into packs."""
    torch.manual_seed(0)
    x, y = next(iter(_data()[0]))
    return eager_training_bytes(Regressor().net, (x,), lambda out: nn.functional.mse_loss(out, y)) // 2


def test_losses_equal_lightnings_own_with_a_scheduler_and_clipping_under_a_budget():
    eager, eager_trainer = _fit("auto", 2, callbacks=[_GradNorms()])
    budget, peaks = _budget(), _Peaks()
    strategy = HarmonyStrategy(memory_budget=budget, microbatches=2)
    harmony, harmony_trainer = _fit(strategy, 2, callbacks=[peaks])

    assert len(harmony.losses) == len(eager.losses) == 8
    torch.testing.assert_close(torch.tensor(harmony.losses), torch.tensor(eager.losses), rtol=RTOL, atol=0)
    assert max(eager.grad_norms) > CLIP, "the clipping never bit; the clipped path went untested"
    for (name, param), ref in zip(harmony.named_parameters(), eager.parameters()):
        # microbatches sum the gradients in another order; Adam divides by their root mean square
        torch.testing.assert_close(param, ref, rtol=RTOL, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # the scheduler stepped the optimizer harmony updates with: 8 steps at step_size 3 halve the LR twice
    assert harmony_trainer.optimizers[0].param_groups[0]["lr"] == eager_trainer.optimizers[0].param_groups[0]["lr"]
    assert harmony_trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(3e-2 / 4)
    # every step ran under the budget, the model cut into packs
    assert min(peaks.packs) >= 2 and 0 < max(peaks.peaks) <= budget
    # the logged metrics: the loss replayed from harmony's step, the constant as it was, validation's values
    for name in ("train_loss", "constant", "val_loss", "val_abs", "val_max"):
        torch.testing.assert_close(harmony_trainer.callback_metrics[name], eager_trainer.callback_metrics[name],
                                   rtol=RTOL, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert strategy.harmony_trainer is None  # closed at the end of fit


class _Curriculum(Regressor):
    """A loss whose weight grows with the epoch, read from Lightning's trainer in the step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y) * (1 + self.current_epoch)


def test_a_step_reading_the_epoch_computes_with_each_epochs_value():
    """``self.current_epoch`` is read through the module from Lightning's trainer: the captured step
    held epoch 0's weight for every epoch after, silently. Each epoch's value is keyed (the step is
    compiled again once per epoch), so the losses are Lightning's own."""
    eager, _ = _fit("auto", 3, module_class=_Curriculum)
    harmony, _ = _fit(HarmonyStrategy(memory_budget=_budget()), 3, module_class=_Curriculum)
    assert len(harmony.losses) == len(eager.losses) == 12
    torch.testing.assert_close(torch.tensor(harmony.losses), torch.tensor(eager.losses), rtol=RTOL, atol=0)


def test_a_resumed_run_continues_as_the_unbroken_one(tmp_path):
    unbroken, _ = _fit(HarmonyStrategy(), 4)
    first, _ = _fit(HarmonyStrategy(), 2, callbacks=[L.pytorch.callbacks.ModelCheckpoint(tmp_path, save_last=True)])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["harmony_fx"]["step_count"] == 8 and saved["global_step"] == 8
    resumed, _ = _fit(HarmonyStrategy(), 4, ckpt_path=tmp_path / "last.ckpt")
    assert first.losses + resumed.losses == unbroken.losses  # bitwise: same values, same order of operations
    for param, ref in zip(resumed.parameters(), unbroken.parameters()):
        assert torch.equal(param, ref)
    # a checkpoint Lightning wrote without harmony resumes under it too
    _fit("auto", 2, callbacks=[L.pytorch.callbacks.ModelCheckpoint(tmp_path / "eager", save_last=True)])
    from_eager, _ = _fit(HarmonyStrategy(), 4, ckpt_path=tmp_path / "eager" / "last.ckpt")
    torch.testing.assert_close(torch.tensor(from_eager.losses), torch.tensor(unbroken.losses[8:]), rtol=RTOL, atol=0)


class _DropoutRegressor(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.net.insert(2, nn.Dropout(0.2))


def test_a_resumed_run_with_dropout_draws_as_the_unbroken_one(tmp_path):
    """The checkpoint's RNG states went back at the first batch, after the resumed epoch's
    DataLoader had drawn its seed from them: dropout resumed on other numbers."""
    unbroken, _ = _fit(HarmonyStrategy(), 4, module_class=_DropoutRegressor)
    first, _ = _fit(HarmonyStrategy(), 2, module_class=_DropoutRegressor,
                    callbacks=[L.pytorch.callbacks.ModelCheckpoint(tmp_path, save_last=True)])
    resumed, _ = _fit(HarmonyStrategy(), 4, module_class=_DropoutRegressor, ckpt_path=tmp_path / "last.ckpt")
    assert first.losses + resumed.losses == unbroken.losses


def test_validation_test_and_predict_run_forward_only_through_harmony():
    torch.manual_seed(0)
    module = Regressor()
    reference = Regressor()
    reference.load_state_dict(module.state_dict())
    _, val = _data()
    compiled = _Compiled()
    trainer = L.Trainer(strategy=HarmonyStrategy(), logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[compiled])
    (validated,) = trainer.validate(module, val, verbose=False)
    (tested,) = trainer.test(module, val, verbose=False)
    predicted = trainer.predict(module, val)
    eager = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    (ref_validated,) = eager.validate(reference, val, verbose=False)
    (ref_tested,) = eager.test(reference, val, verbose=False)

    assert validated.keys() == ref_validated.keys() == {"val_loss", "val_abs", "val_max"}
    for name, value in {**validated, **tested}.items():
        assert value == pytest.approx({**ref_validated, **ref_tested}[name], rel=RTOL)
    assert compiled.methods == {"validation_step", "test_step", "predict_step"}
    with torch.no_grad():
        expected = [reference(x) for x, _ in val]
    assert len(predicted) == len(expected) == 2
    for output, ref in zip(predicted, expected):
        torch.testing.assert_close(output["prediction"], ref, rtol=RTOL, atol=1e-7)
    assert compiled.forward_only == {True}
    assert all(param.grad is None for param in module.parameters())


def test_validation_runs_beside_a_training_step_on_an_nvme_tier(tmp_path):
    """``nvme_path`` (and ``host_memory``) are the Trainer's, for the optimizer's state: the
    forward-only compile of ``validation_step`` does not take them (it refused them)."""
    _, trainer = _fit(HarmonyStrategy(nvme_path=str(tmp_path / "tier")), 1)
    assert {"train_loss", "val_loss"} <= trainer.logged_metrics.keys()
    assert any((tmp_path / "tier").iterdir())  # the optimizer's state went to the tier


def test_a_tensor_logged_besides_the_loss_is_warned_about():
    class LogsAnother(Regressor):
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            self.log("mean_output", out.mean())
            return nn.functional.mse_loss(out, y)

    torch.manual_seed(0)
    train, _ = _data(16)
    trainer = L.Trainer(max_epochs=1, strategy=HarmonyStrategy(), logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="logs 'mean_output', tensors that are not the loss"):
        trainer.fit(LogsAnother(), train)
    assert "mean_output" not in trainer.callback_metrics


class _Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class _Hooked(Regressor):
    def on_after_backward(self):
        pass


@pytest.mark.parametrize("module_class,trainer_options,expected", [
    (_Manual, {}, "manual optimization"),
    (Regressor, {"accumulate_grad_batches": 2}, r"accumulate_grad_batches=2: .* HarmonyStrategy\(microbatches=2\)"),
    # the same accumulation from a callback, set during fit (every batch became an update)
    (Regressor, {"callbacks": "GradientAccumulationScheduler"}, r"GradientAccumulationScheduler .* let harmony split it"),
    (Regressor, {"gradient_clip_val": CLIP, "gradient_clip_algorithm": "value"},
     "gradient_clip_algorithm='value': harmony clips by the global"),
    (Regressor, {"precision": "16-mixed"}, r"precision='16-mixed': float16 autocast needs a gradient scaler"),
    (Regressor, {"precision": "bf16-true"}, r"precision='bf16-true': it converts the module's weights"),
    (Regressor, {"precision": "64-true"}, r"precision='64-true': HarmonyStrategy honors precision='32-true' and"),
    (_Hooked, {}, "_Hooked.on_after_backward is overridden but is never called"),
])
def test_what_a_harmony_step_cannot_do_is_refused_before_training(module_class, trainer_options, expected):
    if trainer_options.get("callbacks") == "GradientAccumulationScheduler":
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        trainer_options = {"callbacks": [GradientAccumulationScheduler(scheduling={0: 1, 1: 2})]}
    _assert_refused(module_class(), HarmonyStrategy(), trainer_options, expected)


def test_bf16_mixed_with_harmonys_own_bf16_is_refused():
    _assert_refused(Regressor(), HarmonyStrategy(precision="bf16"), {"precision": "bf16-mixed"},
                    r"precision='bf16-mixed' \(bfloat16 autocast.* are two kinds of mixed precision; pass one of them")


def _assert_refused(module, strategy, trainer_options, expected):
    """``fit`` raises ``expected`` and leaves the module's weights as they were (dtype included)."""
    train, _ = _data(16)
    trainer = L.Trainer(max_epochs=1, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, **trainer_options)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=expected):
        trainer.fit(module, train)
    assert all(p.dtype == b.dtype and torch.equal(p, b) for p, b in zip(module.parameters(), before))


@pytest.mark.parametrize("options,expected", [
    ({"max_grad_norm": 1.0}, r"does not take max_grad_norm: set L.Trainer\(gradient_clip_val=...\)"),
    ({"process_group": None}, "does not take process_group: several processes are Lightning.s to launch"),
    ({"memory_budgt": 10}, "unknown option 'memory_budgt' \\(did you mean 'memory_budget'\\?\\)"),
])
def test_options_lightning_sets_or_that_do_not_exist_are_refused(options, expected):
    with pytest.raises(TypeError, match=expected):
        HarmonyStrategy(**options)


def test_environment_variables_set_the_options_the_code_does_not(monkeypatch):
    monkeypatch.setenv("HARMONY_FX_MEMORY_BUDGET", "3MiB")
    monkeypatch.setenv("HARMONY_FX_MICROBATCHES", "4")
    strategy = HarmonyStrategy(microbatches=2)
    assert strategy.compile_options == {"memory_budget": "3MiB", "microbatches": 2}
    monkeypatch.setenv("HARMONY_FX_MICROBATHCES", "4")
    with pytest.raises(ValueError, match="HARMONY_FX_MICROBATHCES is not one of harmony_fx's"):
        HarmonyStrategy()


def test_only_the_lightning_door_imports_lightning():
    """harmony_fx imports without the extra: no other module of it imports Lightning (read from the
    sources: a fresh interpreter costs seconds), and this one says how to install it."""
    importers = []
    for path in sorted((ROOT / "harmony_fx").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] in ("lightning", "pytorch_lightning") for name in names):
                importers.append(path.relative_to(ROOT).as_posix())
    assert sorted(set(importers)) == ["harmony_fx/integrations/lightning.py"]


def test_without_lightning_the_door_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # import lightning raises ImportError
    monkeypatch.delitem(sys.modules, "harmony_fx.integrations.lightning")
    with pytest.raises(ImportError, match=r"needs Lightning: pip install 'harmony-fx\[lightning\]'"):
        importlib.import_module("harmony_fx.integrations.lightning")


def test_bf16_mixed_is_autocast_as_in_lightnings_own():
    """``L.Trainer(precision="bf16-mixed")``: every step harmony runs is under bfloat16 autocast as
    Lightning's own (fp32 weights), through packs under half of eager's fp32 budget; the losses and
    validation metrics are eager's bf16-mixed ones, and not fp32's. One microbatch, so harmony runs
    the same bf16 kernels on the same rows in the same order as eager (bitwise equal on this
    machine); RTOL leaves room for another kernel choice while staying far below what autocast
    changes (from the second step on, more than 1e-3 relative from fp32's losses)."""
    eager, eager_trainer = _fit("auto", 2, precision="bf16-mixed")
    peaks = _Peaks()
    harmony, harmony_trainer = _fit(HarmonyStrategy(memory_budget=_budget()), 2, callbacks=[peaks],
                                    precision="bf16-mixed")
    fp32, _ = _fit("auto", 2)

    assert len(harmony.losses) == len(eager.losses) == 8
    torch.testing.assert_close(torch.tensor(harmony.losses), torch.tensor(eager.losses), rtol=RTOL, atol=0)
    assert max(abs(a - b) / b for a, b in zip(eager.losses[1:], fp32.losses[1:])) > 1e-3  # autocast bit
    for name in ("val_loss", "val_abs", "val_max"):  # validation_step under autocast too
        torch.testing.assert_close(harmony_trainer.callback_metrics[name], eager_trainer.callback_metrics[name],
                                   rtol=RTOL, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert min(peaks.packs) >= 2
    assert {p.dtype for p in harmony.parameters()} == {torch.float32}


def test_under_torchrun_training_equals_lightnings_ddp(tmp_path):
    """Two processes (torchrun, gloo; Lightning reads them from the environment): HarmonyStrategy sums
    each pack's gradients over them where Lightning's DDP strategy averages them; the final weights
    are DDP's on both processes, and each step's loss is the mean of DDP's processes' own (the step's
    loss is over every process's share). Lightning launching the processes itself
    (``L.Trainer(devices=2)`` from a script) runs the same code in each."""
    from tests.distributed.launch import torchrun

    ranks = torchrun("tests.integrations.lightning_across_processes", tmp_path)
    for results in ranks:
        assert results["packs"] >= 2 and len(results["harmony losses"]) == 4
        assert results["harmony losses"] == pytest.approx(results["ddp mean losses"], rel=RTOL)
        assert results["harmony parameters"] == pytest.approx(results["ddp parameters"], rel=1e-4, abs=1e-5)
        assert results["wrapped in"] == "Regressor"
    assert ranks[0]["harmony parameters"] == ranks[1]["harmony parameters"]
