"""Lower packs to one device's program: compute, transfers, waits and frees, in issue order.

Forward, pack by pack (input-batch grouping: a pack's weights come in once for all microbatches):

1. ``PREFETCH W[p]`` (issued while the previous pack computes, so two packs' weights can be
   resident at once), ``WAIT`` for it on the compute stream.
2. Per microbatch: ``PREFETCH`` every input activation that is not resident (model inputs, and
   skip values stashed on the host), ``FWD``, then ``OFFLOAD`` every output to the host (the stash
   for backward, or the model's output). A value stays on the device only while the next pack
   still needs it.
3. ``OFFLOAD B[p]`` (buffers updated in place, e.g. BatchNorm statistics) and ``FREE W[p]``.

A forward-only program (``ProgramSignature.forward_only``: a call under ``no_grad``) ends here,
having copied to the host only the model's outputs and the values a pack after the next reads.
Otherwise the last pack runs forward *with* grad and keeps its graph and weights to backward (it would be
recomputed at once otherwise). Backward, packs in reverse order:

4. ``PREFETCH W[p]``; per microbatch ``PREFETCH`` the next task's stashed inputs (one task ahead,
   so the copy overlaps this task), ``RECOMPUTE`` (with the RNG
   state of its forward), ``BWD`` with the gradients of its outputs (kept on the device, summed
   over every consumer), giving the gradients of its inputs and, summed over microbatches, of its
   weights.
5. ``OFFLOAD dW[p]`` once per pack, ``FREE`` weights and gradients; input gradients that the host
   wants (model inputs that require grad) are offloaded after their last consumer.

Every transfer is preceded by a ``WAIT`` for what produced its source and every use by a ``WAIT``
for the transfer; ``FREE`` of a key waits for every copy that reads it.

With forward microbatches larger than the backward's (``ProgramSignature.forward_parts``) the
forward runs every pack but the last on them, the host cuts the stash into the backward's
microbatches once its copies have landed (``SPLIT``), and the last pack's fused forward, loss and
backward open the backward program, one task per backward microbatch.
"""
from __future__ import annotations

from typing import Sequence

from harmony_fx.ir.pack import Pack
from harmony_fx.lowering.tasks import (
    Builder, PackFacts, ProgramSignature, backward_task, buffers_out, check_forward_parts, forward_groups, forward_task,
    split_stash, update, weight_grads_out, weights,
)
from harmony_fx.program.actions import Action, Key, KeyKind, Stream

__all__ = ["lower_program", "PASS_NAME"]

PASS_NAME = "lower_program"


def lower_program(packs: Sequence[Pack], signature: ProgramSignature) -> tuple[list[Action], list[Action]]:
    """Returns the forward program and the backward program; the device state the forward leaves
    (the last pack's weights and graph) is what the backward starts from."""
    facts = PackFacts(packs, signature)
    b = Builder(facts)
    microbatches = signature.microbatches
    last = len(packs) - 1
    # forward-only: the last pack leaves like the others, and there is no backward program
    kept = last if not signature.forward_only else len(packs)
    deferred = signature.last_in_backward  # the fused last pack runs in the backward program
    if deferred:
        check_forward_parts(packs, signature, PASS_NAME)
    for name in signature.model_inputs:
        for mb in microbatches + (signature.forward_microbatches if deferred else ()):
            b.on_host[Key(KeyKind.ACT, name, mb)] = None  # the caller's tensors, already on host
    if signature.fuse_last:
        for name in signature.model_outputs:
            for mb in microbatches:
                b.on_host[Key(KeyKind.GRAD, name, mb)] = None  # known before the iteration (loss weights)
    grouping = signature.grouping

    # ---------------------------------------------------------------- forward
    groups = forward_groups(signature, len(packs), PASS_NAME)
    if grouping and groups:
        for p in groups[0]:
            b.prefetch(weights(p))
    for g, group in enumerate(groups):
        if grouping:
            b.use([weights(p) for p in group])
            # the next group's weights come in while this one computes (after the last group, the
            # last pack's, where it runs first thing in the backward program)
            for p in groups[g + 1] if g + 1 < len(groups) else [last] if deferred else ():
                b.prefetch(weights(p))
        last_task = {}
        for mb in signature.forward_microbatches:
            for p in group:  # a forward group runs its packs back to back on each microbatch
                pack, fused = packs[p], p == last and signature.fuse_last
                if not grouping:
                    b.prefetch(weights(p))
                    b.use([weights(p)])
                event = last_task[p] = forward_task(b, pack, mb)
                if fused:
                    backward_task(b, pack, mb)
                if not grouping and p < kept:
                    _free_weights(b, pack, event)
                elif not grouping and fused:
                    _release_fused(b, pack, event)
        for p in group:
            pack, fused, event = packs[p], p == last and signature.fuse_last, last_task[p]
            if grouping and p < kept:
                _free_weights(b, pack, event)
            elif grouping and fused:
                _release_fused(b, pack, event)
            elif p == last and pack.mutated_buffers:
                buffers_out(b, pack, event)  # the weights stay for the backward
            if fused:
                update(b, pack)
    if deferred and grouping and groups:  # the last pack's weights, fetched during the last group
        b.use([weights(last)])  # (the backward program cannot wait for this program's events)
    # every weight-gradient copy so far (the fused last pack's) lands before the forward returns
    for event in facts.dw_events:
        b.wait(event, Stream.HOST)
    # The forward returns once every copy has landed: the caller reads the outputs, and the
    # backward program may then use the stash without waiting on the forward's events. The d2h
    # stream runs in order, so this costs no more than waiting for the outputs.
    for event in b.on_host.values():
        if event is not None:
            b.wait(event, Stream.HOST)
    if deferred:
        split_stash(b, packs)
    num_forward = len(b.actions)
    if signature.forward_only:
        assert not b.ready, f"lower_program left keys resident: {sorted(map(str, b.ready))}"
        return b.actions, []

    # ---------------------------------------------------------------- backward
    # each task's stashed inputs are prefetched one task ahead: a copy onto the device waits for
    # the compute issued before it (its memory is allocated in compute order), so fetched right
    # before its own recompute it would wait for the previous backward to finish
    fused_in_forward = signature.fuse_last and not deferred
    tasks = [(pack.index, mb) for pack in reversed(packs) if not (pack.index == last and fused_in_forward)
             for mb in microbatches]
    ahead = dict(zip(tasks, tasks[1:])) if grouping and signature.stash_ahead else {}
    for pack in reversed(packs):
        p = pack.index
        if p == last and fused_in_forward:
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
            following = ahead.get((p, mb))
            if following is not None and (following[0] < last or deferred):
                for v in packs[following[0]].act_inputs:
                    b.prefetch(Key(KeyKind.ACT, v, following[1]))
            if p == last and deferred:  # forward, loss and backward on the backward's microbatch
                last_forward = forward_task(b, pack, mb)
            backward_task(b, pack, mb)
            if not grouping:
                weight_grads_out(b, pack)
            if per_microbatch_weights:
                b.free(weights(p))
        if p == last and deferred and pack.mutated_buffers:
            buffers_out(b, pack, last_forward)
        if grouping:
            weight_grads_out(b, pack)
        if not per_microbatch_weights:
            b.free(weights(p))
        update(b, pack)
    _wait_on_host_for_results(b, signature)
    for event in facts.dw_events:  # every copy of weight gradients, not only each key's latest
        b.wait(event, Stream.HOST)
    assert not b.ready, f"lower_program left keys resident: {sorted(map(str, b.ready))}"
    return b.actions[:num_forward], b.actions[num_forward:]


def _release_fused(b: Builder, pack: Pack, last_task: int) -> None:
    if pack.mutated_buffers:
        buffers_out(b, pack, last_task)
    weight_grads_out(b, pack)
    b.free(weights(pack.index))


def _free_weights(b: Builder, pack: Pack, last_forward: int) -> None:
    if pack.mutated_buffers:
        buffers_out(b, pack, last_forward)
    b.free(weights(pack.index))


def _wait_on_host_for_results(b: Builder, signature: ProgramSignature) -> None:
    """The caller reads outputs, input gradients, weight gradients and buffers once we return."""
    for key, event in b.on_host.items():
        read_by_host = key.kind not in (KeyKind.ACT, KeyKind.WEIGHTS) or key.name in signature.model_outputs
        if event is not None and read_by_host:
            b.wait(event, Stream.HOST)
