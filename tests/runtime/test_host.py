"""The host's side: masters per pack, host gradients summed in a fixed order, events whose host
work runs once, and ``land`` as an update worker uses it."""
from __future__ import annotations

import concurrent.futures
import types

import pytest
import torch

import harmony_fx
from harmony_fx.runtime import host
from harmony_fx.runtime.host import DONE, Event, FutureEvent, HostGradients, HostState, grad_dtype, land
from harmony_fx.testing.models import zoo


def test_host_gradients_sum_in_device_order_whatever_order_they_land():
    grads = HostGradients()
    # float32: (1e8 + -1e8) + 1 == 1, but 1 + -1e8 == -1e8 and then + 1e8 == 0
    for device, value in ((2, 1.0), (1, -1e8), (0, 1e8)):
        grads.add_all([7], [torch.tensor([value])], device)
    assert grads.get(7).item() == 1.0
    assert grads.get(8) is None


def test_host_gradients_of_one_device_add_up_in_place_and_read_missing_keys_as_none():
    grads = HostGradients()
    first = torch.tensor([1.0, 2.0])
    grads.add_all([1, 2], [first, torch.tensor([5.0])], device=0)
    grads.add_all([1], [torch.tensor([10.0, 20.0])], device=0)
    assert grads.get(1) is first and first.tolist() == [11.0, 22.0]  # summed into the first copy, no new tensor
    assert grads.get_all([2, 3, 1]) == [grads.get(2), None, first]
    default = torch.zeros(1)
    assert grads.get(3, default) is default


def test_a_devices_sum_is_read_once_however_often_it_is_asked_for():
    grads = HostGradients()
    grads.add_all([7], [torch.tensor([1.0])], device=0)
    grads.add_all([7], [torch.tensor([2.0])], device=1)
    assert grads.get(7).item() == 3.0
    assert grads.get(7).item() == 3.0  # device 1's part was added once, not again at the second read


def test_host_state_lists_each_packs_parameters_then_buffers():
    entry = zoo()["small_cnn"]  # BatchNorm: packs with buffers
    model, inputs, _ = entry.build(0)
    hm = harmony_fx.compile(model, inputs, devices=["host:0"], microbatches=1, pack_boundaries=(0, 3))
    state = HostState.of(hm.packs, hm.compiled.masters)
    assert any(pack.buffers for pack in hm.packs)
    for pack, masters, keys in zip(hm.packs, state.masters, state.grad_keys, strict=True):
        assert [id(m) for m in masters] == [id(hm.compiled.masters[name]) for name in pack.params + pack.buffers]
        assert keys == [id(m) for m in masters]
    assert [[id(m) for m in masters] for masters in hm.host_state.masters] == [
        [id(m) for m in masters] for masters in state.masters]


def test_grad_dtype_is_the_masters_own_unless_set_apart():
    master = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    assert grad_dtype(master) == torch.bfloat16
    master.grad_dtype = torch.float32  # a parameter whose fp32 master is on the NVMe tier
    assert grad_dtype(master) == torch.float32


def test_an_events_host_work_runs_once_whoever_waits_first():
    ran: list[str] = []
    event = Event(DONE)
    event.on_host.extend([lambda: ran.append("a"), lambda: ran.append("b")])
    assert land([event]) == 0.0  # an update worker's wait: no tier read among the copies
    event.run_host_work()  # the program's own HOST wait comes second: nothing left to run
    assert ran == ["a", "b"]


def test_land_raises_the_tier_workers_error_before_any_host_work():
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(OSError("the tier's file is gone"))
    ran: list[int] = []
    copy = Event(DONE)
    copy.on_host.append(lambda: ran.append(1))
    with pytest.raises(OSError, match="file is gone"):
        land([Event(FutureEvent(failed)), copy])
    assert ran == []


def test_land_counts_the_time_waited_for_tier_reads_only(monkeypatch):
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(None)
    ticks = iter([10.0, 12.5, 20.0, 21.0])  # a clock read only around the tier's waits
    monkeypatch.setattr(host, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert land([Event(FutureEvent(done)), Event(DONE), Event(FutureEvent(done))]) == 3.5


def test_gradient_buffers_hand_each_tensor_to_one_copy_a_step():
    buffers = host.GradientBuffers()
    first, second = torch.zeros(3), torch.zeros(2)
    buffers.keep(1, first)
    buffers.keep(2, second)
    taken = buffers.take_all([1, 3])
    assert taken[0] is first and taken[1] is None
    # a second share of key 1 (a tied weight, another device) lands in a new tensor
    taken = buffers.take_all([1, 2])
    assert taken[0] is None and taken[1] is second and len(buffers) == 0
    buffers.keep(1, first)
    assert buffers.take_all([1])[0] is first
