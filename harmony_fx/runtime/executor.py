"""The executor: the runtime object ``rt`` that generated programs call (the harmony ops).

One ``Runtime`` drives one device through one iteration: ``run(forward_program)`` then, if
gradients are wanted, ``run(backward_program)``. Device values live in ``self.device_values`` under
schedule ``Key``s; host values (stash, outputs, gradients for the caller) in ``self.host_values``.
Work that must happen on the host once a copy has landed (writing BatchNorm statistics back to the
master buffers, summing weight gradients of tied parameters) is attached to the copy's event and
runs at the program's ``HOST`` wait for it.

What is not dispatch lives beside it: the host's state, gradients and events (``runtime.host``),
the bytes and timeline each device records (``runtime.stats``), what devices exchange
(``runtime.links``, which also answers for a device run alone), and the FakeTensor planning run
(``runtime.probe``).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Sequence

import torch
from torch import fx

from harmony_fx.ir.pack import Pack
from harmony_fx.ir import values as pytrees
from harmony_fx.ir.tracking import storage_key
from harmony_fx.runtime import ambient
from harmony_fx.runtime.devices import Device
from harmony_fx.runtime.direct import direct_forward
from harmony_fx.runtime.host import DONE, Event, FutureEvent, GradientBuffers, HostGradients, HostState, grad_dtype
from harmony_fx.runtime.inductor import PackCompiler
from harmony_fx.runtime.links import Links
from harmony_fx.runtime.stats import DeviceRecorder, Stats
from harmony_fx.program.actions import Key, KeyKind, Stream, parse_key

__all__ = ["Runtime"]


class Runtime:
    """``rt`` in the generated programs (implements ``ir.ops.HarmonyOps``); one per iteration."""

    def __init__(self, packs_for_mb: Sequence[Sequence[Pack]], device: Device, host: HostState,
                 grad_inputs: Sequence[tuple[str, ...]], stats: Stats,
                 on_update: Callable[["Runtime", int, Sequence[Event]], None] | None = None,
                 compute_dtype: torch.dtype | None = None, shared: "Runtime | None" = None, index: int = 0,
                 compiler: "PackCompiler | None" = None,
                 split_dims: Callable[[Key, Sequence[int]], Sequence] | None = None,
                 on_tier: Callable[["Runtime", str, int], object] | None = None, keeps_last_graph: bool = True,
                 grad_buffers: GradientBuffers | None = None) -> None:
        """``packs_for_mb[mb]``: the packs compiled at microbatch ``mb``'s size (same boundaries and
        names for every size). ``on_update(runtime, pack)``: the host's optimizer step for the parameters
        whose gradients are complete after ``pack``'s backward. ``shared``: another device's runtime of
        the same iteration, whose host side (inputs, stash, host gradients) this one shares; ``index``:
        this device's number among them (what ``send``/``recv`` name as peers).

        ``split_dims(key, parts)``: how ``SPLIT`` cuts a key (``compiler.shapes.Shapes.split_dims``).
        ``on_tier(runtime, "read" | "write", pack)``: hands a ``READ``/``WRITE`` of a pack's optimizer
        state to the tier's reader and writer and returns what to wait on (a
        ``concurrent.futures.Future``). ``keeps_last_graph``: the last pack's forward keeps its graph
        for the backward (``False``: a forward-only program, with no backward). ``grad_buffers``:
        the host tensors weight gradients land in, the last step's (a Trainer's; ``None``: new ones).

        The autocast state current on the constructing thread is the one every forward and
        recompute of this iteration runs under (``runtime.ambient``)."""
        self.autocast = ambient.Autocast.current()
        self.keeps_last_graph = keeps_last_graph
        self.packs_for_mb = packs_for_mb
        self.packs = packs_for_mb[0]
        self.on_update = on_update
        self.on_tier = on_tier
        self.compute_dtype = compute_dtype
        self.device = device
        self.host = host
        self.grad_inputs = grad_inputs
        self.stats = stats
        self.last = len(self.packs) - 1
        self.device_values: dict[Key, object] = {}
        if shared is None:
            self.host_values: dict[Key, object] = {}
            self.host_grads = HostGradients()  # id(master) -> summed gradient
            self._host_lock = threading.Lock()
            self._stats_lock = threading.Lock()
            self.links = Links()
        else:
            self.host_values, self.host_grads = shared.host_values, shared.host_grads
            self._host_lock, self._stats_lock = shared._host_lock, shared._stats_lock
            self.links = shared.links
        self.index = index  # this device's number in the iteration
        self.record = DeviceRecorder(stats, index, device, host.copy_bytes)
        self.compiler = compiler  # packs compiled by inductor (``compile_packs``), else run as graphs
        self.split_dims = split_dims
        self.grad_buffers = grad_buffers

    # ------------------------------------------------------------------ running programs
    def run(self, program: fx.GraphModule) -> None:
        """Issue every op of ``program``, then wait until the device's streams ran them all (and
        raise the first error any of them hit)."""
        try:
            program(self)
        finally:
            self.device.streams.end_program()

    def release(self) -> None:
        """Drop everything the device still holds (after a forward that needs no backward, or an
        error)."""
        try:
            self.device.streams.synchronize()
        except BaseException:  # noqa: BLE001 - the error that got us here is already on its way up
            pass
        self.device_values.clear()
        self.links.drop_values()  # what a failed iteration sent and no peer picked up

    def key(self, text: str) -> Key:
        return parse_key(text)  # cached: programs name the same keys every iteration

    def _submit(self, stream: Stream, work: Callable[[], None], event: Event | None = None,
                label: str = "", *label_args: object) -> Event:
        """Run ``work`` on ``stream`` (inline, on a stream thread, or issued to the GPU); timed
        when the timeline is recorded (``DeviceRecorder.timed``: ``label.format(*label_args)`` names
        the span)."""
        event = event or Event(None)
        event.device_event = self.device.streams.submit(stream, self.record.timed(stream, work, label, label_args))
        return event

    # ------------------------------------------------------------------ harmony ops
    def prefetch(self, key_text: str, stream: str) -> Event:
        key = self.key(key_text)

        def work() -> None:
            device = self.device
            if key.kind == KeyKind.WEIGHTS:
                pack = self.packs[int(key.name[1:])]
                masters = self.host.masters[pack.index]
                if self.host.resident:  # on the device already: nothing crosses the bus
                    self.device_values[key] = device.resident_weights(masters, pack.written_slots, len(pack.params))
                    return
                with _DeviceContext(device, " while copying the weights of {} ({}) to the device", pack.name,
                                    pack.describe_layers):
                    dtypes = None if self.compute_dtype is None else pack.slot_dtypes
                    value = device.weights_to_device(pack.index, masters, dtypes, pack.written_slots,
                                                     len(pack.params))
            else:
                with _DeviceContext(device, " while copying {} to the device", key_text):
                    value = pytrees.map_tensors(device.to_device, self.host_values[key])
            self.record.count(Stream.H2D, key, value)
            self.device_values[key] = value

        return self._submit(Stream.H2D, work, None, "PREFETCH {}", key_text)

    def offload(self, key_text: str, stream: str) -> Event:
        key = self.key(key_text)
        event = Event(None)

        def work() -> None:
            device = self.device
            if key.kind == KeyKind.BUFFERS:
                pack = self.packs[int(key.name[1:])]
                weights = self.device_values[Key(KeyKind.WEIGHTS, key.name)]
                first_buffer = len(pack.params)
                pairs = [(self.host.masters[pack.index][first_buffer + i], device.to_host(weights[first_buffer + i]))
                         for i, name in enumerate(pack.buffers) if name in pack.mutated_buffers]
                self.record.count(Stream.D2H, key, [copy for _, copy in pairs])
                event.on_host.append(lambda: self._write_buffers(pairs))
            elif key.kind == KeyKind.WGRAD:
                pack = self.packs[int(key.name[1:])]
                grads = self.device_values[key]
                keys = self.host.grad_keys[pack.index]
                if any(g is None for g in grads):  # weights frozen, or unused by this backward
                    keys = [k for k, g in zip(keys, grads) if g is not None]
                    grads = [g for g in grads if g is not None]
                if self.host.resident:  # left on the device, beside the parameters they belong to
                    event.on_host.append(lambda: self.host_grads.add_all(keys, grads, self.index))
                    return
                # the program frees dW right after this copy, and nothing adds to it any more
                into = self.grad_buffers.take_all(keys) if self.grad_buffers is not None else None
                copies = device.grads_to_host(grads, into)
                self.record.count(Stream.D2H, key, copies)
                # already in each master's gradient dtype: the backward summed them in it
                event.on_host.append(lambda: self.host_grads.add_all(keys, copies, self.index))
            else:
                copy = pytrees.map_tensors(device.to_host, self.device_values[key])
                self.record.count(Stream.D2H, key, copy)
                if key.kind == KeyKind.GRAD:
                    # several readers' partial gradients meet on the host (pipeline); the sum is
                    # made when the program waits for this copy
                    event.on_host.append(lambda: self._add_host_value(key, copy))
                else:
                    self.host_values[key] = copy

        return self._submit(Stream.D2H, work, event, "OFFLOAD {}", key_text)

    def send(self, key_text: str, peer: int) -> Event:
        key = self.key(key_text)
        handover = self.links.handover(key, self.index, peer)

        def work() -> None:
            # on the peer stream, after the key was made: the event the receiver's copy waits for
            handover.post(self.device_values[key], self.device.record_event())

        self._submit(Stream.PEER, work, None, "SEND {} -> d{}", key_text, peer)
        return Event(handover)

    def recv(self, key_text: str, peer: int) -> Event:
        key = self.key(key_text)

        def work() -> None:
            value = self.links.receive(key, peer, self.index, self.device)
            self.record.count(Stream.PEER, key, value)
            existing = self.device_values.get(key)
            if existing is None:
                self.device_values[key] = value
            elif value is not None:
                self.device_values[key] = pytrees.add_grads(existing, value, inplace=True)

        return self._submit(Stream.PEER, work, None, "RECV {} <- d{}", key_text, peer)

    def split(self, key_text: str, *microbatches: int) -> Event:
        """The host value of ``key`` (a larger forward microbatch's) as views, one per backward
        microbatch: no copy, no new memory."""
        key = self.key(key_text)
        value = self.host_values[key]
        leaves, cuts = pytrees.leaves(value), self.split_dims(key, microbatches)
        offsets = [0] * len(leaves)
        for index, mb in enumerate(microbatches):
            parts = []
            for i, (leaf, cut) in enumerate(zip(leaves, cuts)):
                if cut is None:  # not batched: every part holds it whole
                    parts.append(leaf)
                    continue
                dim, sizes = cut
                parts.append(leaf.narrow(dim, offsets[i], sizes[index]))
                offsets[i] += sizes[index]
            self.host_values[key._replace(mb=mb)] = pytrees.with_leaves(value, parts)
        return Event(DONE)

    def publish(self, event: Event, number: int) -> None:
        self.links.publish(number, event)

    def remote(self, number: int) -> Event:
        return self.links.remote(number)

    def wait(self, event: Event, stream: str) -> None:
        stream = _STREAMS[stream]
        if isinstance(event.device_event, FutureEvent):  # the tier's work runs on host threads
            event.device_event.synchronize()
            return
        self.device.streams.wait(event.device_event, stream)
        if stream == Stream.HOST:
            event.run_host_work()

    def free(self, key_text: str) -> None:
        key = self.key(key_text)
        self._submit(Stream.COMPUTE, lambda: self._free(key), None, "FREE {}", key_text)

    def _free(self, key: Key) -> None:
        self.device_values.pop(key)
        if key.kind == KeyKind.WGRAD:  # the weights' ``.grad`` autograd summed them in (``_backward``) go too
            for weight in self.device_values.get(Key(KeyKind.WEIGHTS, key.name), ()):
                weight.grad = None

    def update(self, pack_index: int, *copies: Event) -> None:
        """Hand ``pack_index``'s update to the host: ``on_update`` gets the weight-gradient copies to
        wait for (``land``) before it steps; this thread goes on issuing."""
        if self.on_update is not None:
            started = time.perf_counter()
            self.on_update(self, pack_index, copies)
            with self._stats_lock:
                self.stats.handoff_seconds += time.perf_counter() - started

    def read(self, key_text: str) -> Event:
        """Hand the read of a pack's optimizer state from the NVMe tier to the tier's reader."""
        return self._tier("read", key_text)

    def write(self, key_text: str) -> Event:
        """The write of a pack's optimizer state back to the tier (done once the pack's update has
        streamed it all to the tier's writer)."""
        return self._tier("write", key_text)

    def _tier(self, what: str, key_text: str) -> Event:
        if self.on_tier is None:
            raise ValueError(f"the program moves {key_text} to or from the NVMe tier, but this run has no tier: "
                             "programs with READ/WRITE run under harmony_fx.Trainer(nvme_path=...)")
        return Event(FutureEvent(self.on_tier(self, what, int(self.key(key_text).name[1:]))))

    def fwd(self, pack_index: int, mb: int) -> Event:
        return self._compute("FWD", pack_index, mb, self._forward)

    def recompute(self, pack_index: int, mb: int) -> Event:
        return self._compute("RECOMPUTE", pack_index, mb, self._recompute)

    def bwd(self, pack_index: int, mb: int) -> Event:
        return self._compute("BWD", pack_index, mb, self._backward)

    def _compute(self, kind: str, pack_index: int, mb: int, task: Callable[[int, int], None]) -> Event:
        """``task(pack_index, mb)`` on the compute stream, named ``kind`` in the timeline."""
        return self._submit(Stream.COMPUTE, lambda: task(pack_index, mb), None, "{} p{}@{}", kind, pack_index, mb)

    # ------------------------------------------------------------------ compute (on the compute stream)
    def _forward(self, pack_index: int, mb: int) -> None:
        pack = self.packs_for_mb[mb][pack_index]
        keep_graph = pack_index == self.last and self.keeps_last_graph
        values = self.device_values
        inputs = [values.pop(Key(KeyKind.ACT, v, mb)) if keep_graph else values[Key(KeyKind.ACT, v, mb)]
                  for v in pack.act_inputs]
        if keep_graph:
            inputs = [_leaf(x, flags) for x, flags in zip(inputs, pack.input_requires_grad)]
        if pack.replayed_slots and not keep_graph:
            # what the forward reads of the buffers it then updates, on the host: the recompute reads it
            weights = values[Key(KeyKind.WEIGHTS, pack.name)]
            self.links.save_buffers(pack_index, mb, [weights[slot].detach().to("cpu", copy=True)
                                                     for slot in pack.replayed_slots])
        with self.device.rng_lock() if pack.random else contextlib.nullcontext():
            if pack.random:
                self.links.save_rng_state(pack_index, mb, self.device.get_rng_state())
            outputs = self._run_pack(pack, inputs, grad=keep_graph, what="forward")
        for name, value in zip(pack.outputs, outputs):
            values[Key(KeyKind.ACT, name, mb)] = pytrees.map_tensors(torch.Tensor.detach, value)
        if keep_graph:
            values[Key(KeyKind.GRAPH, pack.name, mb)] = (inputs, outputs)

    def _recompute(self, pack_index: int, mb: int) -> None:
        pack = self.packs_for_mb[mb][pack_index]
        inputs = [_leaf(self.device_values.pop(Key(KeyKind.ACT, v, mb)), flags)
                  for v, flags in zip(pack.act_inputs, pack.input_requires_grad)]
        buffers = self._forwards_buffers(pack, pack_index, mb)
        if not pack.random:
            outputs = self._run_pack(pack, inputs, grad=True, what="recompute", buffers=buffers)
        else:
            with self.device.rng_lock():
                saved_state = self.device.get_rng_state()
                replayed = self.links.rng_state(pack_index, mb)  # None: the forward ran on a device not run here
                if replayed is not None:
                    self.device.set_rng_state(replayed)
                try:
                    outputs = self._run_pack(pack, inputs, grad=True, what="recompute", buffers=buffers)
                finally:
                    self.device.set_rng_state(saved_state)
        self.device_values[Key(KeyKind.GRAPH, pack.name, mb)] = (inputs, outputs)

    def _backward(self, pack_index: int, mb: int) -> None:
        pack = self.packs[pack_index]
        values = self.device_values
        inputs, outputs = values.pop(Key(KeyKind.GRAPH, pack.name, mb))
        if pack_index == self.last:
            for name in pack.outputs:
                values.pop(Key(KeyKind.ACT, name, mb))
        roots, root_grads = _roots(outputs, [values.pop(Key(KeyKind.GRAD, name, mb), None) for name in pack.outputs])
        del outputs
        weights = values[Key(KeyKind.WEIGHTS, pack.name)]
        wanted = set(self.grad_inputs[pack_index])
        input_targets = [(name, x) for name, x in zip(pack.act_inputs, inputs) if name in wanted]
        weight_targets = weights[: len(pack.params)]
        targets = [leaf for _, x in input_targets for leaf in _differentiable(x)]
        targets += [w for w in weight_targets if w.requires_grad]
        # In the compute dtype the masters' gradients keep, autograd sums each weight's gradient into
        # its device copy's ``.grad`` itself (AccumulateGrad, in C++: it takes autograd's tensor where
        # nothing else holds it, else a copy, and adds later microbatches in place), as eager does
        # for parameters; ``dW`` is then those ``.grad``. Under another compute dtype (bf16) each
        # microbatch's gradient is captured and summed in the master's dtype here.
        summed_by_autograd = self.compute_dtype is None
        wgrad_key = Key(KeyKind.WGRAD, pack.name)
        accumulated = values.get(wgrad_key)
        if summed_by_autograd and accumulated is not None:
            for weight, grad in zip(weight_targets, accumulated):
                if weight.grad is not grad:  # the weights were fetched again since the last microbatch
                    weight.grad = grad
        with self.device.compute_scope(), self._context(pack, "backward"), ambient.scope(ambient.OFF):
            with self.compiler.backward_scope() if self.compiler is not None else contextlib.nullcontext():
                if summed_by_autograd:
                    if roots and targets:
                        torch.autograd.backward(roots, root_grads)
                    for target in targets:
                        if target.grad is not None and target.grad._is_zerotensor():
                            target.grad = _materialized(target.grad)
                    grads = iter([target.grad for target in targets])
                else:
                    grads = iter(torch.autograd.grad(roots, targets, root_grads, allow_unused=True)
                                 if roots and targets else [None] * len(targets))
            del roots, root_grads, inputs
            # AccumulateGrad takes autograd's tensor as a weight's first ``.grad`` where no other
            # tensor object holds it, and so it takes a view of that buffer handed to an input
            # (``table[None] + emb.reshape(1, 6, -1)`` on a one-sample microbatch gives the weight
            # and ``emb`` views of one gradient): the next microbatch's ``+=`` into the weight's
            # ``.grad`` would then write into the input's gradient, so such an input's is copied
            stored: set[int] = ({storage_key(w.grad) for w in weight_targets if w.grad is not None}
                                if summed_by_autograd else set())
            for name, x in input_targets:
                leaf_grads = []
                for leaf in pytrees.leaves(x):
                    if not (isinstance(leaf, torch.Tensor) and leaf.requires_grad):
                        leaf_grads.append(None)
                        continue
                    grad = next(grads)
                    if grad is None:  # no root reaches it: eager's autograd has no gradient there either
                        leaf_grads.append(None)
                        continue
                    grad = _materialized(grad)
                    if storage_key(grad) in stored:
                        # autograd hands one tensor to several inputs (e.g. both sides of an add);
                        # each key must own its gradient, since each is added to in place later
                        grad = grad.clone()
                    stored.add(storage_key(grad))
                    leaf_grads.append(grad)
                self._accumulate(Key(KeyKind.GRAD, name, mb), pytrees.with_leaves(x, leaf_grads))
            if summed_by_autograd:  # the sums so far
                values[wgrad_key] = [next(grads) if weight.requires_grad else None for weight in weight_targets]
            else:
                masters = self.host.masters[pack_index]
                accumulated = values.setdefault(wgrad_key, [None] * len(weight_targets))
                for i, weight in enumerate(weight_targets):
                    grad = next(grads) if weight.requires_grad else None
                    if grad is None:
                        continue
                    grad = _materialized(grad)
                    # summed over microbatches in the master's gradient dtype (fp32 under bf16 compute):
                    # each microbatch's gradient is rounded once, not the running sum at every step
                    if accumulated[i] is not None:
                        accumulated[i].add_(grad)
                    elif grad.dtype != grad_dtype(masters[i]):
                        accumulated[i] = grad.to(grad_dtype(masters[i]))
                    else:
                        accumulated[i] = _own(grad, stored)
            del grads
            self.device.check_budget()

    # ------------------------------------------------------------------ helpers
    def _forwards_buffers(self, pack: Pack, pack_index: int, mb: int) -> dict[int, torch.Tensor]:
        """Per replayed slot, the buffer as the forward of ``mb`` read it (saved then), else (the
        forward ran on a device not run here: a planning run) as the device holds it now."""
        if not pack.replayed_slots:
            return {}
        saved = self.links.saved_buffers(pack_index, mb)
        if saved is None:
            weights = self.device_values[Key(KeyKind.WEIGHTS, pack.name)]
            saved = [weights[slot] for slot in pack.replayed_slots]
        return dict(zip(pack.replayed_slots, saved))

    def _run_pack(self, pack: Pack, inputs: list, grad: bool, what: str,
                  buffers: dict[int, torch.Tensor] | None = None) -> tuple:
        """``buffers``: slots read from these (host or device) tensors, each copied onto the device
        as the task's own (its in-place updates go nowhere), in place of the device's copies."""
        weights = self.device_values[Key(KeyKind.WEIGHTS, pack.name)]
        state = [weights[slot] for slot in pack.state_slot]
        # views replayed as the plan's FakeTensor run replays them: on real tensors an in-place op on
        # a view torch made inside an op (ReLU(inplace) after a Linear over [B, T, F]) would go through
        # as_strided, whose backward holds one more tensor of the base's size than was planned
        with (self.device.compute_scope(), self._context(pack, what), torch.set_grad_enabled(grad),
              ambient.scope(self.autocast), torch.autograd._force_original_view_tracking(True)):
            if buffers:
                copies = {slot: value.to(weights[slot].device, copy=True) for slot, value in buffers.items()}
                state = [copies.get(slot, value) for slot, value in zip(pack.state_slot, state)]
            if self.compiler is None:
                outputs = direct_forward(pack.gm)(pack.gm, *inputs, *state)
            else:
                outputs = self.compiler.run(pack, [*inputs, *state], grad)
            self.device.check_budget()
            return outputs

    def _context(self, pack: Pack, what: str):
        return _DeviceContext(self.device, " in the {} of {} ({})", what, pack.name, pack.describe_layers)

    def _accumulate(self, key: Key, grad: object) -> None:
        existing = self.device_values.get(key)
        if existing is None:
            self.device_values[key] = pytrees.map_tensors(_own, grad)
        elif grad is not None:
            self.device_values[key] = pytrees.add_grads(existing, grad, inplace=True)

    def _write_buffers(self, pairs) -> None:
        with self._host_lock:  # several devices may write the same master
            for master, copy in pairs:
                if master.shape != copy.shape:  # resized in place by the forward, as eager resizes it (a
                    master.resize_(copy.shape)  # QAT observer's min/max, empty until its first call)
                master.copy_(copy)

    def _add_host_value(self, key: Key, value: torch.Tensor) -> None:
        with self._host_lock:
            existing = self.host_values.get(key)
            if existing is None:
                self.host_values[key] = value
            elif value is not None:
                self.host_values[key] = pytrees.add_grads(existing, value, inplace=False)


_STREAMS = {stream.value: stream for stream in Stream}  # what ``Stream(name)`` finds, without Enum's lookup


class _DeviceContext:
    """Names the running task in an out-of-memory error: ``text.format(*args)``, a callable among
    ``args`` called, formatted only when an error is raised (a task runs hundreds of times a step)."""

    __slots__ = ("device", "text", "args")

    def __init__(self, device: Device, text: str, *args: object) -> None:
        self.device, self.text, self.args = device, text, args

    def __str__(self) -> str:
        return self.text.format(*[arg() if callable(arg) else arg for arg in self.args])

    def __enter__(self):
        self.device.context = self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if isinstance(error, torch.OutOfMemoryError):
                raise self.device.out_of_memory(error) from error  # named: the task, the plan, the budget
        finally:
            self.device.context = ""


def _leaf(value: object, requires_grad: Sequence[bool]) -> object:
    """A pack input in a graph we keep, detached without a copy: each tensor leaf records gradients
    where it required grad in the model (``requires_grad``, one flag per leaf), as in eager."""
    fresh = [leaf.detach().requires_grad_(flag) if isinstance(leaf, torch.Tensor) else leaf
             for leaf, flag in zip(pytrees.leaves(value), requires_grad, strict=True)]
    return pytrees.with_leaves(value, fresh)


def _roots(outputs: Sequence[object], grads: Sequence[object]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors to differentiate and their gradients: each output leaf that records gradients
    and has one. (A function of its own so that no loop variable keeps a gradient alive.)"""
    roots, root_grads = [], []
    for output, grad in zip(outputs, grads):
        if grad is None:
            continue
        for leaf, leaf_grad in zip(pytrees.leaves(output), pytrees.leaves(grad), strict=True):
            if leaf_grad is not None and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                roots.append(leaf)
                root_grads.append(leaf_grad)
    return roots, root_grads


def _materialized(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with memory where autograd gave its storage-less zero (a ZeroTensor: ``sgn``'s
    gradient of a real tensor): kept as a weight's ``.grad`` (AccumulateGrad takes it as the first
    microbatch's) or handed to the pack before as its output's gradient (which makes its weights'
    alike), the next microbatch's ``+=`` could not write it. Planning counted it whole."""
    return torch.zeros_like(grad) if grad._is_zerotensor() else grad


def _differentiable(value: object) -> list[torch.Tensor]:
    return [leaf for leaf in pytrees.tensors(value) if leaf.requires_grad]


def _own(grad: torch.Tensor, handed: set | None = None) -> torch.Tensor:
    """A gradient we may add into in place: not an expanded or otherwise shared view. ``handed``:
    the storages of the gradients one backward already handed out; a contiguous view of a whole
    buffer no other of them shares (a weight's gradient as ``t()`` of a matmul's, a bias's as the
    view of a sum) is then owned as it is, without the copy."""
    if grad.is_contiguous():
        if grad._base is None and handed is None:
            return grad
        if handed is not None and (grad._base is None or grad._base.numel() == grad.numel()):
            key = storage_key(grad)
            if key not in handed:
                handed.add(key)
                return grad
    return grad.clone(memory_format=torch.contiguous_format)
