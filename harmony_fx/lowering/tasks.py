"""What both lowerings share: the builder that emits one device's actions and the compute tasks.

A ``Builder`` keeps, for one device, which keys are resident and since which event, which events
each stream has waited for and which copies still read a key; from that it decides every ``WAIT``
and when a ``FREE`` may go. ``forward_task`` and ``backward_task`` emit one pack's task on one
microbatch. Where a task's values come from and where they go is the one thing the lowerings do
differently, so it is asked of the builder (``fetch_input``, ``route_output``, ``keeps``,
``output_grads``, ``route_input_grad``): one device keeps a value for the next pack and takes
gradients from the host, a pipeline sends them to the peer that runs the next task.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.placement import forward_tasks
from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind, Stream

__all__ = ["ProgramSignature", "Builder", "EventCounter", "PackFacts", "weights", "grad_inputs", "forward_task",
           "backward_task", "buffers_out", "weight_grads_out", "update", "check_forward_parts", "split_stash", "forward_groups"]


@dataclasses.dataclass(frozen=True)
class ProgramSignature:
    """What lowering needs to know beyond the packs."""

    model_inputs: tuple[str, ...]
    model_outputs: tuple[str, ...]
    inputs_requiring_grad: frozenset[str]
    differentiable: frozenset[str]
    # the (global) indices of the microbatches this device's program runs
    microbatches: tuple[int, ...]
    # weights come in once per pack for all microbatches (False: once per microbatch, the
    # baseline Harmony is measured against)
    grouping: bool = True
    # the last pack's forward, loss and backward run as one task per microbatch (the Trainer,
    # whose loss is inside the graph and whose output gradients are known up front)
    fuse_last: bool = False
    # packs after whose weight gradients the host updates parameters (``UPDATE`` actions)
    update_packs: frozenset[int] = frozenset()
    # the forward's packs may be larger than the backward's (no graph, no gradients to hold): the
    # first pack of each forward group; a group's weights come in together and its packs run back
    # to back on each microbatch. Empty: every pack is a group of its own.
    forward_groups: tuple[int, ...] = ()
    # the backward fetches each task's stash one task ahead, so the copy overlaps the task before
    # (one more microbatch's stash on the device); off where that does not fit the budget
    stash_ahead: bool = True
    # the forward's larger microbatches (Harmony's Ufwd > Ubwd): each as (its index, the backward
    # microbatches it joins). The forward runs them, its stash is split on the host into the
    # backward's, and the last pack (fused: forward, loss and backward) runs in the backward
    # program on the backward's microbatches. Empty: the forward runs ``microbatches``.
    forward_parts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # a pipeline hands each microbatch's values to the next device device to device ("peer": the
    # sender keeps them until its pack ends, so that no two devices wait for each other), or
    # through the host ("host": the next device reads the stash the pack copies out anyway, and
    # the sender frees each microbatch's values as soon as that copy has landed)
    handoff: str = "peer"
    # a forward with no backward after it (a call under ``no_grad`` or ``inference_mode``): no
    # stash for a recompute, no graph kept by the last pack, and the backward program is empty
    forward_only: bool = False
    # the buffers the forward updates in place (BatchNorm statistics) go back to the host masters.
    # Data-parallel: only the first device's (each device updates its own copy from the one
    # master; every device writing back, the last writer would win, by timing): DDP's
    # broadcast_buffers, rank 0's statistics
    writes_buffers: bool = True

    @property
    def forward_microbatches(self) -> tuple[int, ...]:
        return tuple(f for f, _ in self.forward_parts) or self.microbatches

    @property
    def last_in_backward(self) -> bool:
        """The fused last pack runs in the backward program (after the forward's larger microbatches)."""
        return bool(self.forward_parts)


def weights(pack: int) -> Key:
    return Key(KeyKind.WEIGHTS, f"p{pack}")


def grad_inputs(pack: Pack, signature: ProgramSignature) -> tuple[str, ...]:
    """The inputs of ``pack`` whose gradient its backward produces."""
    return tuple(v for v in pack.act_inputs if v in signature.differentiable
                 and (v not in signature.model_inputs or v in signature.inputs_requiring_grad))


class EventCounter:
    """What the builders of several devices' programs share: event numbers and the host."""

    def __init__(self) -> None:
        self.num_events = 0
        self.event_device: dict[int, int] = {}
        self.on_host: dict[Key, int | None] = {}  # host key -> event of the last copy that wrote it


class PackFacts:
    """Facts about the packs that every task needs."""

    def __init__(self, packs: Sequence[Pack], signature: ProgramSignature) -> None:
        self.packs = packs
        self.signature = signature
        self.last = len(packs) - 1
        # the forward keeps a value on the device for the next pack it runs (none after the last)
        forward_end = self.last - 1 if signature.last_in_backward else self.last
        self.next_users = {pack.index: set(packs[pack.index + 1].act_inputs) if pack.index < forward_end else set()
                           for pack in packs}
        # for each model output: the first pack in backward order that reads or writes its gradient
        self.grad_owner: dict[str, int] = {}
        self.lowest_consumer: dict[str, int] = {}  # for each activation: the first pack that reads it
        self.last_consumer: dict[str, int] = {}    # and the last
        for pack in packs:
            for v in pack.outputs + pack.act_inputs:
                if v in signature.model_outputs:
                    self.grad_owner[v] = max(self.grad_owner.get(v, -1), pack.index)
            for v in pack.act_inputs:
                self.lowest_consumer.setdefault(v, pack.index)
                self.last_consumer[v] = pack.index
        self.dw_events: list[int] = []  # every copy of weight gradients, in issue order
        self.dw_pack: dict[int, int] = {}  # each of those copies -> the pack whose gradients it copies


class Builder:
    """Emits one device's actions and keeps the bookkeeping that decides waits and frees. The
    hooks at the end are one device's: values stay on the device for the next pack."""

    pass_name = "lower_program"

    def __init__(self, facts: PackFacts, device: int = 0, shared: EventCounter | None = None) -> None:
        self.facts = facts
        self.device = device
        self.shared = shared or EventCounter()
        self.on_host = self.shared.on_host
        self.actions: list[Action] = []
        self.ready: dict[Key, int] = {}           # device key -> event after which it is valid
        self.waited: dict[Stream, set[int]] = {s: set() for s in Stream}
        self.readers: dict[Key, list[int]] = {}   # device key -> events of copies reading it
        self.copy_events: set[int] = set()
        self.handed: set[int] = set()  # weight-gradient copies an earlier UPDATE of this program names

    def emit(self, kind: K, stream: Stream, **fields) -> int | None:
        event = None
        if kind not in (K.WAIT, K.FREE, K.UPDATE):
            event = self.shared.num_events
            self.shared.num_events += 1
            self.shared.event_device[event] = self.device
        self.actions.append(Action(kind, stream, event=fields.pop("event", event), device=self.device,
                                   created_by=self.pass_name, **fields))
        return event

    def wait(self, event: int | None, stream: Stream) -> None:
        # an event the host has waited for is complete for every stream, too
        if event is not None and event not in self.waited[stream] and event not in self.waited[Stream.HOST]:
            self.waited[stream].add(event)
            origin = self.shared.event_device[event]
            self.emit(K.WAIT, stream, event=event, peer=None if origin == self.device else origin)

    def resident(self, key: Key) -> bool:
        return key in self.ready

    def prefetch(self, key: Key) -> None:
        if self.resident(key):
            return
        # weights are read from the masters, which the host writes (buffers copied back)
        self.wait(self.on_host.get(key), Stream.HOST if key.kind == KeyKind.WEIGHTS else Stream.H2D)
        self.ready[key] = self.emit(K.PREFETCH, Stream.H2D, key=key)
        self.copy_events.add(self.ready[key])

    def use(self, keys: Iterable[Key]) -> None:
        for key in keys:
            if self.ready[key] in self.copy_events:  # compute-made keys are in stream order already
                self.wait(self.ready[key], Stream.COMPUTE)

    def compute(self, kind: K, pack: int, mb: int, produces: Iterable[Key], consumes: Iterable[Key] = (),
                reads: Iterable[Key] = ()) -> int:
        """``consumes``: keys the task takes over (and drops); ``produces``: keys it creates or
        adds to (the latest writer is what later copies wait for)."""
        consumes = list(consumes)
        for key in consumes:
            for reader in self.readers.pop(key, []):
                self.wait(reader, Stream.COMPUTE)
        produces = list(produces)
        event = self.emit(kind, Stream.COMPUTE, pack=pack, mb=mb, reads=tuple(reads),
                          consumes=tuple(consumes), writes=tuple(produces))
        for key in consumes:
            del self.ready[key]
        for key in produces:
            self.ready[key] = event
        return event

    def offload(self, key: Key) -> None:
        self.wait(self.ready[key], Stream.D2H)
        event = self.emit(K.OFFLOAD, Stream.D2H, key=key, reads=(key,))
        self.readers.setdefault(key, []).append(event)
        self.on_host[key] = event

    def free(self, key: Key) -> None:
        for event in self.readers.pop(key, []):
            self.wait(event, Stream.COMPUTE)
        del self.ready[key]
        self.emit(K.FREE, Stream.COMPUTE, key=key)

    # ------------------------------------------------------------------ where values come and go
    def fetch_input(self, key: Key, pack: int) -> None:
        """Bring an input activation of ``pack``'s forward to the device."""
        self.prefetch(key)

    def route_output(self, key: Key, pack: int) -> None:
        """After ``key`` (an output of ``pack``'s forward) is offloaded: nothing more on one device."""

    def to_host(self, key: Key, pack: int) -> bool:
        """Whether ``key``, an output of ``pack``'s forward, is copied to the host: all of them for
        the backward's recompute (the stash); in a forward-only program the model's outputs and
        what a pack after the next one reads (it does not stay on the device that long)."""
        facts = self.facts
        if not facts.signature.forward_only or key.name in facts.signature.model_outputs:
            return True
        return facts.last_consumer.get(key.name, -1) > pack + 1

    def keeps(self, key: Key, pack: int) -> bool:
        """Whether ``key``, an input or output of ``pack``'s forward, stays on the device after it."""
        return key.name in self.facts.next_users[pack]

    def before_recompute(self, pack: Pack, mb: int) -> None:
        """Waits a recompute needs beyond its inputs and weights: none on one device."""

    def output_grads(self, pack: Pack, mb: int) -> tuple[list[Key], list[Key]]:
        """The gradients ``pack``'s backward reads, made usable on the compute stream: those it
        consumes, and those it adds to and leaves (a model output that a later pack also reads)."""
        signature, p = self.facts.signature, pack.index
        # The caller's gradient of a model output comes in before the first task (in backward
        # order) that touches it: its producer, or a later pack that also reads it and adds to it.
        caller_grads = []
        for v in pack.outputs + pack.act_inputs:
            key = Key(KeyKind.GRAD, v, mb)
            if (v in signature.model_outputs and v in signature.differentiable and self.facts.grad_owner[v] == p
                    and not self.resident(key)):
                self.on_host.setdefault(key, None)
                self.prefetch(key)
                caller_grads.append(key)
        consumed = [Key(KeyKind.GRAD, v, mb) for v in pack.outputs
                    if v in signature.differentiable and self.resident(Key(KeyKind.GRAD, v, mb))]
        self.use(consumed + caller_grads)
        return consumed, [key for key in caller_grads if key not in consumed]

    def route_input_grad(self, key: Key, pack: int) -> None:
        """After ``pack``'s backward made the gradient ``key`` of one of its inputs: the host gets
        those of model inputs that require grad, after their last (lowest) consumer."""
        if key.name in self.facts.signature.inputs_requiring_grad and self.facts.lowest_consumer[key.name] == pack:
            self.offload(key)
            self.free(key)


def forward_task(b: Builder, pack: Pack, mb: int) -> int:
    """``pack``'s forward on microbatch ``mb``: inputs in, ``FWD``, every output to the host (the
    stash, or the model's output; forward-only: what ``Builder.to_host`` says), then free what the
    next task does not take. Returns its event."""
    p = pack.index
    keeps_graph = p == b.facts.last and not b.facts.signature.forward_only
    inputs = [Key(KeyKind.ACT, v, mb) for v in pack.act_inputs]
    for key in inputs:
        b.fetch_input(key, p)
    b.use(inputs)
    outputs = [Key(KeyKind.ACT, v, mb) for v in pack.outputs]
    # a forward that updates buffers in place writes W[p]: copies of it wait for the forward
    written = outputs + ([weights(p)] if pack.mutated_buffers else [])
    if keeps_graph:  # the last pack keeps its graph (and takes over its inputs) for the backward
        event = b.compute(K.FWD, p, mb, produces=written + [Key(KeyKind.GRAPH, pack.name, mb)],
                          consumes=inputs, reads=[weights(p)])
    else:
        event = b.compute(K.FWD, p, mb, produces=written, reads=inputs + [weights(p)])
    for key in outputs:
        if b.to_host(key, p):
            b.offload(key)
            b.route_output(key, p)
    if not keeps_graph:
        for key in inputs + outputs:
            if b.resident(key) and not b.keeps(key, p):
                b.free(key)
    return event


def backward_task(b: Builder, pack: Pack, mb: int) -> None:
    """``pack``'s backward on microbatch ``mb``: its stashed inputs in and ``RECOMPUTE`` (the last
    pack kept its graph), ``BWD`` with its outputs' gradients, then route its inputs' gradients."""
    p, signature = pack.index, b.facts.signature
    graph = Key(KeyKind.GRAPH, pack.name, mb)
    if p < b.facts.last:
        inputs = [Key(KeyKind.ACT, v, mb) for v in pack.act_inputs]
        for key in inputs:
            b.prefetch(key)
        b.use(inputs)
        b.before_recompute(pack, mb)
        b.compute(K.RECOMPUTE, p, mb, produces=[graph], consumes=inputs, reads=[weights(p)])
    consumed, added_to = b.output_grads(pack, mb)
    produced = [Key(KeyKind.GRAD, v, mb) for v in grad_inputs(pack, signature)]
    consumed = [graph] + consumed
    if p == b.facts.last:
        consumed += [Key(KeyKind.ACT, v, mb) for v in pack.outputs]
    # the weight gradients: created by the first microbatch, added to by the others
    b.compute(K.BWD, p, mb, produces=produced + [Key(KeyKind.WGRAD, pack.name)], consumes=consumed,
              reads=[weights(p)] + added_to)
    for key in produced:
        b.route_input_grad(key, p)


def weight_grads_out(b: Builder, pack: Pack) -> None:
    """dW out once per pack (per microbatch without grouping)."""
    key = Key(KeyKind.WGRAD, pack.name)
    if pack.params:
        b.offload(key)
        b.facts.dw_events.append(b.on_host[key])
        b.facts.dw_pack[b.on_host[key]] = pack.index
    b.free(key)


def update(b: Builder, pack: Pack) -> None:
    """If ``pack`` is the last to add to some parameters' gradients, the host updates them while the
    device goes on. The update worker, not the issuing thread, waits for this program's
    weight-gradient copies (those no earlier ``UPDATE`` or host wait of it covers): the next pack's
    tasks are issued at once, so the GPU does not drain while the copies land. A parameter shared
    with a pack another device ran (a tied weight across a pipeline) also waits, on the host, for
    that device's copy: an ``UPDATE`` names only its own program's events."""
    facts = b.facts
    if pack.index not in facts.signature.update_packs:
        return
    pending = [e for e in facts.dw_events if e not in b.handed and e not in b.waited[Stream.HOST]]
    mine = set(pack.params)
    for event in pending:
        if b.shared.event_device[event] != b.device and mine.intersection(facts.packs[facts.dw_pack[event]].params):
            b.wait(event, Stream.HOST)
    after = tuple(e for e in pending if b.shared.event_device[e] == b.device)
    b.handed.update(after)
    b.emit(K.UPDATE, Stream.HOST, pack=pack.index, after=after)


def buffers_out(b: Builder, pack: Pack, after: int) -> None:
    """Buffers the forward updated in place (BatchNorm statistics) back to the host masters."""
    if not b.facts.signature.writes_buffers:
        return
    b.wait(after, Stream.D2H)  # after the last microbatch's forward updated them
    event = b.emit(K.OFFLOAD, Stream.D2H, key=Key(KeyKind.BUFFERS, pack.name), reads=(weights(pack.index),))
    b.readers.setdefault(weights(pack.index), []).append(event)
    b.on_host[Key(KeyKind.BUFFERS, pack.name)] = event
    b.on_host[weights(pack.index)] = event


def check_forward_parts(packs: Sequence[Pack], signature: ProgramSignature, pass_name: str) -> None:
    """Forward microbatches larger than the backward's need what makes them compute the same:
    the loss inside the graph (the last pack then runs on the backward's microbatches) and no
    random op, whose recompute on part of a microbatch could not draw the forward's values."""
    if not signature.fuse_last:
        raise ValueError(f"{pass_name}: forward microbatches larger than the backward's need the loss inside the "
                         "graph: train with harmony_fx.Trainer, or give microbatches as one int")
    if not signature.grouping:
        raise ValueError(f"{pass_name}: forward microbatches larger than the backward's need grouping=True")
    random = [pack.name for pack in packs[:-1] if pack.random]
    if random:
        raise ValueError(f"{pass_name}: pack(s) {', '.join(random)} draw random numbers (dropout): their recompute on "
                         "a backward microbatch cannot draw what the forward drew on the larger one. Use one "
                         "microbatch size for forward and backward (microbatches=N), or turn the dropout off")


def split_stash(b: Builder, packs: Sequence[Pack]) -> None:
    """After the forward's copies landed: every stashed activation of a forward microbatch cut, on
    the host, into its backward microbatches (``SPLIT``: views, no copy)."""
    signature = b.facts.signature
    read = dict.fromkeys(v for pack in packs for v in pack.act_inputs if v not in signature.model_inputs)
    for forward_mb, parts in signature.forward_parts:
        for v in read:
            source = Key(KeyKind.ACT, v, forward_mb)
            # each device cuts what it copied out (in a pipeline the host is shared)
            if source in b.on_host and b.shared.event_device.get(b.on_host[source]) == b.device:
                event = b.emit(K.SPLIT, Stream.HOST, key=source, reads=(source,),
                               writes=tuple(source._replace(mb=mb) for mb in parts))
                b.waited[Stream.HOST].add(event)  # the host ran it: done for every stream
                for mb in parts:
                    b.on_host[source._replace(mb=mb)] = event


def forward_groups(signature: ProgramSignature, num_packs: int, pass_name: str) -> list[range]:
    """The forward's groups of packs (see ``ProgramSignature.forward_groups``), each run by one
    device as one forward pack; without the last pack where it runs in the backward program."""
    starts = list(signature.forward_groups) or list(range(num_packs))
    if starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= num_packs:
        raise ValueError(f"{pass_name}: forward groups {starts} must start at pack 0 and increase within "
                         f"{num_packs} packs")
    tasks = forward_tasks(starts, num_packs, signature.last_in_backward)
    return tasks[:-1] if signature.last_in_backward else tasks
