"""Helpers shared by the tests: one training step with harmony_fx next to one in eager mode.

``train_step(entry, budget_fraction)`` builds two identical copies of a zoo model, measures what an
eager training step needs (``eager_training_bytes``), compiles one copy under
``int(need * budget_fraction)`` and runs one step of each with the same seed (dropout).
``assert_step_equal`` then checks loss, every parameter gradient and every buffer against eager;
``train_step_equal`` does both. Results and the eager byte counts are cached per process, so a
model is compiled once per (model, fraction, devices) however many tests look at it.

``four_pack_trainer`` builds the Trainer the NVMe tier's tests share (a small MLP in four fixed
packs), ``tier_files_check`` reads the tier's files back on their own.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import pathlib
import re
import time
import types
import zlib
from typing import Any, Callable, Sequence

import torch
from torch import nn

import harmony_fx
from harmony_fx import calibrate
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.calibrate import Calibration
from harmony_fx.runtime import tier as tier_module
from harmony_fx.runtime.streams import HostStreams
from harmony_fx.testing.models import ZooEntry, zoo
from tests.memory_witness import DeviceMemoryWitness

RTOL, ATOL = 1e-5, 1e-7
SEED = 5

__all__ = [
    "RTOL", "ATOL", "SEED", "StepResult", "ZOO", "eager_bytes", "train_step", "cached_train_step",
    "assert_step_equal", "train_step_equal", "assert_grads_equal", "assert_buffers_equal", "device_names",
    "smallest_budget", "Prepared", "prepared", "LSTMStack", "FOUR_PACKS", "four_pack_model", "regression_batches",
    "four_pack_trainer", "optimizer_states", "tier_files_check", "saved_checkpoint",
]

ZOO: dict[str, ZooEntry] = zoo()


@dataclasses.dataclass
class StepResult:
    entry: ZooEntry
    budget_fraction: float
    budget: int
    need: int
    hm: harmony_fx.HarmonyModule
    model: nn.Module          # the compiled copy (host master weights, .grad after the step)
    reference: nn.Module      # the eager copy
    inputs: tuple
    target: torch.Tensor
    loss: torch.Tensor
    reference_loss: torch.Tensor
    # the device's peak during the step, counted by DeviceMemoryWitness (not the runtime's tracker)
    witnessed_peak: int


@functools.lru_cache(maxsize=None)
def eager_bytes(name: str) -> int:
    """Peak bytes of one eager training step of the zoo model ``name`` (cached)."""
    entry = ZOO[name]
    model, inputs, target = entry.build(0)
    return eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target))


def device_names(devices: object) -> tuple[str, ...]:
    if devices is None:
        return ()
    if isinstance(devices, (str, int)):
        return (str(devices),)
    return tuple(str(d) for d in devices)


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def train_step(entry: ZooEntry, budget_fraction: float, devices: Sequence[str] | None = None,
               **compile_options: Any) -> StepResult:
    """One training step with harmony_fx and one in eager mode on an identical copy."""
    model, inputs, target = entry.build(0)
    reference, ref_inputs, ref_target = entry.build(0)
    if ZOO.get(entry.name) is entry:  # the shared zoo: its eager measurement is cached
        need = eager_bytes(entry.name)
    else:
        need = eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target))
    budget = int(need * budget_fraction)
    # packs as graphs unless a test asks for inductor: compiled packs, the GPU default for users, would
    # spend minutes of a GPU check compiling (the DeviceMemoryWitness also needs the graphs' tensors)
    compile_options.setdefault("compile_packs", False)
    hm = harmony_fx.compile(model, inputs, memory_budget=budget, devices=devices, **compile_options)

    # The eager reference runs where harmony_fx computes, so dropout draws from the same generator.
    cuda = [name for name in device_names(devices) if name.startswith("cuda")]
    if cuda:
        device = torch.device(cuda[0])
        reference.to(device)
        ref_inputs = tuple(_to(x, device) for x in ref_inputs)
        ref_target = ref_target.to(device)

    torch.manual_seed(SEED)
    with DeviceMemoryWitness() as witness:
        loss = entry.loss_fn(hm(*inputs), target)
        loss.backward()
    torch.manual_seed(SEED)
    reference_loss = entry.loss_fn(reference(*ref_inputs), ref_target)
    reference_loss.backward()
    return StepResult(entry, budget_fraction, budget, need, hm, model, reference, inputs, target,
                      loss.detach(), reference_loss.detach().cpu(), witness.peak_of(hm.devices[0]))


@functools.lru_cache(maxsize=None)
def cached_train_step(name: str, budget_fraction: float, devices: tuple[str, ...] | None = None) -> StepResult:
    """``train_step`` of the zoo model ``name``, once per process for each argument tuple."""
    return train_step(ZOO[name], budget_fraction, list(devices) if devices else None)


def assert_same_result(loss: torch.Tensor, ref_loss: torch.Tensor, params, ref_params, rtol: float = RTOL,
                       atol: float = ATOL) -> None:
    """A step's loss and the parameters after it equal the reference's (eager's)."""
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol)
    for param, ref in zip(params, ref_params):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=rtol, atol=atol)


def assert_grads_equal(model: nn.Module, reference: nn.Module, rtol: float = RTOL, atol: float = ATOL, *,
                       inputs: Sequence[torch.Tensor] = (), ref_inputs: Sequence[torch.Tensor] = ()) -> None:
    """Every parameter of ``model`` has the gradient ``reference``'s namesake has, and so does each
    of ``inputs`` (tensors the step was called with) its counterpart in ``ref_inputs``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    assert params.keys() == ref_params.keys()
    assert len(inputs) == len(ref_inputs)
    named = [(f"grad of {name}", params[name], ref) for name, ref in ref_params.items()]
    named += [(f"grad of input {index}", x, ref) for index, (x, ref) in enumerate(zip(inputs, ref_inputs))]
    for what, value, ref in named:
        if ref.grad is None:
            assert value.grad is None, f"{what}: harmony_fx produced one where eager has none"
            continue
        assert value.grad is not None, f"{what}: none (eager has one)"
        torch.testing.assert_close(value.grad, ref.grad.cpu(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_buffers_equal(model: nn.Module, reference: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every buffer equals eager's: BatchNorm statistics were updated exactly once."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    ref_buffers = dict(reference.named_buffers(remove_duplicate=False))
    assert buffers.keys() == ref_buffers.keys()
    for name, buffer in buffers.items():
        torch.testing.assert_close(buffer, ref_buffers[name].cpu(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"buffer {name}: {m}")


def assert_backward_equal(hm: nn.Module, model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward of ``hm`` (compiled from ``model``) and of ``reference`` (eager) on
    ``x``, the loss the output's mean square: the losses, every gradient and every buffer equal."""
    for p in (*model.parameters(), *reference.parameters()):
        p.grad = None
    loss, expected = hm(x).square().mean(), reference(x).square().mean()
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert_grads_equal(model, reference)
    assert_buffers_equal(model, reference)


def assert_step_equal(result: StepResult) -> None:
    torch.testing.assert_close(result.loss, result.reference_loss, rtol=RTOL, atol=ATOL)
    assert_grads_equal(result.model, result.reference)
    assert_buffers_equal(result.model, result.reference)


def train_step_equal(entry: ZooEntry, budget_fraction: float, devices: Sequence[str] | None = None) -> StepResult:
    """Compile ``entry``'s model under ``budget_fraction`` of eager's memory, run one training step
    next to eager, and assert loss, every gradient and every buffer are equal."""
    result = train_step(entry, budget_fraction, devices)
    assert_step_equal(result)
    return result


_SMALLEST = re.compile(r"smallest budget that fits is ([0-9,]+) bytes")


def smallest_budget(model: nn.Module, inputs: tuple, **compile_options: Any) -> int:
    """The smallest memory budget harmony_fx can compile ``model`` under: the
    ``BudgetTooSmallError`` a one-byte budget raises says it (in its message and ``smallest_budget``)."""
    try:
        harmony_fx.compile(model, inputs, memory_budget=1, **compile_options)
    except harmony_fx.BudgetTooSmallError as error:
        match = _SMALLEST.search(str(error))
        assert match and int(match.group(1).replace(",", "")) == error.smallest_budget, \
            f"BudgetTooSmallError's message and smallest_budget disagree: {error}"
        return error.smallest_budget
    raise AssertionError("a one-byte budget was accepted")


@dataclasses.dataclass
class Prepared:
    """A zoo model captured, sized and cut into layers (what the planning passes start from)."""

    model: nn.Module
    inputs: tuple
    target: torch.Tensor
    captured: Any
    layers: list
    masters: dict


@functools.lru_cache(maxsize=None)
def prepared(name: str) -> Prepared:
    from harmony_fx.analysis.sizes import annotate_sizes
    from harmony_fx.frontend.capture import capture
    from harmony_fx.passes.find_layers import find_layers

    model, inputs, target = ZOO[name].build(0)
    captured = capture(model, inputs)
    annotate_sizes(captured.gm)
    layers = find_layers(captured.gm)
    return Prepared(model, inputs, target, captured, layers, {**captured.params, **captured.buffers})


class LSTMStack(nn.Module):
    """``depth`` LSTMs, each starting from the state the one before ended in: each one's
    ``(output, (h, c))`` crosses into the next pack whole. Returns the last ``(output, (h, c))``,
    or with ``head`` the output through a ``Linear(width, head)``."""

    def __init__(self, width: int = 8, depth: int = 3, head: int | None = None) -> None:
        super().__init__()
        self.lstms = nn.ModuleList(nn.LSTM(width, width, batch_first=True) for _ in range(depth))
        self.head = None if head is None else nn.Linear(width, head)

    def forward(self, x):
        state = None
        for lstm in self.lstms:
            x, state = lstm(x, state)
        return (x, state) if self.head is None else self.head(x)


# ---------------------------------------------------------------------- a Trainer over four fixed packs

FOUR_PACKS = (0, 1, 2, 3)  # pack_boundaries of four_pack_model: one block a pack, the head with the last


def four_pack_model() -> nn.Module:
    """Four ``Linear(32, 32) + ReLU`` blocks and a ``Linear(32, 4)`` head, the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)], nn.Linear(32, 4))


def regression_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 16 ``(x, target)`` for ``four_pack_model``, the same every call."""
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)) for _ in range(n)]


def four_pack_trainer(optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                      **options: Any) -> harmony_fx.Trainer:
    """A Trainer of ``four_pack_model`` in the packs ``FOUR_PACKS``, MSE loss, two microbatches;
    ``optimizer`` builds the optimizer from the parameters (AdamW, lr 1e-2, when ``None``);
    ``options`` go to the Trainer (``nvme_path``, ``precision``, ``devices``, ...)."""
    model = four_pack_model()
    make = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2))
    return harmony_fx.Trainer(model, nn.functional.mse_loss, make(model.parameters()), regression_batches(1)[0],
                              microbatches=2, pack_boundaries=FOUR_PACKS, **options)


def optimizer_states(trainer: harmony_fx.Trainer) -> list[dict]:
    """Every parameter's whole optimizer state, wherever it is kept (host memory or the NVMe tier)."""
    return [trainer.optimizer_state(p) for p in trainer.model.parameters()]


def tier_files_check(path: pathlib.Path) -> dict:
    """The NVMe tier's manifest at ``path``, after checking every file it names against its size and
    each tensor against its CRC-32 (here, not with the tier's own reader), and that no other state
    file is there."""
    manifest = json.loads((path / tier_module.MANIFEST).read_text())
    named = set()
    for entry in manifest["packs"].values():
        data = (path / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"]
        for *_, offset, nbytes, crc in entry["tensors"]:
            assert zlib.crc32(data[offset:offset + nbytes]) == crc
        named.add(entry["file"])
    assert {f for f in os.listdir(path) if f.endswith(".state")} == named
    return manifest


def saved_checkpoint(trainer: harmony_fx.Trainer, tmp_path: pathlib.Path, folder: bool) -> pathlib.Path:
    """``trainer.save`` to one file, or to a folder of step folders (``torch.distributed.checkpoint``)."""
    path = tmp_path / ("checkpoints" if folder else "checkpoint.pt")
    if folder:
        path.mkdir()
    trainer.save(path)
    return path


class TickingStreams(HostStreams):
    """Inline streams whose clock ticks one second per mark: a span made from these marks lasts
    exactly one second, whatever the host's time says."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def mark(self, stream=None) -> int:
        return next(self._ticks)

    @staticmethod
    def seconds(origin: int, mark: int) -> float:
        return float(mark - origin)


# ---------------------------------------------------------------------- a calibrated machine, faked
# a quiet 2-core machine, as measured: fp32 87 GFLOP/s (a Linear's forward and backward 52), copies
# 19 GB/s, 0.17 ms a task, 20 us a copy, a backward's ops 1.5 times its forward's
QUIET = {"fp32": 8.7e10, "bf16": 2.0e10, "copy": 1.9e10, "linear": 5.2e10, "task": 1.7e-4, "op": 2e-6,
         "track_op": 2.5e-5, "record_task": 1e-5, "copy_action": 2e-5, "backward_ops": 1.5, "recompute_ops": 1.2,
         "update": 2e-9, "update_tensor": 4e-5, "update_call": 3e-5}
# the same machine measured while busy (the cache that was once found): every figure 40x off
POISONED = {**QUIET, "fp32": 2.1e9, "bf16": 5e8, "copy": 6.3e8, "task": 3.2e-3, "op": 8e-5}


def calibration(figures: dict, spread: float = 1.1, load: float = 0.2, measured_at: float | None = None) -> Calibration:
    return Calibration(dict(figures), {name: spread for name in figures}, {name: load for name in figures},
                       time.time() if measured_at is None else measured_at)


def fake_machine(tmp_path, monkeypatch):
    """A cache folder of the test's own, the measurements replaced (``machine.measured``: the
    calibrations ``measure_host`` returns, in turn; ``machine.probe``: what the quick re-measure
    finds), and nothing of this process's figures kept before or after the test."""
    monkeypatch.setenv("HARMONY_FX_CACHE", str(tmp_path))
    state = types.SimpleNamespace(measured=[calibration(QUIET)], calls=0, probe={"fp32": QUIET["fp32"],
                                                                                  "copy": QUIET["copy"]})

    def measure_host() -> Calibration:
        state.calls += 1
        return state.measured[min(state.calls, len(state.measured)) - 1]

    monkeypatch.setattr(calibrate, "measure_host", measure_host)
    monkeypatch.setattr(calibrate, "quick_probe", lambda: dict(state.probe))
    monkeypatch.setattr(calibrate, "_rechecked", [])
    state.path = tmp_path / "host_spec.json"
    state.store = lambda c: state.path.write_text(json.dumps({calibrate.cache_key(): c.to_json()}))
    state.stored = lambda: Calibration.from_json(json.loads(state.path.read_text())[calibrate.cache_key()])
    calibrate._forget()
    yield state
    calibrate._forget()


def after_each_pack_update(monkeypatch, probe) -> None:
    """``probe(params)`` after each pack's update over ``params`` (``step_subset``, on the update
    worker): the optimizer's own step hooks run once a step, not once a pack."""
    from harmony_fx.training import updates

    original = updates.step_subset

    def stepped(optimizer, params):
        original(optimizer, params)
        probe(params)

    monkeypatch.setattr(updates, "step_subset", stepped)
