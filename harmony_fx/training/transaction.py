"""A step is all or nothing.

The per-pack updates overlap the backward, so some packs are updated while later tasks of the
same iteration may still fail (an error in a task, a device out of memory, Ctrl-C, a non-finite
loss found at the end). Before it updates a pack, the update worker copies that pack's parameters
and their optimizer state (``Undo.save``: host to host, on the worker, so the copy overlaps the
device's backward as the update does); if the step fails, every pack updated so far is put back
from its copy, newest first, along with the buffers the forward wrote back (BatchNorm statistics).
Deferring the updates to the end instead would keep no copies but would give up the overlap, the
point of per-pack updates. The price is host memory: until the step ends, the copies of the packs
updated so far (at most one more copy of the parameters and optimizer state).

Gradients are not put back: an undone step leaves every ``.grad`` of the parameters it trains
``None`` (as ``optimizer.zero_grad(set_to_none=True)`` would). They are derived values, and
keeping the last step's would cost a second set of them: each step's gradients land in the host
tensors that held the last step's (``runtime.host.GradientBuffers``), so by the time a step fails
some of those hold parts of the failed step's. The same reuse means that a tensor read from
``param.grad`` after a step is written into by the next step (clone it to keep it), as with
PyTorch's optimizers under ``zero_grad(set_to_none=False)``.

The NVMe tier's files follow the same rule: a step's files count only once the step succeeded and
they are all on the drive, so an undone step needs no copy of that state. A step returns before
its last writes end (they overlap the next step's forward): until they do, the step's copies are
kept (``PendingStep``), and a write that fails then undoes that step too.

Across processes the ranks agree on each step's outcome: a step failed on one rank is undone on
every rank, and the failed rank still takes its part in the collectives its peers wait for.
"""
from __future__ import annotations

import copy
import time
from typing import Sequence

import torch
from torch import nn

from harmony_fx.distributed.cluster import Cluster, PeerError, StepFailedElsewhere
from harmony_fx.distributed.updates import CrossProcessUpdates, TurnOrder
from harmony_fx.runtime.tier import StateTier, on_tier_entry

__all__ = ["StepTransaction", "PendingStep", "Undo"]


class Undo:
    """What a step changes on the host, kept so that a failed step can be put back: ``save`` runs
    on the update worker right before each update."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                 buffers: Sequence[torch.Tensor], copies: bool = True, tier: StateTier | None = None,
                 store: dict[int, tuple] | None = None) -> None:
        self.optimizer = optimizer
        # per parameter (its id): the tensors its copies were made in last time, written into again
        self.store = {} if store is None else store
        self.copies = copies  # False (Trainer(atomic=False)): parameters and optimizer state are not kept
        # the NVMe tier: its committed file is the copy of the tensor state (and fp32 masters) it holds
        self.tier = tier
        self.updated = 0      # parameters updated without a copy
        self.params = list(params)  # their .grad are None after ``restore`` (the module docstring says why)
        self.buffers = [(buffer, buffer.clone()) for buffer in buffers]
        self.saved: list[tuple[nn.Parameter, torch.Tensor | None, dict | None]] = []
        # parameters updated whose fp32 master is on the tier: the committed file restores their
        # bf16 copies, so they are put back even without copies (atomic=False)
        self.tiered_masters: list[nn.Parameter] = []
        self.seconds = 0.0  # spent making the copies (on the update worker: part of the update's time)

    def save(self, params: Sequence[nn.Parameter]) -> None:
        tier = self.tier
        masters = tier.masters if tier is not None else frozenset()
        self.tiered_masters += [param for param in params if id(param) in masters]
        if not self.copies:
            self.updated += sum(id(param) not in masters for param in params)
            return
        started = time.perf_counter()
        self._copy(params, masters)
        self.seconds += time.perf_counter() - started

    def _copy(self, params: Sequence[nn.Parameter], masters: frozenset) -> None:
        tier = self.tier
        for param in params:
            state = self.optimizer.state.get(param)
            tiered = tier is not None and id(param) in tier.params
            kept_data, kept_state = self.store.get(id(param), (None, {}))
            copied = None if state is None else {
                k: _copy_into(kept_state.get(k), v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                for k, v in state.items() if not (tiered and on_tier_entry(v))}
            data = None if id(param) in masters else _copy_into(kept_data, param.detach())
            self.store[id(param)] = (data, copied or {})
            self.saved.append((param, data, copied))

    @torch.no_grad()
    def restore(self) -> None:
        for param in self.tiered_masters:
            param.copy_(self.tier.stored_master(param))  # the bf16 copy of the master the step read
        self.tiered_masters.clear()
        for param, data, state in reversed(self.saved):
            if data is not None:
                param.copy_(data)
            if state is None:
                self.optimizer.state.pop(param, None)  # it had no state before this step
            else:  # fresh tensors: the kept ones are written into again by the next step's copies
                self.optimizer.state[param] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                               for k, v in state.items()}
        self.saved.clear()
        for buffer, data in self.buffers:
            buffer.copy_(data)
        for param in self.params:
            param.grad = None


def _copy_into(kept: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into ``kept`` where it has its shape, dtype and device, else a clone."""
    if kept is not None and kept.shape == value.shape and kept.dtype == value.dtype and kept.device == value.device:
        return kept.copy_(value)
    return value.clone()


class StepTransaction:
    """One step's begin, agreement, commit and undo. Begun at construction: across processes the
    ranks start the step together, and the tier opens the step's generation of files."""

    def __init__(self, step: int, undo: Undo, tier: StateTier | None = None, cluster: Cluster | None = None,
                 cross: CrossProcessUpdates | None = None) -> None:
        self.step, self.undo, self.tier, self.cluster, self.cross = step, undo, tier, cluster, cross
        self.agreed = False  # whether the ranks have exchanged this step's outcome
        if cluster is not None:
            cluster.begin_step(step)
        if cross is not None:
            cross.bytes.clear()
        if tier is not None:
            tier.begin(step)

    @property
    def total(self):
        """Sums a number over every rank (the batch is every rank's), or ``None`` in one process."""
        return self.cluster.total if self.cluster is not None else None

    def agree(self, shares: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's loss shares, once every rank's step has succeeded so far; raises
        ``StepFailedElsewhere`` if one failed. With the tier, every rank's files are on its drive
        first: a write failing after the agreement would leave one rank a step behind the others."""
        if self.cluster is None:
            return shares
        if self.tier is not None:
            self.tier.wait_written()
        everyone, failed = self.cluster.agree([share.item() for share in shares], failed=False)
        self.agreed = True
        if failed:
            raise StepFailedElsewhere(f"Trainer.step: step {self.step} failed on rank(s) "
                                      f"{', '.join(map(str, failed))}; it was undone here too")
        return [torch.tensor(share, dtype=shares[0].dtype if shares else torch.float32) for share in everyone]

    def commit(self, stats) -> "PendingStep | None":
        """The step succeeded: the sharded weights gathered are written, and the tier's files are
        committed once the last of them is on the drive, while the next step runs its forward
        (the returned ``PendingStep`` until then; its figures go to ``stats``)."""
        if self.cross is not None:
            self.cross.commit(write=True)
            stats.network_bytes = dict(self.cross.bytes)
        if self.tier is None:
            return None
        self.tier.wait_committed()  # done already: this step's updates waited for it
        return PendingStep(self.step, self.undo, self.tier.finish(), stats)

    def fail(self, error: BaseException, turns: TurnOrder | None, microbatches: int) -> None:
        """The step failed here: the tier's files of it are dropped, the peers are not left waiting
        (this rank takes its part in the collectives it had not reached, the gathers and the
        agreement), and the host is put back as before the step."""
        if self.tier is not None:
            self.tier.abort()
        if self.cross is not None and not isinstance(error, PeerError):
            for pack in turns.remaining() if turns is not None else ():
                self.cross.stand_in(pack)
            self.cross.commit(write=False)
            if not self.agreed:
                self.cluster.agree([0.0] * microbatches, failed=True)
        self.undo.restore()
        if not self.undo.copies and self.undo.updated:
            error.add_note(f"harmony_fx: Trainer(atomic=False): {self.undo.updated} parameter(s) updated before the "
                           "failure keep their update (their optimizer state too); the others are as before")


class PendingStep:
    """A step that returned while its last writes to the NVMe tier go on: what undoes it is kept
    until it is committed, and then its tier figures go to its stats."""

    def __init__(self, step: int, undo: Undo, io, stats) -> None:
        self.step, self.undo, self.io, self.stats = step, undo, io, stats
        io.committed.add_done_callback(lambda committed: committed.exception() is None and self.committed())

    def committed(self) -> None:
        """Once the step is committed (its future's callback, or whoever waited for it first)."""
        self.undo = None  # its copies leave host memory
        stats, io = self.stats, self.io
        stats.tier_bytes, stats.tier_seconds, stats.tier_staged_peak = dict(io.bytes), io.seconds, io.peak_staged

    def settle(self, tier: StateTier, failure: BaseException | None = None) -> BaseException | None:
        """Wait for the commit; if it failed, undo this step and return its error (noted on
        ``failure`` too, the error of a step that failed meanwhile)."""
        error = self.io.committed.exception()  # a Ctrl-C here leaves the pending step as it is
        self.io.drain()  # the commit was the writer's last work: its threads end now, not after we return
        if error is None:
            self.committed()
            return None
        tier.abort_pending()
        if self.undo is not None:
            self.undo.restore()
        note = (f"harmony_fx: the optimizer state of step {self.step} could not be written to the NVMe tier, so "
                f"that step was undone too: weights, optimizer state and step_count ({self.step}) are as before it")
        for raised in {id(e): e for e in (error, failure) if e is not None}.values():
            raised.add_note(note)
        return error
