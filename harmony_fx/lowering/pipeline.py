"""Lower packs to a wrap-around pipeline over several devices (Harmony-PP): one program per device.

1. Forward task of pack *p* runs on device ``p mod N``; backward tasks continue the wrap: pack *p*'s
   backward runs on device ``(2(P-1) - p) mod N``, so the last pack's backward stays where its
   forward kept its graph and weights, and consecutive tasks sit on neighbouring devices.
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
   whole pack, so that no two devices wait for each other's pick-up.

Each device's program lists its tasks in one global order (packs, then microbatches; forward then
backward), and every task depends only on tasks before it in that order, so the devices cannot
wait on each other in a cycle; ``validate.verify_devices`` checks it by running them together.
"""
from __future__ import annotations

from typing import Sequence

from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.single import (
    ProgramSignature, _buffers_out, _Builder, _Context, _forward_compute, _Shared, _update, _weight_grads_out,
    grad_inputs, weights,
)
from harmony_fx.program.actions import Action, ActionKind as K, Key, KeyKind, Stream

__all__ = ["lower_pipeline", "forward_device", "backward_device"]

PASS_NAME = "lower_pipeline"


def forward_device(pack: int, num_devices: int) -> int:
    return pack % num_devices


def backward_device(pack: int, num_packs: int, num_devices: int) -> int:
    return (2 * (num_packs - 1) - pack) % num_devices


class _PipeBuilder(_Builder):
    pass_name = PASS_NAME

    def __init__(self, device: int, shared: _Shared) -> None:
        super().__init__(device, shared)
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

    def recv(self, key: Key, peer: int) -> None:
        event = self.emit(K.RECV, Stream.PEER, key=key, peer=peer)
        self.ready[key] = event
        self.copy_events.add(event)

    def prefetch_all_writers(self, key: Key, writers: Sequence[int]) -> None:
        """A host value several devices added to (partial gradients, summed on the host): wait on
        the host for every copy, then fetch the sum."""
        for event in writers:
            self.wait(event, Stream.HOST)
        self.prefetch(key)


def lower_pipeline(packs: Sequence[Pack], signature: ProgramSignature,
                   num_devices: int) -> list[tuple[list[Action], list[Action]]]:
    """(forward program, backward program) per device."""
    shared = _Shared()
    builders = [_PipeBuilder(d, shared) for d in range(num_devices)]
    num_packs, last = len(packs), len(packs) - 1
    context = _Context(packs, signature)
    producer = {v: pack.index for pack in packs for v in pack.outputs}
    readers = {}
    for pack in packs:
        for v in pack.act_inputs:
            readers.setdefault(v, []).append(pack.index)
    host_writers: dict[Key, list[int]] = {}  # host gradient key -> events of the partial copies
    forward_events: dict[tuple[int, int], int] = {}
    for name in signature.model_inputs:
        for mb in signature.microbatches:
            shared.on_host[Key(KeyKind.ACT, name, mb)] = None
    for name in signature.model_outputs:
        for mb in signature.microbatches:
            host_writers[Key(KeyKind.GRAD, name, mb)] = []  # the caller's (or the loss weights)

    def fdev(p: int) -> int:
        return forward_device(p, num_devices)

    def bdev(p: int) -> int:
        return backward_device(p, num_packs, num_devices)

    def sent_forward(v: str, p: int) -> bool:
        """``v`` (made by ``p - 1``) reaches pack ``p`` device to device."""
        return producer.get(v) == p - 1 and fdev(p - 1) != fdev(p)

    def grad_p2p(v: str) -> bool:
        """The gradient of ``v`` goes device to device: its only reader is the next pack."""
        q = producer.get(v)
        return (q is not None and readers.get(v) == [q + 1] and v not in signature.model_outputs
                and bdev(q) != bdev(q + 1))

    def forward_task(b: _PipeBuilder, pack: Pack, mb: int) -> int:
        p = pack.index
        inputs = [Key(KeyKind.ACT, v, mb) for v in pack.act_inputs]
        for key in inputs:
            if sent_forward(key.name, p):
                b.recv(key, fdev(p - 1))
            else:
                b.prefetch(key)
        b.use(inputs)
        outputs = [Key(KeyKind.ACT, v, mb) for v in pack.outputs]
        event = forward_events[(p, mb)] = _forward_compute(b, pack, mb, inputs, outputs, last)
        for key in outputs:
            b.offload(key)
            if p < last and key.name in packs[p + 1].act_inputs and fdev(p + 1) != fdev(p):
                b.send(key, fdev(p + 1))
                b.sent.append(key)
        if p < last:
            for key in inputs + outputs:
                if b.resident(key) and key not in b.sent:
                    b.free(key)
        return event

    def backward_task(b: _PipeBuilder, pack: Pack, mb: int) -> None:
        p = pack.index
        graph = Key(KeyKind.GRAPH, pack.name, mb)
        if p < last:
            inputs = [Key(KeyKind.ACT, v, mb) for v in pack.act_inputs]
            for key in inputs:
                b.prefetch(key)
            b.use(inputs)
            if pack.random and fdev(p) != b.device:
                # the recompute replays the RNG state the forward saved on another device (on this
                # device the forward program has ended, and with it its work)
                b.wait(forward_events[(p, mb)], Stream.COMPUTE)
            b.compute(K.RECOMPUTE, p, mb, produces=[graph], consumes=inputs, reads=[weights(p)])
        output_grads = []
        for v in pack.outputs:
            if v not in signature.differentiable:
                continue
            key = Key(KeyKind.GRAD, v, mb)
            if grad_p2p(v):
                b.recv(key, bdev(p + 1))
                output_grads.append(key)
            elif key in host_writers:
                b.on_host.setdefault(key, None)
                b.prefetch_all_writers(key, host_writers[key])
                output_grads.append(key)
        b.use(output_grads)
        produced = [Key(KeyKind.GRAD, v, mb) for v in grad_inputs(pack, signature)]
        consumed = [graph] + output_grads
        if p == last:
            consumed += [Key(KeyKind.ACT, v, mb) for v in pack.outputs]
        b.compute(K.BWD, p, mb, produces=produced + [Key(KeyKind.WGRAD, pack.name)], consumes=consumed,
                  reads=[weights(p)])
        for key in produced:
            if grad_p2p(key.name):
                b.send(key, bdev(p - 1))
                b.sent.append(key)
            else:
                b.offload(key)  # the host sums the partial gradients of every reader
                host_writers.setdefault(key, []).append(shared.on_host[key])
                b.free(key)

    def release(b: _PipeBuilder, pack: Pack, last_event: int, fused: bool) -> None:
        if pack.mutated_buffers:
            _buffers_out(b, pack, last_event)
        if fused or pack.index < last:
            if fused:
                _weight_grads_out(b, context, pack)
            b.free(weights(pack.index))

    # ---------------------------------------------------------------- forward
    for pack in packs:
        p = pack.index
        b = builders[fdev(p)]
        fused = p == last and signature.fuse_last
        b.prefetch(weights(p))
        b.use([weights(p)])
        for mb in signature.microbatches:
            event = forward_task(b, pack, mb)
            if fused:
                backward_task(b, pack, mb)
        b.free_sent()
        release(b, pack, event, fused)
        if fused:
            _update(b, context, pack)
    num_forward = []
    for b in builders:
        _wait_for_own_copies(b)
        num_forward.append(len(b.actions))

    # ---------------------------------------------------------------- backward
    for pack in reversed(packs):
        p = pack.index
        if p == last and signature.fuse_last:
            continue
        b = builders[bdev(p)]
        b.prefetch(weights(p))
        b.use([weights(p)])
        for mb in signature.microbatches:
            backward_task(b, pack, mb)
        b.free_sent()
        _weight_grads_out(b, context, pack)
        b.free(weights(p))
        _update(b, context, pack)
    for b in builders:
        _wait_for_own_copies(b)
        assert not b.ready, f"{PASS_NAME} left keys resident on d{b.device}: {sorted(map(str, b.ready))}"
    return [(b.actions[:n], b.actions[n:]) for b, n in zip(builders, num_forward)]


def _wait_for_own_copies(b: _Builder) -> None:
    """A program ends once every device-to-host copy it issued has landed."""
    for action in b.actions:
        if action.kind == K.OFFLOAD:
            b.wait(action.event, Stream.HOST)

