"""The one module that touches streams and events.

The program names logical streams (``schedule.actions.Stream``); a device maps them to real ones.
Every harmony op hands its work to ``submit(stream, work)``, which returns the event that marks the
work done; ``wait(event, stream)`` makes a stream (or, for ``HOST``, the calling thread) wait.

* ``HostStreams``: the work runs inline, so every event is complete when it is recorded (the
  verifier still checks that every wait is there).
* ``ChaosStreams`` (HostDevice with ``chaos=seed``): one worker thread per stream, each sleeping a
  random while before every item, so a missing wait lets a consumer run before its producer and
  shows up as an error or a wrong number instead of passing by luck.
Each also keeps the device's clock for the measured timeline: ``mark(stream)`` notes the moment
the stream reaches this point and ``seconds(origin, mark)`` reads the time between two marks. On a
host a mark is the host's time; on a GPU it is a CUDA timing event, so spans are the GPU's own time,
read once the work has run.

* ``CudaStreams``: the current stream computes, one stream per copy direction; work is issued on the
  controller thread and the GPU runs it asynchronously.
"""
from __future__ import annotations

import queue
import random
import threading
import time
from typing import Callable

import torch

from harmony_fx.program.actions import Stream

__all__ = ["HostStreams", "ChaosStreams", "CudaStreams"]


class _DoneEvent:
    """An event of an inline stream: complete when recorded."""

    __slots__ = ()

    def synchronize(self) -> None:
        return None


_DONE = _DoneEvent()


class _HostClock:
    """Marks in host seconds: the work of an inline stream (or a chaos worker) runs when issued."""

    @staticmethod
    def mark(stream: Stream | None = None) -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(origin: float, mark: float) -> float:
        return mark - origin


class HostStreams(_HostClock):
    def submit(self, stream: Stream, work: Callable[[], None]) -> _DoneEvent:
        work()
        return _DONE

    def wait(self, event, stream: Stream) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        return None

    def end_program(self) -> None:
        return None

    def close(self) -> None:
        return None


class _ThreadEvent:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def synchronize(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class ChaosStreams(_HostClock):
    """One worker thread per stream with random delays (see the module docstring)."""

    def __init__(self, seed: int, max_delay: float = 0.002) -> None:
        self._random = random.Random(seed)
        self._max_delay = max_delay
        self._queues: dict[Stream, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._last_compute: _ThreadEvent | None = None
        for stream in (Stream.COMPUTE, Stream.H2D, Stream.D2H, Stream.PEER):
            self._queues[stream] = queue.SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(self._queues[stream],), daemon=True,
                                      name=f"harmony-chaos-{stream.value}")
            thread.start()
            self._threads.append(thread)

    def _serve(self, items: queue.SimpleQueue) -> None:
        while True:
            item = items.get()
            if item is None:
                return
            work, event, delay = item
            del item
            time.sleep(delay)
            try:
                if self._error is None:
                    work()
            except BaseException as error:  # noqa: BLE001 - handed to the controller at its next wait
                self._error = self._error or error
            # the task's tensors are the runtime's to free once it learns the task is done: this
            # thread lets go first (else they live on until its next task comes, past the plan's peak)
            del work
            event.error = self._error
            event.done.set()
            del event

    def submit(self, stream: Stream, work: Callable[[], None]) -> _ThreadEvent:
        event = _ThreadEvent()
        if stream in (Stream.H2D, Stream.PEER):
            # As on a GPU (CudaDevice.to_device), a copy's destination is allocated in compute-stream
            # order: the copy starts once the compute work issued before it has run, so device
            # memory is taken and given back in program order and the static peak still holds.
            fence = self._last_compute
            work = _after(fence, work)
        self._queues[stream].put((work, event, self._random.uniform(0, self._max_delay)))
        if stream == Stream.COMPUTE:
            self._last_compute = event
        return event

    def wait(self, event: _ThreadEvent, stream: Stream) -> None:
        if stream == Stream.HOST:
            event.synchronize()
        else:
            self.submit(stream, event.done.wait)

    def end_program(self) -> None:
        """A program's end: its work has run, and the first error any stream hit is raised."""
        self.synchronize()

    def synchronize(self) -> None:
        """Wait until every stream has run everything submitted; raise the first error."""
        for stream in self._queues:
            self.submit(stream, lambda: None).done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        for items in self._queues.values():
            items.put(None)
        for thread in self._threads:
            thread.join()


def _after(event: _ThreadEvent | None, work: Callable[[], None]) -> Callable[[], None]:
    if event is None:
        return work

    def fenced() -> None:
        event.done.wait()
        work()

    return fenced


class CudaStreams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.copy = {stream: torch.cuda.Stream(device) for stream in (Stream.H2D, Stream.D2H, Stream.PEER)}

    def stream(self, stream: Stream) -> torch.cuda.Stream:
        return self.compute if stream in (Stream.COMPUTE, Stream.HOST) else self.copy[stream]

    def submit(self, stream: Stream, work: Callable[[], None]) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream(stream)):
            work()
        # blocking: a thread that waits for it on the host (a controller, an update worker) sleeps
        # instead of spinning on a core the optimizer and the copies need
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream(stream))
        return event

    def mark(self, stream: Stream | None = None) -> torch.cuda.Event:
        """A timing event on ``stream`` (by default the stream work is being issued to)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream(stream) if stream is not None else torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def seconds(origin: torch.cuda.Event, mark: torch.cuda.Event) -> float:
        mark.synchronize()
        return origin.elapsed_time(mark) / 1e3

    def wait(self, event, stream: Stream) -> None:
        if stream == Stream.HOST or not isinstance(event, torch.cuda.Event):
            event.synchronize()  # the host's, or another device's hand-over: block the issuing thread
        else:
            self.stream(stream).wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def end_program(self) -> None:
        """Nothing to wait for: a program ends with the host waiting for every copy it made to the
        host (the verifier checks it), so what the caller reads has landed; work still running is
        on the same streams the next program issues to, in order. Not draining the GPU here is
        what lets the backward program's first tasks queue behind the forward's last."""


