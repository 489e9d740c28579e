"""An event-driven simulator of the device programs: iteration time, memory over time, bytes, trace.

It runs the same ``Action`` lists the runtime runs, with the runtime's semantics:

* each device's controller issues its actions in order; a ``WAIT`` on the host stream blocks it
  (and so everything after it) until the event is recorded;
* each stream (compute, host→device, device→host, peer) runs its actions in issue order; a
  ``WAIT`` on a stream holds that stream until the event is recorded;
* ``UPDATE`` goes to a pool of host (CPU) optimizer workers and does not block the controller; in
  data-parallel every device issues it, and it runs once all ``update_arrivals`` have, the
  weight-gradient copies each names (``Action.after``) have landed, and the updates before it
  have started (the workers take them in order);
* a ``RECV`` completes when its ``SEND`` has;
* a copy onto the device (``PREFETCH``, ``RECV``) starts only once the compute tasks issued before
  it have finished: its memory is allocated in compute-stream order, as ``CudaDevice`` does (a
  copy issued right after a task waits for that task);
* on a device whose streams run inline (``DeviceSpec.inline``: a HostDevice) the controller
  issues the next action only once the last one has finished, and nothing while an ``UPDATE``
  runs: the host optimizer shares the cores and Python's interpreter lock with it;
* copies between host and device run at the device's link speed, and all devices' copies in one
  direction share the host's link (``HostSpec.link_bandwidth``), fairly, at every instant; each
  first pays its fixed cost (``DeviceSpec.copy_seconds``: issuing it, its bookkeeping);
* the ``READ``/``WRITE`` of a pack's state on the NVMe tier (``lowering.tier_io``) go to the
  host's one I/O lane (the drive: the runtime's reader and writer share it), in issue order across
  devices, at the tier's read and write bandwidth
  (``HostSpec.nvme_read``, ``nvme_write``); an ``UPDATE`` waits for its pack's read as for its
  gradients, and a ``WRITE`` starts once the pack's update has ended (the runtime streams the
  three through a pack a parameter at a time: here they are whole, which errs long by at most one
  pack's read and write). No program waits for a write: an iteration's last writes go on into the
  next one, whose reads queue behind them. ``simulate`` therefore runs the iteration again with the
  lane busy at its start for the writes the run before carried over, until that settles (the
  steady state), and the iteration ends with its last action but those writes; where the drive is
  the bottleneck and the carried time keeps growing, it ends no sooner than the lane's own work.

Memory follows issue order, as a caching allocator does: the controller allocates a copy's
target or a task's outputs when it issues them and frees a key when it issues its ``FREE`` (or the
task that consumes it); stream order makes the reuse safe. A compute task's peak
(``Costs.task_peak``, measured or estimated) counts at its issue, too. The costs (seconds per
task, bytes per key) come from a ``Costs`` object, so the same simulator serves a compiled module
(exact key sizes, measured task memory) and a planner's layer chain (profiles).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
from typing import Protocol, Sequence

from harmony_fx.planner.specs import DeviceSpec, HostSpec
from harmony_fx.program.actions import Action, ActionKind as K, Key, Stream

__all__ = ["Costs", "Simulation", "simulate", "SimulationDeadlock"]

_COMPUTE = (K.FWD, K.RECOMPUTE, K.BWD)
_DEVICE_STREAMS = tuple(stream for stream in Stream if stream not in (Stream.HOST, Stream.IO))


class Costs(Protocol):
    def key_bytes(self, key: Key) -> int: ...
    def compute_seconds(self, action: Action) -> float: ...
    def task_peak(self, action: Action, allocated: int) -> int: ...
    # bytes above the level at the task's start at its peak; ``allocated``: what its new keys take
    def update_seconds(self, pack: int) -> float: ...
    def pack_params(self, pack: int) -> int: ...


class SimulationDeadlock(ValueError):
    """The programs wait on each other forever."""


@dataclasses.dataclass
class Simulation:
    seconds: float                                   # the iteration: until the last action ends (see above)
    peak_bytes: list[int]                            # per device
    memory: list[list[tuple[float, int]]]            # per device: (time, bytes resident) steps
    bytes_moved: dict[tuple[str, str], int]          # (direction, key kind) -> bytes, all devices
    bytes_by_device: list[dict[str, int]]            # per device: direction -> bytes
    busy: dict[tuple[int, str], float]               # (device, stream) -> busy seconds
    # (device, stream, label or the action itself, start, end): a search simulates millions of
    # actions and reads the spans of one simulation, so an action's label is made when read
    span_records: list[tuple[int, str, object, float, float]]
    io_carried: float = 0.0  # the last iteration's writes the NVMe lane finishes at this one's start

    @functools.cached_property
    def spans(self) -> list[tuple[int, str, str, float, float]]:
        """(device, stream, label, start, end) of every action, in the order they ended."""
        return [(device, stream, label if isinstance(label, str) else repr(label).split(" -> ")[0], start, end)
                for device, stream, label, start, end in self.span_records]

    def trace_events(self) -> list[dict]:
        from harmony_fx.trace import chrome_events
        return chrome_events(self.spans, self.memory)


@dataclasses.dataclass
class _Transfer:
    action: Action
    device: int
    lane: str          # "h2d" / "d2h" share the host link; "peer" does not
    remaining: float
    size: float
    start: float
    latency: float = 0.0  # the copy's fixed cost still to pay before its bytes (``DeviceSpec.copy_seconds``)


def simulate(programs: Sequence[Sequence[Action]], costs: Costs, spec: DeviceSpec,
             host: HostSpec = HostSpec(), update_arrivals: int = 1) -> Simulation:
    """Run one iteration of every device's program (forward then backward, concatenated), in the
    steady state of the NVMe tier's carried writes (see the module docstring)."""
    carried = 0.0
    for _ in range(_CARRY_ROUNDS):
        simulator = _Simulator(programs, costs, spec, host, update_arrivals, io_busy=carried)
        simulation = simulator.run()
        trailing = max(0.0, simulator.last_end - simulator.core_end)
        if trailing <= carried + _CARRY_SETTLED * simulation.seconds:
            return dataclasses.replace(simulation, io_carried=carried)
        carried = trailing
    # the drive is the bottleneck: each iteration carries more; it cannot be shorter than the lane's work
    lane = sum(seconds for (_, stream), seconds in simulation.busy.items() if stream == Stream.IO.value)
    return dataclasses.replace(simulation, seconds=max(simulation.seconds, lane), io_carried=carried)


_CARRY_ROUNDS = 4      # simulations at most to find the steady state of the carried writes
_CARRY_SETTLED = 0.01  # ... settled when they grow by less than this share of the iteration


class _Simulator:
    def __init__(self, programs, costs: Costs, spec: DeviceSpec, host: HostSpec, update_arrivals: int,
                 io_busy: float = 0.0) -> None:
        self.update_arrivals = update_arrivals
        self.arrived: collections.Counter = collections.Counter()
        self.programs = [list(p) for p in programs]
        self.costs, self.spec, self.host = costs, spec, host
        n = len(programs)
        self.now = 0.0
        self.issued = [0] * n
        self.queues = {(d, s): collections.deque() for d in range(n) for s in _DEVICE_STREAMS}
        self.running: dict[tuple[int, Stream], tuple[float, float, Action]] = {}  # start, end, task
        self.transfers: list[_Transfer] = []
        self.copying: collections.Counter = collections.Counter()  # (device, stream) -> its transfers running
        self.updates: list[float] = []      # end times of running CPU updates (a heap)
        self.update_queue: collections.deque = collections.deque()
        self.update_after: collections.defaultdict = collections.defaultdict(set)  # pack -> copies it waits for
        # per device, compute tasks issued and finished; per copy onto the device, how many must
        # have finished before it starts
        self.computes_issued, self.computes_done = [0] * n, [0] * n
        self.fences: dict[int, int] = {}
        # (device whose program records it, event) -> time: data-parallel programs number their
        # events independently, so an event is only named by its device and number together
        self.done_events: dict[tuple[int, int], float] = {}
        self.sent: dict[tuple[int, Key], float] = {}
        self.resident: list[dict[Key, int]] = [{} for _ in range(n)]
        self.in_use = [0] * n
        self.memory = [[(0.0, 0)] for _ in range(n)]
        self.moved: dict[tuple[str, str], int] = collections.defaultdict(int)
        self.by_device = [collections.defaultdict(int) for _ in range(n)]
        self.busy: dict[tuple[int, str], float] = collections.defaultdict(float)
        self.spans: list[tuple[int, str, object, float, float]] = []  # Simulation.span_records
        self.last_end = 0.0
        self.core_end = 0.0  # the last end but the NVMe writes', which the next iteration may overlap
        self.network_free = 0.0  # when the link to the other servers is next free
        self.io_queue: collections.deque = collections.deque()  # (device, READ/WRITE) in issue order
        self.io_running: tuple[float, float, int, Action] | None = None  # start, end, device, action
        self.io_free_at = io_busy  # the lane finishes the last iteration's writes first
        self.updated_at: dict[int, float] = {}  # pack -> when its update ends
        self.held_until = 0.0  # inline devices: an update holds the host's cores and interpreter until then
        # ``run``'s controllers and queues that may move on, and those asleep by what they wait for
        self.awake: set[tuple[int, Stream | None]] = set()
        self.asleep: collections.defaultdict = collections.defaultdict(set)
        self.blocked_on: tuple = ()  # why the last ``_issue`` or ``_start`` stopped

    # -------------------------------------------------------------- memory
    def _hold(self, device: int, key: Key) -> None:
        if key not in self.resident[device]:
            size = self.costs.key_bytes(key)
            self.resident[device][key] = size
            self._memory(device, size)

    def _drop(self, device: int, key: Key) -> None:
        size = self.resident[device].pop(key, None)
        if size is not None:
            self._memory(device, -size)

    def _allocate(self, device: int, action: Action) -> None:
        """The memory effect of issuing ``action``."""
        if action.kind in (K.PREFETCH, K.RECV):
            self._hold(device, action.key)
        elif action.kind == K.FREE:
            self._drop(device, action.key)
        elif action.kind in _COMPUTE:
            # the task's peak, then what it leaves: its new keys, less what it consumed
            resident = self.resident[device]
            new = {key: self.costs.key_bytes(key) for key in action.writes if key not in resident}
            peak = self.costs.task_peak(action, sum(new.values()))
            resident.update(new)
            left = sum(new.values()) - sum(resident.pop(key, 0) for key in action.consumes)
            self._memory(device, peak)
            self._memory(device, left - peak)

    def _memory(self, device: int, delta: int) -> None:
        if delta:
            self.in_use[device] += delta
            self.memory[device].append((self.now, self.in_use[device]))

    # -------------------------------------------------------------- issuing and starting
    def _issue(self, device: int) -> bool:
        program, progressed = self.programs[device], False
        while self.issued[device] < len(program):
            if self.spec.inline and self._busy(device):
                return progressed  # each op runs to completion as it is issued
            action = program[self.issued[device]]
            self._allocate(device, action)
            if action.kind in _COMPUTE:
                self.computes_issued[device] += 1
            elif action.kind in (K.PREFETCH, K.RECV):
                self.fences[id(action)] = self.computes_issued[device]
            if action.stream == Stream.IO:
                self.io_queue.append((device, action))
            elif action.stream == Stream.HOST:
                if action.kind == K.WAIT:
                    waited = self._waited_event(device, action)
                    if waited not in self.done_events:
                        self.blocked_on = ("event", waited)
                        return progressed
                elif action.kind == K.SPLIT:  # views: done as it is issued
                    self._record(device, action)
                else:  # UPDATE: handed to the CPU workers once every device has sent its gradients
                    self.arrived[action.pack] += 1
                    self.update_after[action.pack].update((device, e) for e in action.after)
                    if self.arrived[action.pack] == self.update_arrivals:
                        self.update_queue.append((device, action))
            else:
                self.queues[(device, action.stream)].append(action)
                self._wake(("queued", device, action.stream))
            self.issued[device] += 1
            progressed = True
        self.blocked_on = ("finished", device)  # nothing wakes it
        return progressed

    def _start(self, device: int, stream: Stream) -> bool:
        queue, progressed = self.queues[(device, stream)], False
        while True:
            if not queue:
                self.blocked_on = ("queued", device, stream)
                return progressed
            if (device, stream) in self.running or self.copying[(device, stream)] > 0:
                self.blocked_on = ("free", device, stream)
                return progressed
            action = queue[0]
            if action.kind == K.WAIT:
                waited = self._waited_event(device, action)
                if waited not in self.done_events:
                    self.blocked_on = ("event", waited)
                    return progressed
            elif action.kind == K.FREE:
                pass  # its memory went back at issue
            elif action.kind in (K.PREFETCH, K.RECV) and self.computes_done[device] < self.fences[id(action)]:
                self.blocked_on = ("fence", device)
                return progressed  # its destination is allocated after the compute issued before it
            elif action.kind == K.RECV:
                sent = self.sent.get((action.peer, action.key))
                if sent is None:
                    self.blocked_on = ("sent", action.peer, action.key)
                    return progressed
                self._count(device, action)
                self._record(device, action)
            elif action.kind in _COMPUTE:
                self.running[(device, stream)] = (self.now, self.now + self.costs.compute_seconds(action), action)
                queue.popleft()
                return True
            else:  # PREFETCH / OFFLOAD / SEND
                lane = action.stream.value  # a copy's lane is its stream: h2d, d2h or peer
                size = self.costs.key_bytes(action.key)
                if action.kind != K.SEND:
                    self._count(device, action)
                self.transfers.append(_Transfer(action, device, lane, float(size), float(size), self.now,
                                                self.spec.copy_seconds))
                self.copying[(device, action.stream)] += 1
                queue.popleft()
                return True
            queue.popleft()
            progressed = True

    def _wake(self, blocker: tuple) -> None:
        """What slept on ``blocker`` is looked at again (``run``)."""
        sleeping = self.asleep.pop(blocker, None)
        if sleeping:
            self.awake |= sleeping

    def _busy(self, device: int) -> bool:
        return (self.held_until > self.now or any(d == device for d, _ in self.running)
                or any(t.device == device for t in self.transfers)
                or any(queue for (d, _), queue in self.queues.items() if d == device))

    def _start_updates(self) -> bool:
        progressed = False
        while self.update_queue and len(self.updates) < self.host.update_workers:
            device, action = self.update_queue[0]
            if any(copy not in self.done_events for copy in self.update_after[action.pack]):
                break  # its gradients are still on their way to the host
            self.update_queue.popleft()
            cluster = self.host.cluster
            if cluster.nodes > 1:
                end = self._update_across(device, action.pack, cluster)
            else:
                end = self._update(device, action.pack)
            heapq.heappush(self.updates, end)
            self.updated_at[action.pack] = end
            if self.spec.inline:
                self.held_until = max(self.held_until, end)
            self.last_end, self.core_end = max(self.last_end, end), max(self.core_end, end)
            progressed = True
        return progressed

    def _start_io(self) -> bool:
        """The I/O lane takes its next READ or WRITE (a WRITE once its pack's update has ended)."""
        if self.io_running is not None or not self.io_queue or self.now < self.io_free_at:
            return False
        device, action = self.io_queue[0]
        pack = int(action.key.name[1:])
        if action.kind == K.WRITE and self.updated_at.get(pack, float("inf")) > self.now:
            return False
        self.io_queue.popleft()
        nbytes = self.costs.key_bytes(action.key)
        rate = self.host.nvme_read if action.kind == K.READ else self.host.nvme_write
        self.io_running = (self.now, self.now + nbytes / rate, device, action)
        self.moved[("nvme", action.kind.name.lower())] += nbytes
        return True

    def _update(self, device: int, pack: int) -> float:
        """A pack's update on a host worker."""
        end = self.now + self.costs.update_seconds(pack)
        self.spans.append((device, "host", f"UPDATE p{pack}", self.now, end))
        self.busy[(device, "host")] += end - self.now
        return end

    def _update_across(self, device: int, pack: int, cluster) -> float:
        """A pack's update with other servers (``distributed.updates``): its fp32 gradients summed
        over the network (all-reduce, or reduce-scatter when sharded), the update (of 1/N of the
        pack when sharded), then, sharded, the updated weights gathered; the network is one lane,
        in pack order. The update worker is busy until its update ends; the gather runs on, and the
        iteration ends once it lands (the next iteration's first prefetch of the pack waits for it)."""
        nbytes = 4 * self.costs.pack_params(pack)
        sharded = cluster.shard_optimizer
        reduce = "reduce_scatter" if sharded else "all_reduce"
        start = max(self.now, self.network_free)
        reduced = start + cluster.collective_seconds(nbytes, reduce)
        self._network(device, pack, reduce, nbytes, start, reduced, cluster)
        updated = reduced + self.costs.update_seconds(pack) / (cluster.nodes if sharded else 1)
        self.spans.append((device, "host", f"UPDATE p{pack}", reduced, updated))
        self.busy[(device, "host")] += updated - reduced
        if sharded:
            start = max(updated, self.network_free)
            gathered = start + cluster.collective_seconds(nbytes, "all_gather")
            self._network(device, pack, "all_gather", nbytes, start, gathered, cluster)
            self.last_end, self.core_end = max(self.last_end, gathered), max(self.core_end, gathered)
        return updated

    def _network(self, device: int, pack: int, collective: str, nbytes: int, start: float, end: float, cluster) -> None:
        self.network_free = end
        self.moved[("net", collective)] += int(cluster.collective_bytes(nbytes, collective))
        self.spans.append((device, "net", f"{collective.upper()} p{pack}", start, end))
        self.busy[(device, "net")] += end - start

    def _count(self, device: int, action: Action) -> None:
        size = self.costs.key_bytes(action.key)
        direction = action.stream.value
        self.moved[(direction, action.key.kind.name.lower())] += size
        self.by_device[device][direction] += size

    def _record(self, device: int, action: Action) -> None:
        if action.event is not None:
            self.done_events[(device, action.event)] = self.now
            self._wake(("event", (device, action.event)))

    @staticmethod
    def _waited_event(device: int, action: Action) -> tuple[int, int]:
        return (device if action.peer is None else action.peer, action.event)

    # -------------------------------------------------------------- time
    def _rates(self) -> list[float]:
        lanes = collections.Counter(t.lane for t in self.transfers)
        rates = []
        for t in self.transfers:
            if t.lane == "peer":
                rates.append(self.spec.peer_bandwidth)
                continue
            rate = self.spec.host_bandwidth
            if self.host.link_bandwidth is not None:
                rate = min(rate, self.host.link_bandwidth / lanes[t.lane])
            rates.append(rate)
        return rates

    def _advance(self) -> bool:
        rates = self._rates()
        transfer_ends = [self.now + t.latency + t.remaining / r for t, r in zip(self.transfers, rates)]
        candidates = [end for _, end, _ in self.running.values()] + transfer_ends
        if self.updates:
            candidates.append(self.updates[0])
        if self.held_until > self.now:
            candidates.append(self.held_until)
        if self.io_running is not None:
            candidates.append(self.io_running[1])
        elif self.io_queue and self.io_free_at > self.now:
            candidates.append(self.io_free_at)
        if not candidates:
            return False
        then = min(candidates)
        elapsed = then - self.now
        self.now = then
        finished = []
        for t, rate, end in zip(self.transfers, rates, transfer_ends):
            paid = min(t.latency, elapsed)
            t.latency -= paid
            t.remaining -= rate * (elapsed - paid)
            if end <= then:  # by time, not by bytes left: rounding must not keep a copy alive
                finished.append(t)
        for t in finished:
            self.transfers.remove(t)
            self.copying[(t.device, t.action.stream)] -= 1
            self._finish(t.device, t.action.stream, t.action, t.start)
            if t.action.kind == K.SEND:
                self.sent[(t.device, t.action.key)] = self.now
                self._wake(("sent", t.device, t.action.key))
        for where, (start, end, action) in list(self.running.items()):
            if end <= self.now:
                del self.running[where]
                self.computes_done[where[0]] += 1
                self._wake(("fence", where[0]))
                self._finish(where[0], where[1], action, start)
        while self.updates and self.updates[0] <= self.now:
            heapq.heappop(self.updates)
        if self.io_running is not None and self.io_running[1] <= self.now:
            start, _, device, action = self.io_running
            self.io_running = None
            self._finish(device, Stream.IO, action, start)
        return True

    def _finish(self, device: int, stream: Stream, action: Action, start: float) -> None:
        self._wake(("free", device, stream))
        self._record(device, action)
        self.spans.append((device, stream.value, action, start, self.now))
        self.busy[(device, stream.value)] += self.now - start
        self.last_end = max(self.last_end, self.now)
        if action.kind != K.WRITE:
            self.core_end = max(self.core_end, self.now)

    def run(self) -> Simulation:
        # Each controller (a device's issue, ``None``) and each stream queue is looked at in one
        # fixed order, as long as it moves on; one that cannot sleeps until what it waits for
        # happens (``blocked_on``: an event recorded, its stream free, a fence passed, a peer's send
        # landed, an action queued): a search simulates hundreds of thousands of steps, and at most
        # of them nearly every queue waits. Inline devices' controllers never sleep (a queue that
        # empties frees them).
        order = [(d, stream) for d in range(len(self.programs)) for stream in (None, *_DEVICE_STREAMS)]
        self.awake = set(order)
        while True:
            progressed = True
            while progressed:
                progressed = False
                for item in order:
                    if item not in self.awake:
                        continue
                    d, stream = item
                    if self._issue(d) if stream is None else self._start(d, stream):
                        progressed = True
                    elif stream is not None or not self.spec.inline:
                        self.awake.discard(item)
                        self.asleep[self.blocked_on].add(item)
                progressed |= self._start_updates()
                progressed |= self._start_io()
            if not self._advance():
                break
        self._check_finished()
        return Simulation(
            seconds=self.core_end,
            peak_bytes=[max(b for _, b in timeline) for timeline in self.memory],
            memory=self.memory,
            bytes_moved=dict(self.moved),
            bytes_by_device=[dict(d) for d in self.by_device],
            busy=dict(self.busy),
            span_records=self.spans,
        )

    def _check_finished(self) -> None:
        stuck = []
        for d, program in enumerate(self.programs):
            if self.issued[d] < len(program):
                stuck.append(f"d{d} controller at {program[self.issued[d]]!r}")
            for (device, stream), queue in self.queues.items():
                if device == d and queue:
                    stuck.append(f"d{d} {stream.value} at {queue[0]!r}")
        if stuck:
            raise SimulationDeadlock("simulate: the programs never finish; waiting: " + "; ".join(stuck))
