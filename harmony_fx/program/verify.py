"""The program verifier: refuses a program that could race, read freed memory or overflow.

It replays one device's actions in issue order, tracking for each device key the event after which
it is valid and the copies still reading it, and for each stream the events it has waited for:

1. A compute task may only read a key that is resident, and if a copy (not the compute stream
   itself) made it, only after the compute stream waited for that copy's event.
2. A device→host copy may only start after its stream waited for whatever made the key.
3. A host→device copy of a value the program offloaded earlier waits for that offload.
4. Nothing is freed (``FREE``, or taken over by a task) while a copy that reads it may still run:
   the compute stream must have waited for every such copy.
5. Every device→host copy is waited for on the host before the program ends (what lands later
   would race with the caller, who reads the results, and with the next program, which reads the
   stash without waiting on this one's events), and an ``UPDATE`` names every weight-gradient
   copy before it that neither the host waited for nor an earlier ``UPDATE`` named (its worker
   waits for them).
6. The NVMe tier: a pack's state is read (``READ``) at most once, before the ``UPDATE`` of that
   pack, which names the read's event; it is written (``WRITE``) after that update, and every
   read state is stepped. No program needs to wait for a write: the tier commits the step once
   its writes are done, before the next step reads or updates (``runtime.tier``).
7. The static peak (from the FakeTensor run of the program) is within the budget (``check_peak``).

``verify_packs`` checks the captured graph after ``split_packs``: it lints, every compute node
belongs to one pack, and packs are convex (no value flows from a later pack back into an earlier
one), which is what lets the program run them in order.

``verify_devices`` checks what no single device can: every ``SEND`` meets its ``RECV``, a key one
device copies to the host is read by another only after it waited for that copy, and the devices,
run together, never wait for each other in a cycle.

Errors are ``ProgramError`` (a ``ValueError``) naming the action, its index, and the pass that
created it (``Action.created_by``).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from torch import fx

from harmony_fx.ir import meta
from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind, Stream

__all__ = ["ProgramError", "verify_packs", "verify_program", "verify_devices", "check_peak"]


class ProgramError(ValueError):
    """A program that the verifier refuses."""


def _describe(index: int, action: Action, device: int | None = None) -> str:
    """``d1 action #12 `FREE act[x@0]` (created by lower_program)``: what an error names."""
    where = "" if device is None else f"d{device} "
    creator = f" (created by {action.created_by})" if action.created_by else ""
    return f"{where}action #{index} `{action!r}`{creator}"


def verify_packs(gm: fx.GraphModule) -> None:
    """The graph lints and its packs (``meta.PACK`` on every compute node) are convex."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        pack = node.meta.get(meta.PACK)
        if pack is None:
            raise ProgramError(f"verify_packs: node {node.name!r} belongs to no pack (pass split_packs)")
        for arg in node.all_input_nodes:
            source = arg.meta.get(meta.PACK)
            if source is not None and source > pack:
                raise ProgramError(
                    f"verify_packs: node {node.name!r} in pack p{pack} reads {arg.name!r} from the later pack "
                    f"p{source}: packs are not convex (pass split_packs)")


def verify_program(actions: Sequence[Action], host_keys: Iterable[Key] = (),
                   host_results: Iterable[Key] = (), resident: Iterable[Key] = (), ends_iteration: bool = True) -> None:
    """``host_keys``: keys present on the host before the program (model inputs, grad outputs, and
    with several devices what the others offload); ``host_results``: host keys the caller reads
    afterwards; ``resident``: device keys the program starts with; ``ends_iteration=False``: a
    Trainer's forward, which its backward follows at once (the tier's reads may go on)."""
    ready: dict[Key, tuple[int | None, Stream]] = {key: (None, Stream.COMPUTE) for key in resident}
    readers: dict[Key, list[int]] = {}
    waited: dict[Stream, set[int]] = {stream: set() for stream in Stream}
    on_host: dict[Key, int | None] = {key: None for key in host_keys}
    stream_of_event: dict[int, Stream] = {}
    dw_offloads: list[tuple[Key, int]] = []
    handed: set[int] = set()  # weight-gradient copies an UPDATE named: its worker waits for them
    offloads: list[tuple[int, Action]] = []
    tier_reads: dict[Key, tuple[int, Action]] = {}  # state key -> its READ
    stepped: set[int] = set()                        # packs an UPDATE stepped so far
    # the action that last took each key off the device: an early FREE shows up at the next use,
    # and the error names both
    gone: dict[Key, tuple[int, Action]] = {}

    def fail(index: int, action: Action, problem: str) -> None:
        raise ProgramError(f"verify_program: {_describe(index, action)}: {problem}")

    def require_ready(index: int, action: Action, key: Key, stream: Stream) -> None:
        if key not in ready:
            if key in gone:
                dropped_at, dropper = gone[key]
                advice = "; move that FREE after this use" if dropper.kind == K.FREE else ""
                fail(index, action, f"{key} is not on the device here: {_describe(dropped_at, dropper)} "
                                    f"already dropped it{advice}")
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
            if action.event not in stream_of_event and action.peer is None:
                fail(index, action, f"waits for e{action.event}, which no earlier action records")
            waited[action.stream].add(action.event)
        elif kind == K.SEND:
            require_ready(index, action, action.key, Stream.PEER)
            readers.setdefault(action.key, []).append(action.event)
        elif kind == K.RECV:
            if action.key in ready:
                require_no_readers(index, action, action.key)  # it is added to in place
            ready[action.key] = (action.event, Stream.PEER)
            gone.pop(action.key, None)
        elif kind == K.PREFETCH:
            if action.key not in on_host and action.key.kind != KeyKind.WEIGHTS:  # masters live on the host
                fail(index, action, f"{action.key} is not on the host")
            source = on_host.get(action.key)
            if source is not None and source not in waited[Stream.H2D] and source not in waited[Stream.HOST]:
                fail(index, action, f"copies {action.key} from the host before its offload e{source} finished: "
                                    f"WAIT for e{source} on h2d first")
            ready[action.key] = (action.event, Stream.H2D)
            gone.pop(action.key, None)
        elif kind == K.OFFLOAD:
            for key in action.reads or (action.key,):
                require_ready(index, action, key, Stream.D2H)
                readers.setdefault(key, []).append(action.event)
            on_host[action.key] = action.event
            offloads.append((index, action))
            if action.key.kind == KeyKind.WGRAD:
                dw_offloads.append((action.key, action.event))
            if action.key.kind == KeyKind.BUFFERS:  # written into the masters the next W copy reads
                on_host[Key(KeyKind.WEIGHTS, action.key.name)] = action.event
        elif kind == K.READ:
            if action.key.kind != KeyKind.STATE or action.stream != Stream.IO:
                fail(index, action, "a READ moves a pack's optimizer state (S[pN]) on the io stream")
            if action.key in tier_reads:
                fail(index, action, f"reads {action.key} a second time (first at {_describe(*tier_reads[action.key])})")
            if int(action.key.name[1:]) in stepped:
                fail(index, action, f"reads {action.key} after its UPDATE already stepped the pack")
            tier_reads[action.key] = (index, action)
        elif kind == K.WRITE:
            pack = int(action.key.name[1:])
            if action.key not in tier_reads or pack not in stepped:
                fail(index, action, f"writes {action.key} back before it was read and its UPDATE p{pack} stepped it")
        elif kind == K.UPDATE:
            # the update worker waits for the copies the UPDATE names (and, in order, for those the
            # UPDATEs before it named); none may be left out
            state = Key(KeyKind.STATE, f"p{action.pack}")
            read = tier_reads[state][1].event if state in tier_reads else None
            if read is not None and read not in action.after:
                fail(index, action, f"steps p{action.pack} without waiting for its state: name the READ's e{read}")
            stepped.add(action.pack)
            unknown = [e for e in action.after if e != read and e not in {event for _, event in dw_offloads}]
            if unknown:
                fail(index, action, f"names {', '.join(f'e{e}' for e in unknown)}, which are not weight-gradient "
                                    "copies of this program")
            handed.update(action.after)
            pending = [e for key, e in dw_offloads if e not in waited[Stream.HOST] and e not in handed]
            if pending:
                fail(index, action, f"updates parameters before the gradient copies "
                                    f"{', '.join(f'e{e}' for e in pending)} landed: neither the host waited for "
                                    "them nor does this or an earlier UPDATE name them")
        elif kind == K.SPLIT:
            if action.key not in on_host:
                fail(index, action, f"splits {action.key}, which is not on the host")
            source = on_host[action.key]
            if source is not None and source not in waited[Stream.HOST]:
                fail(index, action, f"splits {action.key} before its copy e{source} landed: WAIT for e{source} "
                                    "on the host first")
            for key in action.writes:
                on_host[key] = action.event
            waited[Stream.HOST].add(action.event)  # the host ran it
        elif kind == K.FREE:
            if action.key not in ready:
                fail(index, action, f"frees {action.key}, which is not on the device")
            require_no_readers(index, action, action.key)
            del ready[action.key]
            gone[action.key] = (index, action)
        else:  # compute
            for key in action.reads + action.consumes:
                require_ready(index, action, key, Stream.COMPUTE)
            for key in action.consumes:
                require_no_readers(index, action, key)
                del ready[key]
                gone[key] = (index, action)
            for key in action.writes:
                ready[key] = (action.event, Stream.COMPUTE)
                gone.pop(key, None)
    last_copy = {action.key: (index, action) for index, action in offloads}
    for key in host_results:
        event = on_host.get(key)
        if event is not None and event not in waited[Stream.HOST]:
            fail(*last_copy[key], f"the caller reads {key}, but the program never waits for this copy on the "
                                  f"host: add WAIT e{event} host before the end")
    for key, (index, action) in tier_reads.items() if ends_iteration else ():
        if int(key.name[1:]) not in stepped:
            fail(index, action, f"reads {key}, but no UPDATE of the pack follows")
    for index, action in offloads:
        if action.event not in waited[Stream.HOST]:
            fail(index, action, f"the program ends without the host waiting for this copy: add "
                                f"WAIT e{action.event} host before the end")


def verify_devices(programs: Sequence[Sequence[Action]]) -> None:
    """Cross-device order (``programs[d]``: device d's actions, forward then backward):

    1. every ``SEND`` has exactly one matching ``RECV`` on its peer and the other way round;
    2. every wait for another device's event names an event that device records;
    3. a ``PREFETCH`` of a key another device copies to the host comes after this device waited
       (on its h2d stream or the host) for that copy: the host is shared, the streams are not;
    4. the programs, run together (a ``RECV`` blocks until its ``SEND`` ran, a wait for a
       ``SEND``'s event until the peer's ``RECV`` ran, a wait for another device's event until that
       device recorded it), all run to the end: no device waits for another in a cycle."""
    sends: dict[tuple[Key, int, int], tuple[int, int]] = {}
    recvs: dict[tuple[Key, int, int], tuple[int, int]] = {}
    recorded: dict[int, int] = {}
    writers: dict[Key, list[tuple[int, int]]] = {}  # host key -> (device, event) of each copy writing it

    def fail(device: int, index: int, problem: str) -> None:
        raise ProgramError(f"verify_devices: {_describe(index, programs[device][index], device)}: {problem}")

    for device, actions in enumerate(programs):
        for index, action in enumerate(actions):
            if action.kind in (K.SEND, K.RECV):
                table = sends if action.kind == K.SEND else recvs
                link = (action.key, device, action.peer) if action.kind == K.SEND else (action.key, action.peer, device)
                if link in table:
                    fail(device, index, f"{action.key} crosses d{link[1]} -> d{link[2]} twice")
                table[link] = (device, index)
            if action.event is not None and action.kind != K.WAIT:
                recorded[action.event] = device
            if action.kind == K.SPLIT:
                for key in action.writes:
                    writers.setdefault(key, []).append((device, action.event))
            if action.kind == K.OFFLOAD:
                writers.setdefault(action.key, []).append((device, action.event))
                if action.key.kind == KeyKind.BUFFERS:  # written into the masters the next W copy reads
                    writers.setdefault(Key(KeyKind.WEIGHTS, action.key.name), []).append((device, action.event))
    for link in set(sends) ^ set(recvs):
        device, index = sends.get(link) or recvs[link]
        other = "RECV" if link in sends else "SEND"
        fail(device, index, f"has no matching {other} on d{programs[device][index].peer}")
    for device, actions in enumerate(programs):
        waited: set[int] = set()
        for index, action in enumerate(actions):
            if action.kind == K.WAIT and action.stream in (Stream.H2D, Stream.HOST):
                waited.add(action.event)
            elif action.kind == K.PREFETCH:
                for writer, event in writers.get(action.key, ()):
                    if writer != device and event not in waited:
                        fail(device, index, f"copies {action.key} from the host, which d{writer} writes with "
                                            f"e{event}, without waiting for it: WAIT e{event} h2d from d{writer} first")
    send_event = {programs[d][i].event: link for link, (d, i) in sends.items()}
    position = [0] * len(programs)
    ran_events: set[int] = set()
    ran_recvs: set[tuple[Key, int, int]] = set()
    ran_sends: set[tuple[Key, int, int]] = set()

    def blocked(device: int, action: Action) -> bool:
        if action.kind == K.RECV:
            return (action.key, action.peer, device) not in ran_sends
        if action.kind == K.WAIT and action.event in send_event:
            return send_event[action.event] not in ran_recvs
        if action.kind == K.WAIT and action.peer is not None:
            if recorded.get(action.event) != action.peer:
                fail(device, position[device], f"d{action.peer} records no e{action.event}")
            return action.event not in ran_events
        return False

    progress = True
    while progress:
        progress = False
        for device, actions in enumerate(programs):
            while position[device] < len(actions) and not blocked(device, actions[position[device]]):
                action = actions[position[device]]
                if action.event is not None and action.kind != K.WAIT:
                    ran_events.add(action.event)
                if action.kind == K.SEND:
                    ran_sends.add((action.key, device, action.peer))
                elif action.kind == K.RECV:
                    ran_recvs.add((action.key, action.peer, device))
                position[device] += 1
                progress = True
    stuck = [_describe(position[d], programs[d][position[d]], d) for d in range(len(programs))
             if position[d] < len(programs[d])]
    if stuck:
        raise ProgramError("verify_devices: the devices wait for each other in a cycle; each is stuck at its "
                           "first action that waits for another: " + "; ".join(stuck))


def check_peak(peak: int, budget: int | None, device: str, at: tuple[int, Action] | None = None) -> None:
    """The static peak on ``device`` (from the FakeTensor run of its program) is within ``budget``.
    ``at``: ``(index, action)`` of the action after which the program first holds ``peak`` bytes,
    named in the error."""
    if budget is not None and peak > budget:
        where = "" if at is None else f", reached at {_describe(*at)}"
        raise ProgramError(f"verify_program: the static peak on {device} is {peak:,} bytes{where}, over the budget "
                           f"of {budget:,} bytes; raise memory_budget to at least {peak:,} or plan again")
