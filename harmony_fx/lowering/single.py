"""Lower packs to one device's program: compute, transfers, waits and frees, in issue order.

Forward, pack by pack (input-batch grouping: a pack's weights come in once for all microbatches):

1. ``PREFETCH W[p]`` (issued while the previous pack computes, so two packs' weights can be
   resident at once), ``WAIT`` for it on the compute stream.
2. Per microbatch: ``PREFETCH`` every input activation that is not resident (model inputs, and
   skip values stashed on the host), ``FWD``, then ``OFFLOAD`` every output to the host (the stash
   for backward, or the model's output). A value stays on the device only while the next pack
   still needs it.
3. ``OFFLOAD B[p]`` (buffers updated in place, e.g. BatchNorm statistics) and ``FREE W[p]``.

The last pack runs forward *with* grad and keeps its graph and weights to backward (it would be
recomputed at once otherwise). Backward, packs in reverse order:

4. ``PREFETCH W[p]``; per microbatch ``PREFETCH`` its stashed inputs, ``RECOMPUTE`` (with the RNG
   state of its forward), ``BWD`` with the gradients of its outputs (kept on the device, summed
   over every consumer), giving the gradients of its inputs and, summed over microbatches, of its
   weights.
5. ``OFFLOAD dW[p]`` once per pack, ``FREE`` weights and gradients; input gradients that the host
   wants (model inputs that require grad) are offloaded after their last consumer.

Every transfer is preceded by a ``WAIT`` for what produced its source and every use by a ``WAIT``
for the transfer; ``FREE`` of a key waits for every copy that reads it.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from harmony_fx.ir.pack import Pack
from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind, Stream

__all__ = ["lower_program", "forward_groups", "grad_inputs", "ProgramSignature", "PASS_NAME"]

PASS_NAME = "lower_program"


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


class _Shared:
    """What the builders of several devices' programs share: event numbers and the host."""

    def __init__(self) -> None:
        self.num_events = 0
        self.event_device: dict[int, int] = {}
        self.on_host: dict[Key, int | None] = {}  # host key -> event of the last copy that wrote it


class _Builder:
    """Emits one device's actions and keeps the bookkeeping that decides waits and frees."""

    pass_name = PASS_NAME

    def __init__(self, device: int = 0, shared: _Shared | None = None) -> None:
        self.device = device
        self.shared = shared or _Shared()
        self.on_host = self.shared.on_host
        self.actions: list[Action] = []
        self.ready: dict[Key, int] = {}           # device key -> event after which it is valid
        self.waited: dict[Stream, set[int]] = {s: set() for s in Stream}
        self.readers: dict[Key, list[int]] = {}   # device key -> events of copies reading it
        self.copy_events: set[int] = set()

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


def weights(pack: int) -> Key:
    return Key(KeyKind.WEIGHTS, f"p{pack}")


def lower_program(packs: Sequence[Pack], signature: ProgramSignature) -> tuple[list[Action], list[Action]]:
    """Returns the forward program and the backward program; the device state the forward leaves
    (the last pack's weights and graph) is what the backward starts from."""
    b = _Builder()
    microbatches = signature.microbatches
    last = len(packs) - 1
    for name in signature.model_inputs:
        for mb in microbatches:
            b.on_host[Key(KeyKind.ACT, name, mb)] = None  # the caller's tensors, already on host
    if signature.fuse_last:
        for name in signature.model_outputs:
            for mb in microbatches:
                b.on_host[Key(KeyKind.GRAD, name, mb)] = None  # known before the iteration (loss weights)
    context = _Context(packs, signature)
    grouping = signature.grouping

    # ---------------------------------------------------------------- forward
    groups = forward_groups(signature, len(packs))
    if grouping:
        for p in groups[0]:
            b.prefetch(weights(p))
    for g, group in enumerate(groups):
        if grouping:
            b.use([weights(p) for p in group])
            for p in groups[g + 1] if g + 1 < len(groups) else ():
                b.prefetch(weights(p))
        last_task = {}
        for mb in microbatches:
            for p in group:  # a forward group runs its packs back to back on each microbatch
                pack, fused = packs[p], p == last and signature.fuse_last
                if not grouping:
                    b.prefetch(weights(p))
                    b.use([weights(p)])
                event = last_task[p] = _forward_task(b, context, pack, mb)
                if fused:
                    _backward_task(b, context, pack, mb)
                if not grouping and p < last:
                    _free_weights(b, pack, event)
                elif not grouping and fused:
                    _release_fused(b, context, pack, event)
        for p in group:
            pack, fused, event = packs[p], p == last and signature.fuse_last, last_task[p]
            if grouping and p < last:
                _free_weights(b, pack, event)
            elif grouping and fused:
                _release_fused(b, context, pack, event)
            elif p == last and pack.mutated_buffers:
                _buffers_out(b, pack, event)  # the weights stay for the backward
            if fused:
                _update(b, context, pack)
    # every weight-gradient copy so far (the fused last pack's) lands before the forward returns
    for event in context.dw_events:
        b.wait(event, Stream.HOST)
    # The forward returns once every copy has landed: the caller reads the outputs, and the
    # backward program may then use the stash without waiting on the forward's events. The d2h
    # stream runs in order, so this costs no more than waiting for the outputs.
    for event in b.on_host.values():
        if event is not None:
            b.wait(event, Stream.HOST)
    num_forward = len(b.actions)

    # ---------------------------------------------------------------- backward
    for pack in reversed(packs):
        p = pack.index
        if p == last and signature.fuse_last:
            continue
        if grouping:
            b.prefetch(weights(p))
            b.use([weights(p)])
            if p > 0:
                b.prefetch(weights(p - 1))
        # the last pack's graphs were built on the weights it kept from the forward: keep them
        per_microbatch_weights = not grouping and p < last
        for mb in microbatches:
            if per_microbatch_weights:
                b.prefetch(weights(p))
                b.use([weights(p)])
            _backward_task(b, context, pack, mb)
            if not grouping:
                _weight_grads_out(b, context, pack)
            if per_microbatch_weights:
                b.free(weights(p))
        if grouping:
            _weight_grads_out(b, context, pack)
        if not per_microbatch_weights:
            b.free(weights(p))
        _update(b, context, pack)
    _wait_on_host_for_results(b, signature)
    for event in context.dw_events:  # every copy of weight gradients, not only each key's latest
        b.wait(event, Stream.HOST)
    assert not b.ready, f"lower_program left keys resident: {sorted(map(str, b.ready))}"
    return b.actions[:num_forward], b.actions[num_forward:]


class _Context:
    """Facts about the packs that every task needs."""

    def __init__(self, packs: Sequence[Pack], signature: ProgramSignature) -> None:
        self.packs = packs
        self.signature = signature
        self.last = len(packs) - 1
        self.next_users = {pack.index: set(packs[pack.index + 1].act_inputs) if pack.index < self.last else set()
                           for pack in packs}
        self.grad_owner = _first_backward_touch(packs, signature)
        self.lowest_consumer = _lowest_consumer(packs)
        self.dw_events: list[int] = []


def _forward_task(b: _Builder, context: _Context, pack: Pack, mb: int) -> int:
    p, last = pack.index, context.last
    inputs = [Key(KeyKind.ACT, v, mb) for v in pack.act_inputs]
    for key in inputs:
        b.prefetch(key)
    b.use(inputs)
    outputs = [Key(KeyKind.ACT, v, mb) for v in pack.outputs]
    event = _forward_compute(b, pack, mb, inputs, outputs, last)
    for key in outputs:
        b.offload(key)
    if p < last:
        for key in inputs + outputs:
            if key.name not in context.next_users[p] and b.resident(key):
                b.free(key)
    return event


def _forward_compute(b: _Builder, pack: Pack, mb: int, inputs: list[Key], outputs: list[Key], last: int) -> int:
    """The ``FWD`` action: the last pack keeps its graph (and takes over its inputs)."""
    p = pack.index
    # a forward that updates buffers in place writes W[p]: copies of it wait for the forward
    written = outputs + ([weights(p)] if pack.mutated_buffers else [])
    if p == last:
        return b.compute(K.FWD, p, mb, produces=written + [Key(KeyKind.GRAPH, pack.name, mb)],
                         consumes=inputs, reads=[weights(p)])
    return b.compute(K.FWD, p, mb, produces=written, reads=inputs + [weights(p)])


def _backward_task(b: _Builder, context: _Context, pack: Pack, mb: int) -> None:
    p, signature = pack.index, context.signature
    graph = Key(KeyKind.GRAPH, pack.name, mb)
    if p < context.last:
        inputs = [Key(KeyKind.ACT, v, mb) for v in pack.act_inputs]
        for key in inputs:
            b.prefetch(key)
        b.use(inputs)
        b.compute(K.RECOMPUTE, p, mb, produces=[graph], consumes=inputs, reads=[weights(p)])
    # The caller's gradient of a model output comes in before the first task (in backward order)
    # that touches it: its producer, or a later pack that also reads it and adds to it.
    caller_grads = []
    for v in pack.outputs + pack.act_inputs:
        key = Key(KeyKind.GRAD, v, mb)
        if (v in signature.model_outputs and v in signature.differentiable and context.grad_owner[v] == p
                and not b.resident(key)):
            b.on_host.setdefault(key, None)
            b.prefetch(key)
            caller_grads.append(key)
    output_grads = [Key(KeyKind.GRAD, v, mb) for v in pack.outputs
                    if v in signature.differentiable and b.resident(Key(KeyKind.GRAD, v, mb))]
    b.use(output_grads + caller_grads)
    produced = [Key(KeyKind.GRAD, v, mb) for v in grad_inputs(pack, signature)]
    produced.append(Key(KeyKind.WGRAD, pack.name))  # created by the first microbatch, added to by the others
    consumed = [graph] + output_grads
    if p == context.last:
        consumed += [Key(KeyKind.ACT, v, mb) for v in pack.outputs]
    added_to = [key for key in caller_grads if key not in output_grads]
    b.compute(K.BWD, p, mb, produces=produced, consumes=consumed, reads=[weights(p)] + added_to)
    for key in produced:
        if (key.kind == KeyKind.GRAD and key.name in signature.inputs_requiring_grad
                and context.lowest_consumer[key.name] == p):
            b.offload(key)
            b.free(key)


def _weight_grads_out(b: _Builder, context: _Context, pack: Pack) -> None:
    """dW out once per pack (per microbatch without grouping)."""
    key = Key(KeyKind.WGRAD, pack.name)
    if pack.params:
        b.offload(key)
        context.dw_events.append(b.on_host[key])
    b.free(key)


def _update(b: _Builder, context: _Context, pack: Pack) -> None:
    """Once every microbatch's gradients of ``pack`` are on the host: if it is the last pack to add
    to some parameters' gradients, the host updates them while the device goes on."""
    if pack.index in context.signature.update_packs:
        for event in context.dw_events:
            b.wait(event, Stream.HOST)
        b.emit(K.UPDATE, Stream.HOST, pack=pack.index)


def _buffers_out(b: _Builder, pack: Pack, after: int) -> None:
    b.wait(after, Stream.D2H)  # after the last microbatch's forward updated them
    event = b.emit(K.OFFLOAD, Stream.D2H, key=Key(KeyKind.BUFFERS, pack.name), reads=(weights(pack.index),))
    b.readers.setdefault(weights(pack.index), []).append(event)
    b.on_host[Key(KeyKind.BUFFERS, pack.name)] = event
    b.on_host[weights(pack.index)] = event


def _release_fused(b: _Builder, context: _Context, pack: Pack, last_task: int) -> None:
    if pack.mutated_buffers:
        _buffers_out(b, pack, last_task)
    _weight_grads_out(b, context, pack)
    b.free(weights(pack.index))


def _free_weights(b: _Builder, pack: Pack, last_forward: int) -> None:
    if pack.mutated_buffers:
        _buffers_out(b, pack, last_forward)
    b.free(weights(pack.index))


def forward_groups(signature: ProgramSignature, num_packs: int) -> list[range]:
    """The forward's groups of packs (see ``ProgramSignature.forward_groups``)."""
    starts = list(signature.forward_groups) or list(range(num_packs))
    if starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= num_packs:
        raise ValueError(f"{PASS_NAME}: forward groups {starts} must start at pack 0 and increase within "
                         f"{num_packs} packs")
    return [range(start, end) for start, end in zip(starts, [*starts[1:], num_packs])]


def grad_inputs(pack: Pack, signature: ProgramSignature) -> tuple[str, ...]:
    """The inputs of ``pack`` whose gradient its backward produces."""
    return tuple(v for v in pack.act_inputs if v in signature.differentiable
                 and (v not in signature.model_inputs or v in signature.inputs_requiring_grad))


def _wait_on_host_for_results(b: _Builder, signature: ProgramSignature) -> None:
    """The caller reads outputs, input gradients, weight gradients and buffers once we return."""
    for key, event in b.on_host.items():
        read_by_host = key.kind not in (KeyKind.ACT, KeyKind.WEIGHTS) or key.name in signature.model_outputs
        if event is not None and read_by_host:
            b.wait(event, Stream.HOST)


def _first_backward_touch(packs: Sequence[Pack], signature: ProgramSignature) -> dict[str, int]:
    """For each model output: the first pack in backward order that reads or writes its gradient."""
    touch: dict[str, int] = {}
    for pack in packs:
        for v in pack.outputs + pack.act_inputs:
            if v in signature.model_outputs:
                touch[v] = max(touch.get(v, -1), pack.index)
    return touch


def _lowest_consumer(packs: Sequence[Pack]) -> dict[str, int]:
    lowest: dict[str, int] = {}
    for pack in packs:
        for v in pack.act_inputs:
            lowest.setdefault(v, pack.index)
    return lowest
