"""The one module that touches streams and events.

The program names logical streams (``schedule.actions.Stream``); a device maps them to real ones.
``HostStreams`` runs every action inline on the calling thread, so each event is complete when it is
recorded and a wait has nothing to wait for (the verifier still checks that every wait is there).
``CudaStreams`` uses the current stream for compute and one stream per copy direction; a ``HOST``
wait blocks the controller thread on the event.
"""
from __future__ import annotations

import contextlib

import torch

from harmony_fx.schedule.actions import Stream

__all__ = ["HostStreams", "CudaStreams"]


class _DoneEvent:
    """An event of an inline stream: complete when recorded."""

    __slots__ = ()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DONE = _DoneEvent()


class HostStreams:
    def record(self, stream: Stream) -> _DoneEvent:
        return _DONE

    def wait(self, event: _DoneEvent, stream: Stream) -> None:
        return None

    def on(self, stream: Stream):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        return None


class CudaStreams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.copy = {Stream.H2D: torch.cuda.Stream(device), Stream.D2H: torch.cuda.Stream(device)}

    def stream(self, stream: Stream) -> torch.cuda.Stream:
        return self.compute if stream == Stream.COMPUTE else self.copy[stream]

    def record(self, stream: Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream(stream))
        return event

    def wait(self, event: torch.cuda.Event, stream: Stream) -> None:
        if stream == Stream.HOST:
            event.synchronize()
        else:
            self.stream(stream).wait_event(event)

    def on(self, stream: Stream):
        return torch.cuda.stream(self.stream(stream))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
