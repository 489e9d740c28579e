"""Streams and events: inline host streams, chaos streams (one thread per stream, random delays)
that keep every ordering the program asks for and no other, and CUDA streams on a GPU."""
from __future__ import annotations

import threading
import weakref

import pytest
import torch

from harmony_fx.program.actions import Stream
from harmony_fx.runtime.streams import ChaosStreams, CudaStreams, HostStreams


def test_host_streams_run_work_inline_and_every_event_is_done_when_recorded():
    streams, ran = HostStreams(), []
    event = streams.submit(Stream.H2D, lambda: ran.append(threading.current_thread()))
    assert ran == [threading.current_thread()]
    streams.wait(event, Stream.COMPUTE)
    event.synchronize()
    start = streams.mark()
    assert streams.seconds(start, start) == 0.0


@pytest.fixture
def chaos():
    streams = ChaosStreams(seed=3, max_delay=0.001)
    yield streams
    streams.close()


def test_chaos_streams_run_each_streams_work_in_order_on_its_own_thread(chaos):
    ran: list[tuple[str, int, str]] = []
    for i in range(20):
        for stream in (Stream.COMPUTE, Stream.D2H):
            chaos.submit(stream, lambda s=stream, i=i: ran.append((s.value, i, threading.current_thread().name)))
    chaos.end_program()
    for stream in ("compute", "d2h"):
        mine = [(i, thread) for s, i, thread in ran if s == stream]
        assert [i for i, _ in mine] == list(range(20))
        assert {thread for _, thread in mine} == {f"harmony-chaos-{stream}"}


@pytest.mark.parametrize("stream", [Stream.COMPUTE, Stream.H2D])
def test_a_chaos_stream_lets_go_of_its_work_before_saying_it_is_done(chaos, stream):
    """Once a task's event is done, the runtime frees what the task held (a copy's source, a
    pack's inputs): the stream's thread must not keep it alive until its next task comes, which
    a GPU's stream does not (a device tensor kept so was counted past the plan's peak)."""
    held = torch.ones(4)
    alive = weakref.ref(held)
    event = chaos.submit(stream, lambda held=held: held.add_(1))
    del held
    event.synchronize()
    assert alive() is None  # nothing else submitted: only the finished task could hold it


@pytest.mark.parametrize("seed", range(5))
def test_a_wait_orders_a_consumer_after_its_producer_on_another_stream(seed):
    streams = ChaosStreams(seed=seed, max_delay=0.001)
    try:
        values: list[int] = []
        consumed: list[int] = []
        for i in range(10):
            made = streams.submit(Stream.D2H, lambda i=i: values.append(i))
            streams.wait(made, Stream.PEER)
            streams.submit(Stream.PEER, lambda i=i: consumed.append(i in values))
        streams.end_program()
        assert consumed == [True] * 10
        # a HOST wait blocks the calling thread until the work ran
        made = streams.submit(Stream.D2H, lambda: values.append(99))
        streams.wait(made, Stream.HOST)
        assert values[-1] == 99
    finally:
        streams.close()


def test_a_copy_to_the_device_starts_after_the_compute_issued_before_it(chaos):
    """As on a GPU, a copy's destination is allocated in compute-stream order."""
    order: list[str] = []
    for i in range(10):
        chaos.submit(Stream.COMPUTE, lambda i=i: order.append(f"compute {i}"))
        chaos.submit(Stream.H2D, lambda i=i: order.append(f"copy {i}"))
    chaos.end_program()
    for i in range(10):
        assert order.index(f"copy {i}") > order.index(f"compute {i}")


def test_the_first_error_of_any_stream_is_raised_at_the_programs_end_and_later_work_skipped(chaos):
    ran: list[int] = []

    def failing() -> None:
        raise ValueError("a task failed")

    failed = chaos.submit(Stream.COMPUTE, failing)
    chaos.wait(failed, Stream.H2D)
    chaos.submit(Stream.H2D, lambda: ran.append(1))
    with pytest.raises(ValueError, match="a task failed"):
        chaos.end_program()
    assert ran == []
    chaos.submit(Stream.COMPUTE, lambda: ran.append(2))
    chaos.end_program()  # the error was handed over once: the next program runs
    assert ran == [2]


@pytest.mark.cuda
def test_cuda_streams_order_a_copy_stream_after_compute_and_time_by_the_gpu():
    device = torch.device("cuda", 0)
    streams = CudaStreams(device)
    source = torch.ones(1 << 20, device=device)
    result: list[torch.Tensor] = []
    start = streams.mark(Stream.COMPUTE)
    made = streams.submit(Stream.COMPUTE, lambda: result.append(source * 2))
    streams.wait(made, Stream.D2H)
    copied = streams.submit(Stream.D2H, lambda: result.append(result[0].to("cpu", non_blocking=False)))
    streams.wait(copied, Stream.HOST)
    end = streams.mark(Stream.COMPUTE)
    assert result[1].sum().item() == 2 * (1 << 20)
    assert streams.seconds(start, end) >= 0.0
    assert streams.stream(Stream.H2D) is not streams.stream(Stream.COMPUTE)
    assert streams.stream(Stream.HOST) is streams.stream(Stream.COMPUTE)
    streams.synchronize()
