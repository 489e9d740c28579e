"""Bad input is refused with an error that says what to do (or handled, where eager semantics allow),
and a failure in the middle of a step leaves nothing behind: master weights, buffers and optimizer
state exactly as before it, device memory given back, no thread left running, and the next step
the same as a fresh trainer's.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import re
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(1)  # tiny ops on a 2-core machine: threads only add synchronisation

import harmony_fx  # noqa: E402
import harmony_fx.compiler.variants  # noqa: E402
from harmony_fx.models import MLPChain  # noqa: E402
from harmony_fx.program.ops import OP_OF_KIND  # noqa: E402
from harmony_fx.runtime.executor import Runtime  # noqa: E402
from tests.helpers import assert_grads_equal, assert_same_result, smallest_budget  # noqa: E402
from tests.memory_witness import DeviceMemoryWitness  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
BOUNDARIES = (0, 2, 4)  # MLPChain(depth=6): blocks 0-1 | blocks 2-3 | blocks 4-5 + head


def _mlp(seed: int = 0, width: int = 16, depth: int = 6) -> MLPChain:
    torch.manual_seed(seed)
    return MLPChain(width=width, depth=depth)


def _batch(size: int = 8, width: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, width, generator=generator), torch.randint(0, 10, (size,), generator=generator)


# ---------------------------------------------------------------------- models that cannot run as asked


class WritesItsInput(nn.Module):
    def __init__(self, clone_first: bool) -> None:
        super().__init__()
        self.clone_first = clone_first
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        if self.clone_first:
            x = x.clone()
        x.add_(1)
        return self.second(torch.relu(self.first(x)))


def test_in_place_write_into_an_input_is_refused():
    """Refused, not handled: the packs run on device copies of the inputs, so the write could not
    reach the caller's tensor (and a recompute would apply it twice)."""
    x = torch.randn(4, 8)
    with pytest.raises(ValueError) as info:
        harmony_fx.compile(WritesItsInput(clone_first=False), (x,))
    message = str(info.value)
    assert "'x' in place at 'x.add_(1)'" in message and "x = x + 1" in message  # the model's line
    # the model's own copy is its to write: that works and matches eager
    torch.manual_seed(0)
    model = WritesItsInput(clone_first=True)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (x,))
    hm(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert_grads_equal(model, reference)


def test_unknown_device_string_is_refused():
    for devices in ("tpu:0", ["tpu:0"], ["host:0", "tpu:1"]):
        with pytest.raises(ValueError, match=r"unknown device 'tpu:\d'.*'cuda:N'.*'host:N'"):
            harmony_fx.compile(_mlp(), (torch.randn(4, 16),), devices=devices)


def test_a_model_whose_weights_are_not_in_host_memory_is_refused_saying_what_to_do():
    model = _mlp().to("meta")  # a GPU's tensors are refused alike (tests/test_cuda.py)
    with pytest.raises(ValueError, match=r"parameter 'blocks\.0\.0\.weight' is on the meta device.*on the CPU"):
        harmony_fx.compile(model, (torch.randn(4, 16),), devices=["host:0"])
    with pytest.raises(ValueError, match=r"parameter 'blocks\.0\.0\.weight' is on the meta device"):
        harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), _batch())


def test_a_lazy_module_not_run_yet_is_refused_and_left_as_it_was():
    """Capturing runs the forward on FakeTensors, which made a lazy module's parameters on the meta
    device, in the user's own module: it crashed, and the model no longer ran eagerly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(3))
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"module '0' \(LazyLinear\).*run the model once before compiling"):
        harmony_fx.compile(model, x, devices=["host:0"])
    assert isinstance(model[0].weight, nn.parameter.UninitializedParameter)
    with torch.no_grad():
        model(x)  # as the refusal says: the parameters made, on the CPU
    reference = copy.deepcopy(model)
    harmony_fx.compile(model, x, devices=["host:0"])(x).sum().backward()
    reference(x).sum().backward()
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad)


def test_optimizer_over_parameters_that_are_not_the_models_is_refused():
    model, other = _mlp(0), _mlp(1)
    with pytest.raises(ValueError, match=r"neither the model's nor its loss_fn's.*model\.parameters\(\)"):
        harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(other.parameters(), lr=0.1), _batch())


# ---------------------------------------------------------------------- budgets


def test_budget_below_the_minimum_names_the_minimum_which_then_works():
    model, (x, target) = _mlp(), _batch()
    reference = copy.deepcopy(model)
    # microbatches fixed: the budget alone decides the packs
    with pytest.raises(harmony_fx.BudgetTooSmallError, match=r"smallest budget that fits is [0-9,]+ bytes.*"
                                                             "Raise memory_budget to at least that"):
        harmony_fx.compile(model, (x,), memory_budget=1024, microbatches=1)
    minimum = smallest_budget(model, (x,), microbatches=1)  # read from that message
    hm = harmony_fx.compile(model, (x,), memory_budget=minimum, microbatches=1)
    assert len(hm.packs) > 1
    with DeviceMemoryWitness() as witness:
        F.cross_entropy(hm(x), target).backward()
    F.cross_entropy(reference(x), target).backward()
    assert_grads_equal(model, reference)
    assert witness.peak_of(hm.devices[0]) == hm.stats.peak_bytes[hm.devices[0].name] <= minimum


# ---------------------------------------------------------------------- batches unlike the example


def _count_captures(monkeypatch) -> list[int]:
    calls = []
    real = harmony_fx.compiler.variants.capture

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(harmony_fx.compiler.variants, "capture", counting)
    return calls


def test_another_batch_size_is_planned_once_and_kept(monkeypatch):
    model = _mlp()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, (_batch(8)[0],), microbatches=2, pack_boundaries=BOUNDARIES)
    captures = _count_captures(monkeypatch)
    x, target = _batch(6, seed=3)
    F.cross_entropy(hm(x), target).backward()
    assert len(captures) > 0  # planned for 6 on the first call
    F.cross_entropy(reference(x), target).backward()
    assert_grads_equal(model, reference)
    resized = hm.for_batch((x,), {})
    assert resized is not hm and resized.mb_sizes == [3, 3] and len(resized.packs) == len(hm.packs)
    assert hm.stats is resized.stats  # the last call's measurements, whichever size ran it

    captured = len(captures)
    hm(_batch(6, seed=4)[0])  # the same size again: no new capture, no new plan
    assert len(captures) == captured and hm.for_batch((x,), {}) is resized
    hm(_batch(8)[0])  # and the example's size still runs on the module compiled for it
    assert len(captures) == captured and hm.for_batch((_batch(8)[0],), {}) is hm
    hm.close()


def test_trainer_steps_on_batches_of_several_sizes_equal_eager():
    model = _mlp()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, _batch(8), microbatches=2,
                                 pack_boundaries=BOUNDARIES)
    try:
        for step, size in enumerate((8, 6, 5, 6, 8)):
            x, target = _batch(size, seed=10 + step)
            loss = trainer.step((x, target))
            ref_optimizer.zero_grad()
            ref_loss = F.cross_entropy(reference(x), target)
            ref_loss.backward()
            ref_optimizer.step()
            assert_same_result(loss, ref_loss, model.parameters(), reference.parameters(), RTOL, ATOL)
        assert trainer.hm.batch_sizes == [5, 6]
    finally:
        trainer.close()


def test_a_shape_the_model_cannot_take_fails_as_eager_does():
    # MLPChain works on the last dim (16): eager refuses 12 features, and so does the new capture;
    # other dims changing is served (tests/frontend/test_guards.py)
    hm = harmony_fx.compile(_mlp(), (torch.randn(8, 4, 16),), microbatches=2)
    with pytest.raises(ValueError, match="MLPChain raises on these inputs, as it would called eagerly"):
        hm(torch.randn(8, 4, 12))
    assert hm.batch_sizes == []


# ---------------------------------------------------------------------- outputs with structure


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class Structured(nn.Module):
    """Four layers; returns the logits and a hidden state as a tuple, a dict or a dataclass."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = self.head(x)
        if self.kind == "tuple":
            return logits, x
        if self.kind == "dict":
            return {"logits": logits, "hidden": x}
        return Output(logits, x)


def _parts(output, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "tuple":
        return output
    if kind == "dict":
        return output["logits"], output["hidden"]
    return output.logits, output.hidden


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_structured_outputs_keep_their_structure_and_gradients(kind):
    torch.manual_seed(0)
    model = Structured(kind)
    reference = copy.deepcopy(model)
    x, target = _batch(8)
    hm = harmony_fx.compile(model, (x,), microbatches=2, pack_boundaries=(0, 2))
    assert len(hm.packs) == 2
    out, expected = hm(x), reference(x)
    assert type(out) is type(expected)
    if kind == "dict":
        assert list(out) == list(expected)
    for got, want in zip(_parts(out, kind), _parts(expected, kind)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)

    def loss_fn(output):
        logits, hidden = _parts(output, kind)
        return F.cross_entropy(logits, target) + hidden.square().mean()

    loss_fn(out).backward()
    loss_fn(expected).backward()
    assert_grads_equal(model, reference)


# ---------------------------------------------------------------------- non-finite losses


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, dict]:
    params = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
             for i, p in enumerate(model.parameters()) if p in optimizer.state}
    return params, state


def _assert_state_equal(model: nn.Module, optimizer: torch.optim.Optimizer, saved: tuple[list, dict]) -> None:
    params, state = saved
    for index, (param, before) in enumerate(zip(model.parameters(), params)):
        assert torch.equal(param.detach(), before), f"parameter {index} changed"
    now = {i: optimizer.state[p] for i, p in enumerate(model.parameters()) if p in optimizer.state}
    assert now.keys() == state.keys(), "optimizer state gained or lost entries"
    for index, per_param in state.items():
        assert now[index].keys() == per_param.keys()
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(now[index][key], value), f"optimizer state[{index}][{key!r}] changed"
            else:
                assert now[index][key] == value


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
}


@contextlib.contextmanager
def _twin_trainers(optimizer_name: str, **options):
    """A trainer over three packs, and an identical twin that never fails (the reference); both
    closed on the way out."""
    pair = []
    try:
        for _ in range(2):
            model = _mlp()
            optimizer = OPTIMIZERS[optimizer_name](model.parameters())
            trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, _batch(), microbatches=2,
                                         pack_boundaries=BOUNDARIES, **options)
            pair.append((trainer, model, optimizer))
            assert len(trainer.hm.packs) == 3
        yield pair
    finally:
        for trainer, _, _ in pair:
            trainer.close()


def _assert_twins(model: nn.Module, optimizer, reference: nn.Module, ref_optimizer) -> None:
    """Bit for bit: the same code ran on the same numbers."""
    _assert_state_equal(model, optimizer, _state(reference, ref_optimizer))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_loss_is_reported_with_its_step_and_undone(bad):
    with _twin_trainers("adam") as ((trainer, model, optimizer), (reference, ref_model, ref_optimizer)):
        trainer.step(_batch(seed=1))
        reference.step(_batch(seed=1))
        x, target = _batch(seed=2)
        x[3, 5] = bad
        saved = _state(model, optimizer)
        with pytest.raises(harmony_fx.NonFiniteLossError) as info:  # public, as the docs name it
            trainer.step((x, target))
        assert isinstance(info.value, (FloatingPointError, ValueError))
        message = str(info.value)
        assert "step 1" in message and ("nan" in message or "inf" in message) and "skip_nonfinite=True" in message
        _assert_state_equal(model, optimizer, saved)
        assert trainer.step_count == 1
        # and training goes on as if the bad batch had never come
        trainer.step(_batch(seed=3))
        reference.step(_batch(seed=3))
        _assert_twins(model, optimizer, ref_model, ref_optimizer)


def test_skip_nonfinite_skips_the_step_and_training_goes_on():
    with _twin_trainers("sgd", skip_nonfinite=True) as ((trainer, model, optimizer), (reference, ref_model, ref_optimizer)):
        trainer.step(_batch(seed=1))
        reference.step(_batch(seed=1))
        x, target = _batch(seed=2)
        x[0, 0] = float("inf")
        saved = _state(model, optimizer)
        loss = trainer.step((x, target))
        assert not torch.isfinite(loss)
        assert trainer.skipped_steps == [1] and trainer.step_count == 2
        _assert_state_equal(model, optimizer, saved)
        for seed in (3, 4):
            trainer.step(_batch(seed=seed))
            reference.step(_batch(seed=seed))
        _assert_twins(model, optimizer, ref_model, ref_optimizer)
        assert trainer.skipped_steps == [1]


# ---------------------------------------------------------------------- faults in the middle of a step


class Injected(RuntimeError):
    pass


def _fail_on_call(monkeypatch, number: int, when: str, error: type[BaseException] = Injected) -> list[str]:
    """Every harmony op of the Runtime counts its calls; call ``number`` raises ``error`` before
    or after the op ran. Returns the log of ops called."""
    calls: list[str] = []
    counter = itertools.count()  # next() is atomic: the devices' controller threads share it

    for name in OP_OF_KIND.values():
        real = getattr(Runtime, name)

        def op(self, *args, _real=real, _name=name):
            index = next(counter)
            calls.append(_name)
            if index == number and when == "before":
                raise error(f"injected before op #{number} ({_name})")
            result = _real(self, *args)
            if index == number and when == "after":
                raise error(f"injected after op #{number} ({_name})")
            return result

        monkeypatch.setattr(Runtime, name, op)
    return calls


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_an_error_in_any_task_leaves_the_step_undone(optimizer_name, monkeypatch):
    with _twin_trainers(optimizer_name) as ((trainer, model, optimizer), (reference, ref_model, ref_optimizer)):
        device = trainer.hm.devices[0]
        trainer.step(_batch(seed=1))  # the optimizer has state to keep from here on
        reference.step(_batch(seed=1))
        num_ops = len(trainer.hm.forward_actions + trainer.hm.backward_actions)  # one op call per action
        assert num_ops > 40
        saved, live = _state(model, optimizer), device.live_bytes()
        for number in range(num_ops):
            for when in ("before", "after"):
                with monkeypatch.context() as patch:
                    calls = _fail_on_call(patch, number, when)
                    with pytest.raises(Injected, match=f"op #{number} "):
                        trainer.step(_batch(seed=2))
                assert len(calls) == number + 1
                _assert_state_equal(model, optimizer, saved)
                assert all(p.grad is None for p in model.parameters())  # an undone step's gradients are gone
                assert device.live_bytes() == live, f"device memory kept after a failure at op #{number} ({when})"
                assert trainer.step_count == 1
        # the next step is a fresh trainer's
        trainer.step(_batch(seed=2))
        reference.step(_batch(seed=2))
        _assert_twins(model, optimizer, ref_model, ref_optimizer)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_an_error_inside_an_update_undoes_every_update_of_the_step(optimizer_name, monkeypatch):
    """The host worker fails after it changed a group's parameters: that group and the ones updated
    before it are put back."""
    with _twin_trainers(optimizer_name) as ((trainer, model, optimizer), (reference, ref_model, ref_optimizer)):
        # the very first step: the optimizer had no state, and has none after
        saved = _state(model, optimizer)
        with monkeypatch.context() as patch:
            _fail_on_call(patch, len(trainer.hm.forward_actions + trainer.hm.backward_actions) - 1, "before")
            with pytest.raises(Injected):
                trainer.step(_batch(seed=1))
        assert not optimizer.state
        _assert_state_equal(model, optimizer, saved)
        trainer.step(_batch(seed=1))
        reference.step(_batch(seed=1))
        saved = _state(model, optimizer)
        num_groups = len(trainer.hm.update_groups())
        assert num_groups == 3
        for failing in range(num_groups):
            calls = []

            def step_then_fail(_real=optimizer.step, _failing=failing):
                _real()  # over the parameters of one update group: the trainer hides the others
                calls.append(1)
                if len(calls) - 1 == _failing:
                    raise Injected(f"update #{_failing}")

            with monkeypatch.context() as patch:
                patch.setattr(optimizer, "step", step_then_fail)
                # the real step once per update group, said so: a step set after the Trainer is refused
                patch.setattr(optimizer, "harmony_steps_per_parameter", True, raising=False)
                with pytest.raises(Injected, match=f"update #{failing}"):
                    trainer.step(_batch(seed=2))
            _assert_state_equal(model, optimizer, saved)
        trainer.step(_batch(seed=2))
        reference.step(_batch(seed=2))
        _assert_twins(model, optimizer, ref_model, ref_optimizer)


def test_without_atomic_steps_a_failure_keeps_the_updates_made_and_says_so(monkeypatch):
    """``atomic=False`` keeps no copies: what was updated before the failure (including the update
    that failed, and those already handed to the worker) stays updated, and the error says how many
    parameters; the count is checked against the parameters that changed."""
    with _twin_trainers("adam", atomic=False) as ((trainer, model, optimizer), _):
        trainer.step(_batch(seed=1))
        before = [p.detach().clone() for p in model.parameters()]
        calls = []

        def step_then_fail(_real=optimizer.step):
            _real()
            calls.append(1)
            if len(calls) == 1:
                raise Injected("the first update")

        with monkeypatch.context() as patch:
            patch.setattr(optimizer, "step", step_then_fail)
            # the real step once per update group, said so: a step set after the Trainer is refused
            patch.setattr(optimizer, "harmony_steps_per_parameter", True, raising=False)
            with pytest.raises(Injected) as info:
                trainer.step(_batch(seed=2))
        changed = sum(not torch.equal(p.detach(), old) for p, old in zip(model.parameters(), before))
        assert changed > 0
        assert f"{changed} parameter(s) updated before the failure" in "\n".join(info.value.__notes__)
        trainer.step(_batch(seed=3))  # and training goes on


def test_skip_nonfinite_needs_atomic_steps():
    model = _mlp()
    with pytest.raises(ValueError, match="atomic"):
        harmony_fx.Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), _batch(),
                           skip_nonfinite=True, atomic=False)


def test_out_of_memory_names_the_pack_the_planned_peak_and_the_budget():
    with _twin_trainers("adam") as ((trainer, model, optimizer), (reference, ref_model, ref_optimizer)):
        device = trainer.hm.devices[0]
        planned = trainer.plan.predicted_peak[device.name]
        trainer.step(_batch(seed=1))
        reference.step(_batch(seed=1))
        saved = _state(model, optimizer)
        budget, device.budget = device.budget, planned - 1  # lowered after compiling, just below the plan
        try:
            with pytest.raises(harmony_fx.DeviceOutOfMemoryError) as info:
                trainer.step(_batch(seed=2))
            message = str(info.value)
            del info
        finally:
            device.budget = budget
        assert re.search(r"out of memory (in the (forward|recompute|backward)|while copying the weights) of p\d",
                         message)
        assert f"static peak here is {planned:,} bytes" in message
        assert f"budget {planned - 1:,} bytes" in message and f"memory_budget={planned - 1}" in message
        _assert_state_equal(model, optimizer, saved)
        assert device.live_bytes() == 0
        trainer.step(_batch(seed=2))
        reference.step(_batch(seed=2))
        _assert_twins(model, optimizer, ref_model, ref_optimizer)
        assert trainer.stats.peak_bytes[device.name] == planned


def test_ctrl_c_in_a_task_leaves_the_step_undone_and_no_thread_running(monkeypatch):
    with _twin_trainers("sgd") as ((trainer, model, optimizer), (reference, ref_model, ref_optimizer)):
        trainer.step(_batch(seed=1))
        reference.step(_batch(seed=1))
        saved = _state(model, optimizer)
        threads = set(threading.enumerate())
        # the backward of the first pack: the updates of the packs after it have run by then
        actions = trainer.hm.forward_actions + trainer.hm.backward_actions
        ops = [OP_OF_KIND[a.kind] for a in actions]
        number = max(i for i, a in enumerate(actions) if a.kind.name == "BWD")
        assert ops[:number].count("update") == 2
        with monkeypatch.context() as patch:
            _fail_on_call(patch, number, "before", KeyboardInterrupt)
            with pytest.raises(KeyboardInterrupt):
                trainer.step(_batch(seed=2))
        assert set(threading.enumerate()) == threads
        _assert_state_equal(model, optimizer, saved)
        assert trainer.hm.devices[0].live_bytes() == 0
        trainer.step(_batch(seed=2))
        reference.step(_batch(seed=2))
        _assert_twins(model, optimizer, ref_model, ref_optimizer)
        assert set(threading.enumerate()) == threads


@pytest.mark.parametrize("parallel", ["dp", "pp"])
def test_an_error_on_one_of_several_devices_leaves_the_step_undone(parallel, monkeypatch):
    """Two devices with chaos streams (every stream on its own thread): the failing device stops the
    other; the error raised is the original one; both give their memory back; no thread is left."""
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = harmony_fx.Trainer(model, F.cross_entropy, optimizer, _batch(), microbatches=4,
                                 pack_boundaries=BOUNDARIES, devices=["host:0", "host:1"], parallel=parallel, chaos=3)
    try:
        trainer.step(_batch(seed=1))
        saved, threads = _state(model, optimizer), set(threading.enumerate())
        num_ops = sum(len(forward) + len(backward) for forward, backward in trainer.hm.device_actions)
        for number in range(0, num_ops, 11):  # a spread of them: chaos steps are slower
            with monkeypatch.context() as patch:
                _fail_on_call(patch, number, "before")
                with pytest.raises(Injected, match=f"op #{number} "):
                    trainer.step(_batch(seed=2))
            _assert_state_equal(model, optimizer, saved)
            assert [device.live_bytes() for device in trainer.hm.devices] == [0, 0]
            assert set(threading.enumerate()) == threads
        trainer.step(_batch(seed=2))
        assert trainer.step_count == 2
    finally:
        trainer.close()
