"""What the devices of one iteration exchange: keys handed from one to another, the events one
program publishes for another's waits, and the RNG state and buffers a recompute replays.

``Links`` joins the runtimes of one iteration (one per device, each issuing from its own thread):
a send posts a parcel the receiver takes, a published event is found by its number in the
schedule, and a device that fails wakes every device waiting on another (``abort``).

``StandaloneLinks`` answers the same questions for one device's programs run alone, with no peer
(the FakeTensor planning run, ``runtime.probe``): what a peer would send is made when it is
received, what is sent is picked up at once and goes nowhere, another device's event is done, and
a recompute whose forward ran on another device has no RNG state or buffers to replay. The executor asks
both the same way and never asks whether there are peers.
"""
from __future__ import annotations

import threading
from typing import Callable

from harmony_fx.ir import values as pytrees
from harmony_fx.program.actions import Key
from harmony_fx.runtime.devices import Device
from harmony_fx.runtime.host import DONE, Event

__all__ = ["Links", "StandaloneLinks"]


class _Parcel:
    """One key on its way from one device to another: posted by the sender's peer stream, taken
    by the receiver's; its "picked up" signal is what the sender waits for before freeing."""

    __slots__ = ("value", "ready", "posted", "done")

    def __init__(self) -> None:
        self.value = None
        self.ready = None  # the sender's device event after which the value is made
        self.posted = threading.Event()
        self.done = threading.Event()

    def post(self, value: object, ready: object) -> None:
        self.value, self.ready = value, ready
        self.posted.set()

    def picked_up(self) -> None:
        self.done.set()

    def synchronize(self) -> None:
        self.done.wait()
        if self.value is not None and not self.posted.is_set():
            raise RuntimeError("another device stopped the iteration")


class Links:
    """The exchange between the devices of one iteration (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parcels: dict[tuple[Key, int, int], _Parcel] = {}
        self._events: dict[int, Event] = {}
        self._published = threading.Condition(self._lock)
        self.failed: BaseException | None = None
        self._on_abort: list[Callable[[BaseException], None]] = []
        # (pack, microbatch) -> the RNG state before its forward; the recompute may run on another device
        self._rng_states: dict[tuple[int, int], object] = {}
        # (pack, microbatch) -> host copies of the buffers its forward read and then updated (``Pack.replayed_buffers``)
        self._buffers: dict[tuple[int, int], list] = {}

    def handover(self, key: Key, source: int, target: int):
        """Where device ``source`` posts ``key`` for ``target`` (``post(value, ready)``), and the
        event that it was picked up (``synchronize``)."""
        return self._parcel(key, source, target)

    def receive(self, key: Key, source: int, target: int, device: Device) -> object:
        """``key`` as ``source`` sent it to ``target``, copied onto ``device`` (blocks until posted)."""
        parcel = self._parcel(key, source, target)
        parcel.posted.wait()
        self.check()
        device.wait_event(parcel.ready)  # the sender's GPU has made the value
        value = pytrees.map_tensors(device.to_device, parcel.value)
        parcel.value = None
        parcel.picked_up()
        return value

    def publish(self, number: int, event: Event) -> None:
        with self._published:
            self._events[number] = event
            self._published.notify_all()

    def remote(self, number: int) -> Event:
        """The event another device's program published as ``number`` (blocks until it does)."""
        with self._published:
            self._published.wait_for(lambda: number in self._events or self.failed is not None)
            self.check()
            return self._events[number]

    def save_rng_state(self, pack: int, mb: int, state: object) -> None:
        self._rng_states[(pack, mb)] = state

    def rng_state(self, pack: int, mb: int) -> object:
        """The RNG state saved before ``pack``'s forward of microbatch ``mb``, for its recompute (once)."""
        state = self._rng_states.pop((pack, mb), None)
        assert state is not None, f"no RNG state for p{pack}@{mb}"
        return state

    def save_buffers(self, pack: int, mb: int, values: list) -> None:
        self._buffers[(pack, mb)] = values

    def saved_buffers(self, pack: int, mb: int) -> list | None:
        """The buffers ``pack``'s forward of microbatch ``mb`` read before updating them, for its
        recompute (once); ``None`` only where that forward did not run here."""
        values = self._buffers.pop((pack, mb), None)
        assert values is not None, f"no saved buffers for p{pack}@{mb}"
        return values

    def drop_values(self) -> None:
        with self._lock:
            for parcel in self._parcels.values():
                parcel.value = None

    def abort(self, error: BaseException) -> None:
        """A device failed: wake every device waiting on another, so each stops with an error."""
        with self._published:
            self.failed = self.failed or error
            for parcel in self._parcels.values():
                parcel.posted.set()
                parcel.done.set()
            self._published.notify_all()
            callbacks, self._on_abort = self._on_abort, []
        for callback in callbacks:
            callback(error)

    def on_abort(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(error)`` once a device fails (now, if one has): a host worker whose work waits
        for what a failed device will never hand it (the NVMe tier's writes) is released by it."""
        with self._lock:
            failed = self.failed
            if failed is None:
                self._on_abort.append(callback)
        if failed is not None:
            callback(failed)

    def check(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"another device stopped the iteration: {self.failed!r}") from self.failed

    def _parcel(self, key: Key, source: int, target: int) -> _Parcel:
        with self._lock:
            parcel = self._parcels.setdefault((key, source, target), _Parcel())
            if self.failed is not None:
                parcel.posted.set()
                parcel.done.set()
            return parcel


class _Dropped:
    """A standalone run's hand-over: what is posted goes nowhere, and it counts as picked up."""

    __slots__ = ()
    done = DONE.done  # what a chaos stream waits on

    def post(self, value: object, ready: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


_DROPPED = _Dropped()


class StandaloneLinks(Links):
    """The links of one device run alone (see the module docstring). ``make(key)``: the value a
    peer would send for ``key``, as it would travel (in the dtype the graph has for it)."""

    def __init__(self, make: Callable[[Key], object]) -> None:
        super().__init__()
        self._make = make

    def handover(self, key: Key, source: int, target: int) -> _Dropped:
        return _DROPPED

    def receive(self, key: Key, source: int, target: int, device: Device) -> object:
        return pytrees.map_tensors(device.to_device, self._make(key))

    def publish(self, number: int, event: Event) -> None:
        return None

    def remote(self, number: int) -> Event:
        return Event(DONE)

    def rng_state(self, pack: int, mb: int) -> object | None:
        """As ``Links.rng_state``, but ``None`` where the forward ran on a device not run here."""
        return self._rng_states.pop((pack, mb), None)

    def saved_buffers(self, pack: int, mb: int) -> list | None:
        """As ``Links.saved_buffers``, but ``None`` where the forward ran on a device not run here."""
        return self._buffers.pop((pack, mb), None)
