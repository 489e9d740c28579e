"""Running a compiled model: a session's iterations, their statistics, the first error of any device,
and the log of what happened after compiling, kept apart from the frozen ``Compiled``."""
from __future__ import annotations

import pytest
import torch

import harmony_fx
from harmony_fx.program.actions import Key, KeyKind
from harmony_fx.runtime.executor import Runtime
from harmony_fx.testing.models import MLPChain


def _compiled(devices=("host:0",), **options) -> tuple[harmony_fx.HarmonyModule, torch.Tensor]:
    torch.manual_seed(0)
    model, x = MLPChain(width=16, depth=4), torch.randn(8, 16)
    hm = harmony_fx.compile(model, x, devices=list(devices), microbatches=2, pack_boundaries=(0, 2),
                            memory_budget=10**6, track_memory=True, **options)
    return hm, x


class _Compiles:
    """What the session reads of a ``PackCompiler``: compiles counted so far and their time."""

    def __init__(self) -> None:
        self.graphs, self.compile_seconds, self.structures, self.iterations = 0, 0.0, 1, 0

    def end_iteration(self) -> None:
        self.iterations += 1


def test_inductor_compiles_go_to_the_sessions_log_not_into_the_compiled():
    hm, _ = _compiled()
    session, compiled_stages = hm.session, list(hm.compiled.passes)
    compiles = session.pack_compiler = _Compiles()
    compiles.graphs, compiles.compile_seconds = 2, 0.5
    session.finish_stats(iteration_ended=True)
    session.finish_stats(iteration_ended=True)  # nothing compiled since: nothing logged
    compiles.graphs, compiles.compile_seconds = 3, 0.75
    session.finish_stats()
    assert compiles.iterations == 2
    assert [(s.name, s.seconds) for s in session.log] == [("compile packs (inductor)", 0.5),
                                                         ("compile packs (inductor)", 0.25)]
    assert [s.decision.split(";")[0] for s in session.log] == ["2 graph(s) on the first calls",
                                                              "1 graph(s) on the first calls"]
    assert list(hm.compiled.passes) == compiled_stages  # the frozen artifact is left as compiling made it
    assert list(hm.passes) == compiled_stages + list(session.log)  # what users see: both, in order
    printed = str(hm.passes)
    assert printed.count("compile packs (inductor)") == 2 and printed.splitlines()[-1].startswith("total")


def test_a_new_call_state_is_logged_by_the_module_compiled_for_it():
    hm, x = _compiled()
    hm(x[:4])  # another batch size: compiled for it on this call
    (module,) = [m for _, m in hm.variants if m is not hm]
    assert "guards" not in module.compiled.passes.names()
    assert [s.name for s in module.passes][-1] == "guards"
    assert "a new call state" in list(module.passes)[-1].decision
    assert "guards" not in hm.passes.names()


def test_an_iteration_puts_each_microbatchs_inputs_on_the_host_and_shares_them_between_devices():
    hm, x = _compiled(devices=("host:0", "host:1"), parallel="pp")
    per_mb = hm.split_inputs((x,), {})
    iteration = hm.session.begin(per_mb)
    try:
        first, second = iteration.runtimes
        assert (first.index, second.index) == (0, 1)
        assert second.host_values is first.host_values and second.links is first.links
        assert second.host_grads is first.host_grads is iteration.host_grads
        (name,) = hm.captured.inputs
        for mb, flat in enumerate(per_mb):
            assert torch.equal(iteration.host_values[Key(KeyKind.ACT, name, mb)], flat[0])
        assert hm.session.stats.budget == {"host:0": 10**6, "host:1": 10**6}
    finally:
        iteration.release()


class Injected(RuntimeError):
    pass


def test_the_first_error_of_any_device_is_raised_and_every_device_is_emptied(monkeypatch):
    """Device 1 fails in its backward; device 0, waiting for its gradients, stops too ("another
    device stopped the iteration"), but the error raised is device 1's own."""
    hm, x = _compiled(devices=("host:0", "host:1"), parallel="pp")
    hm(x).sum().backward()
    backward = Runtime.bwd

    def failing(self, pack_index, mb):
        if self.index == 1:
            raise Injected(f"p{pack_index}@{mb} failed on device 1")
        return backward(self, pack_index, mb)

    monkeypatch.setattr(Runtime, "bwd", failing)
    with pytest.raises(Injected, match="failed on device 1"):
        hm(x).sum().backward()
    assert [device.live_bytes() for device in hm.devices] == [0, 0]
    monkeypatch.undo()
    hm(x).sum().backward()  # the session runs on
    assert all(hm.stats.peak_bytes[device.name] > 0 for device in hm.devices)


def test_running_out_of_memory_beside_calls_waiting_for_their_backward_says_so():
    """Two calls before one backward hold two last packs, which the plan (one call at a time) does
    not count: at the smallest budget the second's backward runs out, and the error said only to
    raise the budget."""
    torch.manual_seed(0)
    model, x = MLPChain(width=16, depth=4), torch.randn(6, 16)
    try:
        harmony_fx.compile(model, x, devices=["host:0"], memory_budget=1, microbatches=1, track_memory=True)
    except harmony_fx.BudgetTooSmallError as error:
        smallest = error.smallest_budget
    hm = harmony_fx.compile(model, x, devices=["host:0"], memory_budget=smallest, microbatches=1, track_memory=True)
    hm(x).square().sum().backward()  # one call at a time fits
    first, second = hm(x), hm(torch.randn(6, 16))
    with pytest.raises(harmony_fx.DeviceOutOfMemoryError) as raised:
        (first - second).square().sum().backward()
    assert "1 other call(s) of this module wait for their backward" in "\n".join(getattr(raised.value, "__notes__", []))
