"""Lower packs to a wrap-around pipeline over several devices (Harmony-PP): one program per device.

1. The forward's *u*-th task (a pack, or a group of packs) runs on device ``u mod N``; backward
   tasks continue the wrap from the last pack (``lowering.placement``), so the last pack's backward
   stays where its forward kept its graph and weights, and consecutive tasks sit on neighbouring
   devices.
2. A pack's output that the next pack reads goes device to device per microbatch (``SEND``/
   ``RECV`` on the peer stream), so the next device starts microbatch 0 while this one computes
   microbatch 1. Every pack input is also stashed on the host, because its backward recompute runs
   on another device. Values that skip packs come from the host stash.
3. Backward, the gradient of a value whose only reader is the next pack goes device to device the
   same way; every other activation gradient (skip connections, model inputs) goes to the host,
   where the partial gradients of all its readers are summed, and comes back to the device that
   runs its producer's backward.
4. A copy of a host value that another device wrote waits for that device's copy (``WAIT e from
   dN``); a device frees what it sent once the peer has it (the ``SEND``'s event), after the
   whole pack, so that no two devices wait for each other's pick-up. With ``handoff="host"`` no
   value goes device to device: the next device reads the stash (and the host sums every
   gradient), and each microbatch's values are freed as soon as their copy to the host landed.

Each device's program lists its tasks in one global order (packs, then microbatches; forward then
backward), and every task depends only on tasks before it in that order, so the devices cannot
wait on each other in a cycle; ``program.verify.verify_devices`` checks it by running them together.
"""
from __future__ import annotations

from typing import Sequence

from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.placement import backward_device, forward_device, forward_tasks
from harmony_fx.lowering.tasks import (
    Builder, EventCounter, PackFacts, ProgramSignature, backward_task, buffers_out, check_forward_parts,
    forward_groups, forward_task, split_stash, update, weight_grads_out, weights,
)
from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind, Stream

__all__ = ["lower_pipeline"]

PASS_NAME = "lower_pipeline"


class _Wrap:
    """The pipeline's shape, shared by every device's builder: where each pack's tasks run, which
    values and gradients go device to device, and who wrote each host gradient."""

    def __init__(self, packs: Sequence[Pack], signature: ProgramSignature, num_devices: int) -> None:
        self.packs, self.signature, self.num_devices = packs, signature, num_devices
        # the forward's tasks: its groups of packs, then the last pack where it runs in the backward
        forward_groups(signature, len(packs), PASS_NAME)  # refuses groups that are not a partition
        self.units = forward_tasks(signature.forward_groups, len(packs), signature.last_in_backward)
        self.unit_of = {p: u for u, unit in enumerate(self.units) for p in unit}
        self.producer = {v: pack.index for pack in packs for v in pack.outputs}
        self.readers: dict[str, list[int]] = {}
        for pack in packs:
            for v in pack.act_inputs:
                self.readers.setdefault(v, []).append(pack.index)
        self.host_writers: dict[Key, list[int]] = {}  # host gradient key -> events of the partial copies
        self.forward_events: dict[tuple[int, int], int] = {}

    def fdev(self, p: int) -> int:
        return forward_device(self.unit_of[p], self.num_devices)

    def bdev(self, p: int) -> int:
        last = len(self.packs) - 1
        return backward_device(p, len(self.packs), self.num_devices, self.unit_of[last])

    def sent_forward(self, v: str, p: int) -> bool:
        """``v`` (made by ``p - 1``) reaches pack ``p`` device to device (the last pack, where it
        runs in the backward, reads the host's stash)."""
        deferred = self.signature.last_in_backward and p == len(self.packs) - 1
        return (self.signature.handoff == "peer" and self.producer.get(v) == p - 1 and self.fdev(p - 1) != self.fdev(p)
                and not deferred)

    def grad_p2p(self, v: str) -> bool:
        """The gradient of ``v`` goes device to device: its only reader is the next pack."""
        q = self.producer.get(v)
        return (self.signature.handoff == "peer" and q is not None and self.readers.get(v) == [q + 1]
                and v not in self.signature.model_outputs and self.bdev(q) != self.bdev(q + 1))


class _PipeBuilder(Builder):
    pass_name = PASS_NAME

    def __init__(self, facts: PackFacts, device: int, shared: EventCounter, wrap: _Wrap) -> None:
        super().__init__(facts, device, shared)
        self.wrap = wrap
        self.sent: list[Key] = []  # keys handed to a peer and not yet freed

    def free_sent(self) -> None:
        """Free what this pack sent, once the peer has it. Waiting here, after every microbatch of
        the pack, and not after each send, is what keeps the devices out of a cycle: the peer takes
        them in its next pack's tasks, which wait for nothing this device does later."""
        for key in self.sent:
            self.free(key)
        self.sent.clear()

    def send(self, key: Key, peer: int) -> None:
        self.wait(self.ready[key], Stream.PEER)
        event = self.emit(K.SEND, Stream.PEER, key=key, peer=peer, reads=(key,))
        self.readers.setdefault(key, []).append(event)
        self.sent.append(key)

    def recv(self, key: Key, peer: int) -> None:
        event = self.emit(K.RECV, Stream.PEER, key=key, peer=peer)
        self.ready[key] = event
        self.copy_events.add(event)

    # ------------------------------------------------------------------ where values come and go
    def fetch_input(self, key: Key, pack: int) -> None:
        if self.wrap.sent_forward(key.name, pack):
            self.recv(key, self.wrap.fdev(pack - 1))
        else:
            self.prefetch(key)

    def route_output(self, key: Key, pack: int) -> None:
        wrap = self.wrap
        if pack < self.facts.last and key.name in wrap.packs[pack + 1].act_inputs and wrap.sent_forward(key.name, pack + 1):
            self.send(key, wrap.fdev(pack + 1))

    def to_host(self, key: Key, pack: int) -> bool:
        return True  # a forward-only pipeline still stashes: the next device may read it from the host

    def keeps(self, key: Key, pack: int) -> bool:
        # what a peer takes, and what the next pack of the same forward group reads here; every
        # other input is stashed for the recompute on another device
        return key in self.sent or (key.name in self.facts.next_users[pack]
                                    and self.wrap.fdev(pack + 1) == self.wrap.fdev(pack))

    def before_recompute(self, pack: Pack, mb: int) -> None:
        if pack.random and self.wrap.fdev(pack.index) != self.device:
            # the recompute replays the RNG state the forward saved on another device (on this
            # device the forward program has ended, and with it its work)
            self.wait(self.wrap.forward_events[(pack.index, mb)], Stream.COMPUTE)

    def output_grads(self, pack: Pack, mb: int) -> tuple[list[Key], list[Key]]:
        wrap, grads = self.wrap, []
        for v in pack.outputs:
            if v not in self.facts.signature.differentiable:
                continue
            key = Key(KeyKind.GRAD, v, mb)
            if wrap.grad_p2p(v):
                self.recv(key, wrap.bdev(pack.index + 1))
                grads.append(key)
            elif key in wrap.host_writers:
                # a host value several devices added to (partial gradients, summed on the host):
                # wait on the host for every copy, then fetch the sum
                self.on_host.setdefault(key, None)
                for event in wrap.host_writers[key]:
                    self.wait(event, Stream.HOST)
                self.prefetch(key)
                grads.append(key)
        self.use(grads)
        return grads, []

    def route_input_grad(self, key: Key, pack: int) -> None:
        if self.wrap.grad_p2p(key.name):
            self.send(key, self.wrap.bdev(pack - 1))
        else:
            self.offload(key)  # the host sums the partial gradients of every reader
            self.wrap.host_writers.setdefault(key, []).append(self.on_host[key])
            self.free(key)


def lower_pipeline(packs: Sequence[Pack], signature: ProgramSignature,
                   num_devices: int) -> list[tuple[list[Action], list[Action]]]:
    """(forward program, backward program) per device."""
    shared, facts, wrap = EventCounter(), PackFacts(packs, signature), _Wrap(packs, signature, num_devices)
    builders = [_PipeBuilder(facts, d, shared, wrap) for d in range(num_devices)]
    last = len(packs) - 1
    deferred = signature.last_in_backward  # the fused last pack runs in the backward program
    if deferred:
        check_forward_parts(packs, signature, PASS_NAME)
    for name in signature.model_inputs:
        for mb in dict.fromkeys(signature.microbatches + signature.forward_microbatches):
            shared.on_host[Key(KeyKind.ACT, name, mb)] = None
    for name in signature.model_outputs:
        for mb in signature.microbatches:
            wrap.host_writers[Key(KeyKind.GRAD, name, mb)] = []  # the caller's (or the loss weights)
    fused_in_forward = signature.fuse_last and not deferred

    # ---------------------------------------------------------------- forward
    for unit in wrap.units[:-1] if deferred else wrap.units:
        b = builders[wrap.fdev(unit.start)]
        for p in unit:  # a forward group's weights come in together
            b.prefetch(weights(p))
        b.use([weights(p) for p in unit])
        for mb in signature.forward_microbatches:
            for p in unit:  # and its packs run back to back on each microbatch
                wrap.forward_events[(p, mb)] = forward_task(b, packs[p], mb)
                if p == last and fused_in_forward:
                    backward_task(b, packs[p], mb)
        b.free_sent()
        for p in unit:
            pack, fused = packs[p], p == last and fused_in_forward
            if pack.mutated_buffers:
                buffers_out(b, pack, wrap.forward_events[(p, signature.forward_microbatches[-1])])
            if fused:
                weight_grads_out(b, pack)
            if fused or p < last or signature.forward_only:
                b.free(weights(p))
            if fused:
                update(b, pack)
    num_forward = []
    for b in builders:
        _wait_for_own_copies(b)
        if deferred:
            split_stash(b, packs)
        num_forward.append(len(b.actions))
    if signature.forward_only:  # no backward program (a call under no_grad)
        for b in builders:
            assert not b.ready, f"{PASS_NAME} left keys resident on d{b.device}: {sorted(map(str, b.ready))}"
        return [(b.actions, []) for b in builders]

    # ---------------------------------------------------------------- backward
    for pack in reversed(packs):
        p = pack.index
        if p == last and fused_in_forward:
            continue
        b = builders[wrap.bdev(p)]
        b.prefetch(weights(p))
        b.use([weights(p)])
        for mb in signature.microbatches:
            if p == last and deferred:  # forward, loss and backward on the backward's microbatch
                last_forward = forward_task(b, pack, mb)
            backward_task(b, pack, mb)
        b.free_sent()
        if p == last and deferred and pack.mutated_buffers:
            buffers_out(b, pack, last_forward)
        weight_grads_out(b, pack)
        b.free(weights(p))
        update(b, pack)
    for b in builders:
        _wait_for_own_copies(b)
        assert not b.ready, f"{PASS_NAME} left keys resident on d{b.device}: {sorted(map(str, b.ready))}"
    return [(b.actions[:n], b.actions[n:]) for b, n in zip(builders, num_forward)]


def _wait_for_own_copies(b: Builder) -> None:
    """A program ends once every device-to-host copy it issued has landed."""
    for action in b.actions:
        if action.kind == K.OFFLOAD:
            b.wait(action.event, Stream.HOST)
