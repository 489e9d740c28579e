"""The program verifier: refuses a program that could race, read freed memory or overflow.

It replays one device's actions in issue order, tracking for each device key the event after which
it is valid and the copies still reading it, and for each stream the events it has waited for:

1. A compute task may only read a key that is resident, and if a copy (not the compute stream
   itself) made it, only after the compute stream waited for that copy's event.
2. A device→host copy may only start after its stream waited for whatever made the key.
3. A host→device copy of a value the program offloaded earlier waits for that offload.
4. Nothing is freed (``FREE``, or taken over by a task) while a copy that reads it may still run:
   the compute stream must have waited for every such copy.
5. Every copy whose result the caller reads is waited for on the host before the program ends,
   and an ``UPDATE`` comes after the host waited for every weight-gradient copy before it.
6. The static peak (from ``simulate`` or the fake run) is within the budget.

Errors are ``ProgramError`` (a ``ValueError``) naming the action, its index, and the pass that
created it.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from harmony_fx.schedule.actions import Action, ActionKind as K, Key, KeyKind, Stream

__all__ = ["ProgramError", "verify_program", "check_peak"]


class ProgramError(ValueError):
    """A program that the verifier refuses."""


def verify_program(actions: Sequence[Action], host_keys: Iterable[Key] = (),
                   host_results: Iterable[Key] = (), resident: Iterable[Key] = ()) -> None:
    """``host_keys``: keys present on the host before the program (model inputs, grad outputs);
    ``host_results``: host keys the caller reads afterwards; ``resident``: device keys the program
    starts with (the forward program's leftovers, for a backward program)."""
    ready: dict[Key, tuple[int | None, Stream]] = {key: (None, Stream.COMPUTE) for key in resident}
    readers: dict[Key, list[int]] = {}
    waited: dict[Stream, set[int]] = {stream: set() for stream in Stream}
    on_host: dict[Key, int | None] = {key: None for key in host_keys}
    stream_of_event: dict[int, Stream] = {}
    dw_offloads: list[tuple[Key, int]] = []

    def fail(index: int, action: Action, problem: str) -> None:
        creator = f" (created by {action.created_by})" if action.created_by else ""
        raise ProgramError(f"verify_program: action #{index} `{action!r}`{creator}: {problem}")

    def require_ready(index: int, action: Action, key: Key, stream: Stream) -> None:
        if key not in ready:
            fail(index, action, f"{key} is not on the device here (never fetched, or already freed)")
        event, made_on = ready[key]
        if event is not None and made_on != stream and event not in waited[stream] and event not in waited[Stream.HOST]:
            fail(index, action, f"{key} is made by e{event} on the {made_on.value} stream, "
                                f"but the {stream.value} stream does not WAIT for e{event} first")

    def require_no_readers(index: int, action: Action, key: Key) -> None:
        for event in readers.pop(key, []):
            if event not in waited[Stream.COMPUTE] and event not in waited[Stream.HOST]:
                fail(index, action, f"{key} is released while the copy e{event} may still read it: "
                                    f"WAIT for e{event} first")

    for index, action in enumerate(actions):
        kind = action.kind
        if action.event is not None and kind != K.WAIT:
            stream_of_event[action.event] = action.stream
        if kind == K.WAIT:
            if action.event not in stream_of_event:
                fail(index, action, f"waits for e{action.event}, which no earlier action records")
            waited[action.stream].add(action.event)
        elif kind == K.PREFETCH:
            if action.key not in on_host and action.key.kind != KeyKind.WEIGHTS:  # masters live on the host
                fail(index, action, f"{action.key} is not on the host")
            source = on_host.get(action.key)
            if source is not None and source not in waited[Stream.H2D] and source not in waited[Stream.HOST]:
                fail(index, action, f"copies {action.key} from the host before its offload e{source} finished: "
                                    f"WAIT for e{source} on h2d first")
            ready[action.key] = (action.event, Stream.H2D)
        elif kind == K.OFFLOAD:
            for key in action.reads or (action.key,):
                require_ready(index, action, key, Stream.D2H)
                readers.setdefault(key, []).append(action.event)
            on_host[action.key] = action.event
            if action.key.kind == KeyKind.WGRAD:
                dw_offloads.append((action.key, action.event))
            if action.key.kind == KeyKind.BUFFERS:  # written into the masters the next W copy reads
                on_host[Key(KeyKind.WEIGHTS, action.key.name)] = action.event
        elif kind == K.UPDATE:
            pending = [e for key, e in dw_offloads if e not in waited[Stream.HOST]]
            if pending:
                fail(index, action, f"updates parameters before the host waited for the gradient copies "
                                    f"{', '.join(f'e{e}' for e in pending)}")
        elif kind == K.FREE:
            if action.key not in ready:
                fail(index, action, f"frees {action.key}, which is not on the device")
            require_no_readers(index, action, action.key)
            del ready[action.key]
        else:  # compute
            for key in action.reads + action.consumes:
                require_ready(index, action, key, Stream.COMPUTE)
            for key in action.consumes:
                require_no_readers(index, action, key)
                del ready[key]
            for key in action.writes:
                ready[key] = (action.event, Stream.COMPUTE)
    for key in host_results:
        event = on_host.get(key)
        if event is not None and event not in waited[Stream.HOST]:
            raise ProgramError(f"verify_program: the caller reads {key}, but the program never waits for "
                               f"its copy e{event} on the host")


def check_peak(peak: int, budget: int | None, device: str) -> None:
    if budget is not None and peak > budget:
        raise ProgramError(f"verify_program: the static peak on {device} is {peak} bytes, over the budget of {budget}")
