"""What devices exchange: parcels handed from one device's thread to another's, published events,
RNG states, a failed device waking the others, and the standalone links of one device run alone,
which answer as the live links of a run with every device do."""
from __future__ import annotations

import threading

import pytest
import torch

import harmony_fx
from harmony_fx.program.actions import Key, KeyKind
from harmony_fx.runtime.devices import HostDevice
from harmony_fx.runtime.host import DONE, Event
from harmony_fx.runtime.links import Links, StandaloneLinks
from harmony_fx.testing.models import MLPChain

KEY = Key(KeyKind.ACT, "h", 0)


def _in_thread(work) -> tuple[threading.Thread, list]:
    results: list = []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as error:  # noqa: BLE001 - handed to the test
            results.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


def test_a_parcel_is_copied_onto_the_receiver_and_its_sender_waits_until_it_is_taken():
    links, receiver = Links(), HostDevice("host:1")
    sent = torch.arange(4.0)
    handover = links.handover(KEY, 0, 1)
    thread, received = _in_thread(lambda: links.receive(KEY, 0, 1, receiver))  # waits for the post
    handover.post(sent, None)
    thread.join()
    (value,) = received
    assert torch.equal(value, sent) and value.data_ptr() != sent.data_ptr()
    assert handover.done.is_set()
    handover.synchronize()  # the sender may free the key: the receiver has its own copy
    assert receiver.live_bytes() == 16  # the copy is the receiver's, counted on its device
    links.drop_values()
    assert links.handover(KEY, 0, 1).value is None  # nothing kept for the sender's key


def test_a_published_event_is_found_by_its_number_on_another_thread():
    links = Links()
    thread, found = _in_thread(lambda: links.remote(7))
    event = Event(DONE)
    links.publish(7, event)
    thread.join()
    assert found == [event]


def test_a_failed_device_wakes_every_device_waiting_on_another():
    links = Links()
    receiving, received = _in_thread(lambda: links.receive(KEY, 0, 1, HostDevice("host:1")))
    waiting, remote = _in_thread(lambda: links.remote(3))
    released: list[BaseException] = []
    links.on_abort(released.append)
    error = ValueError("device 0 failed")
    links.abort(error)
    receiving.join()
    waiting.join()
    for result in (*received, *remote):
        assert isinstance(result, RuntimeError) and "another device stopped the iteration" in str(result)
        assert result.__cause__ is error
    assert released == [error] and links.failed is error
    late: list[BaseException] = []
    links.on_abort(late.append)  # registered after the failure: called at once
    assert late == [error]


def test_a_recompute_replays_the_rng_state_its_forward_saved_once():
    for links in (Links(), StandaloneLinks(lambda key: None)):
        state = torch.get_rng_state()
        links.save_rng_state(2, 1, state)
        assert links.rng_state(2, 1) is state
    with pytest.raises(AssertionError, match="no RNG state for p2@1"):
        Links().rng_state(2, 1)  # in a run with every device, the forward ran somewhere
    # alone: the forward ran on a device that is not run here
    assert StandaloneLinks(lambda key: None).rng_state(2, 1) is None


def test_standalone_links_make_what_a_peer_sends_send_nowhere_and_find_every_event_done():
    made: list[Key] = []
    links, device = StandaloneLinks(lambda key: made.append(key) or torch.ones(2, 3)), HostDevice("host:0")
    value = links.receive(KEY, 1, 0, device)
    assert made == [KEY] and value.shape == (2, 3) and device.live_bytes() == 24
    handover = links.handover(KEY, 0, 1)
    handover.post(torch.ones(1000), None)  # goes nowhere: keeps nothing alive
    handover.synchronize()
    assert handover.done.is_set()  # what a chaos stream's wait reads
    links.publish(5, Event(DONE))
    assert links.remote(5).device_event is DONE and links.remote(6).device_event is DONE


def test_standalone_links_receive_what_the_live_links_deliver_in_the_run_of_every_device(monkeypatch):
    """A pipeline of two devices in bf16: each key one device receives in the real run, the
    planning run of that device alone made with the same shape and dtype (the compute dtype, as
    the sender's device holds it), and so the planned peaks are the measured ones."""
    received: dict[str, set] = {"live": set(), "alone": set()}

    def recording(kind: str, receive):
        def wrapped(self, key, source, target, device):
            value = receive(self, key, source, target, device)
            received[kind].add((key, tuple(value.shape), value.dtype))
            return value
        return wrapped

    monkeypatch.setattr(Links, "receive", recording("live", Links.receive))
    monkeypatch.setattr(StandaloneLinks, "receive", recording("alone", StandaloneLinks.receive))
    torch.manual_seed(0)
    model, x = MLPChain(width=16, depth=6), torch.randn(8, 16)
    hm = harmony_fx.compile(model, x, devices=["host:0", "host:1"], parallel="pp", microbatches=4, precision="bf16",
                            pack_boundaries=(0, 2, 4), memory_budget=10**6, track_memory=True)
    hm(x).float().sum().backward()
    assert len(received["live"]) == 16  # two keys each way, four microbatches
    assert received["alone"] == received["live"]
    assert all(dtype == torch.bfloat16 for _, _, dtype in received["live"])
    assert hm.stats.peak_bytes == hm.plan.predicted_peak
