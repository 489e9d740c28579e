"""The processes a Trainer trains across (``torch.distributed``), one per server.

The Trainer sends through two gloo groups it makes over the ranks of the default group (or of
``process_group=``), whatever that group's backend: the *control* group carries the calling thread's
exchanges (the loss's normaliser, the step's agreement: every rank's loss share and whether its step
failed, the check that the ranks planned alike, checkpoints); the *worker* group, used only by the
thread that runs the host updates, carries each pack's gradients and weights. Collectives of one
group are issued by one thread at a time, in the same order on every rank.

The groups are the Trainer's own so that it can end them: ``close``, or the Cluster's finalizer
when it is collected or the interpreter exits (before it finalizes), destroys them, which joins
gloo's worker threads. A gloo thread lets go of a finished collective's tensors just after the
caller has been told it finished; where it is the last holder of a tensor that Python had, letting
go takes the GIL, and if the interpreter is finalizing by then, taking the GIL ends the thread
inside C++ and the process aborts ("terminate called without an active exception"). Joined before
the exit, no thread is left to do that.

A collective that fails (a peer died, or hung past the group's timeout) leaves its group unusable:
``PeerError`` names the ranks that did not report the failure themselves within a few seconds, which
are the dead or hung ones, so the process can exit and ``torchrun`` restart it from a checkpoint.
"""
from __future__ import annotations

import datetime
import time
import weakref
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["Cluster", "PeerError", "StepFailedElsewhere"]


class PeerError(RuntimeError):
    """A collective failed: a peer process died or hung past the group's timeout."""


class StepFailedElsewhere(RuntimeError):
    """The step failed on another rank; this rank's step was undone too, as a step is all or nothing."""


class Cluster:
    def __init__(self, process_group: dist.ProcessGroup | None = None, shard_optimizer: bool | None = None,
                 timeout: datetime.timedelta | float | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("Trainer(process_group=...) needs torch.distributed initialised: call "
                             "torch.distributed.init_process_group() first (torchrun sets the environment for it)")
        group = process_group or dist.group.WORLD  # not kept: the caller's, to destroy when they will
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.shard_optimizer = self.world > 1 if shard_optimizer is None else bool(shard_optimizer)
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self.timeout = timeout
        ranks = dist.get_process_group_ranks(group)
        # the groups (and the checkpoints' mesh over one of them) live only here, so that ending
        # them lets go of the last references
        self._owned = {"control": dist.new_group(ranks, timeout=timeout, backend="gloo"),
                       "worker": dist.new_group(ranks, timeout=timeout, backend="gloo")}
        self._store = _default_store()
        self._post("begun", -1)
        self._post("failed", -1)
        self.barrier()
        # at close, when the Cluster is collected, or at the interpreter's exit, whichever comes first
        # (weakref.finalize runs what is left at exit, before the interpreter finalizes)
        self._end = weakref.finalize(self, _end, self._owned)

    def close(self) -> None:
        """End the groups now (``_end``)."""
        self._end()

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        return self._owned.get("control")

    @property
    def worker_group(self) -> dist.ProcessGroup | None:
        return self._owned.get("worker")

    def mesh(self):
        """The processes as a one-dimensional DeviceMesh over the control group (checkpoints store
        shards as DTensors)."""
        if "mesh" not in self._owned:
            from torch.distributed.device_mesh import DeviceMesh

            self._owned["mesh"] = DeviceMesh.from_group(self.control_group, "cpu")
        return self._owned["mesh"]

    # ------------------------------------------------------------------ this thread's exchanges
    def barrier(self) -> None:
        self._collective(lambda: dist.barrier(group=self.control_group), "a barrier")

    def total(self, value: float) -> float:
        """``value`` summed over the ranks (the global batch's loss normaliser)."""
        tensor = torch.tensor([value], dtype=torch.float64)
        self._collective(lambda: dist.all_reduce(tensor, group=self.control_group), "the loss normaliser's all-reduce")
        return float(tensor.item())

    def agree(self, shares: Sequence[float], failed: bool) -> tuple[list[float], list[int]]:
        """Every rank's loss shares (one per microbatch, as many on every rank) and whether its step
        failed: all the shares in rank order, and the ranks whose step failed."""
        # ranks may hold different numbers of microbatches (uneven batches): pad to the largest
        longest = torch.tensor([len(shares)], dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(longest, dist.ReduceOp.MAX, group=self.control_group), "the step's agreement")
        width = 2 + int(longest.item())
        mine = torch.zeros(width, dtype=torch.float64)  # float32 values stay exact in float64
        mine[0], mine[1] = float(failed), len(shares)
        mine[2:2 + len(shares)] = torch.tensor(list(shares), dtype=torch.float64)
        every = torch.empty(self.world * width, dtype=torch.float64)
        self._collective(lambda: _all_gather()(every, mine, group=self.control_group), "the step's agreement")
        every = every.view(self.world, width)
        in_order = [share for row in every.tolist() for share in row[2:2 + int(row[1])]]
        return in_order, [rank for rank, flag in enumerate(every[:, 0].tolist()) if flag]

    def same_everywhere(self, value: object, what: str) -> None:
        """Refuse to train if ``value`` differs between ranks (``what`` says what to make equal)."""
        values: list[object] = [None] * self.world
        self._collective(lambda: dist.all_gather_object(values, value, group=self.control_group), "a check of the plans")
        differing = [rank for rank, other in enumerate(values) if other != values[0]]
        if differing:
            raise ValueError(f"Trainer: rank(s) {', '.join(map(str, differing))} differ from rank 0 in {what}")

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Rank 0's ``tensor`` on every rank, in place."""
        self._collective(lambda: dist.broadcast(tensor, src=0, group=self.control_group), what)

    def take_rank0s(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Rank 0's values of ``tensors`` on every rank, in place, as DDP's constructor broadcasts
        the model's: a randomly initialised head on a pretrained body (a fresh seed per process)
        would otherwise train as a different replica on each rank, the same update applied to
        different weights. Only the tensors whose fingerprint (sum and norm) differs on some rank
        are sent: a model every rank loaded from one checkpoint sends nothing."""
        mine = torch.tensor([_fingerprint(tensor) for tensor in tensors], dtype=torch.float64).reshape(-1, 2)
        every = torch.empty(self.world * mine.numel(), dtype=torch.float64)
        self._collective(lambda: _all_gather()(every, mine.flatten(), group=self.control_group), what)
        every = every.view(self.world, *mine.shape)
        # NaN != NaN: a tensor holding one is sent, harmlessly
        differing = (every != every[0]).any(dim=2).any(dim=0).nonzero().flatten().tolist()
        for index in differing:
            self.broadcast(tensors[index].detach(), what)

    # ------------------------------------------------------------------ the update thread's
    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        self._collective(lambda: dist.all_reduce(tensor, group=self.worker_group), what)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, what: str) -> None:
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # before 2.13
        self._collective(lambda: reduce_scatter(output, input, group=self.worker_group), what)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, what: str) -> dist.Work:
        """Issued, not waited for: the caller waits (``wait``) once it needs the weights."""
        return self._collective(lambda: _all_gather()(output, input, group=self.worker_group, async_op=True), what)

    def wait(self, work: dist.Work, what: str) -> None:
        self._collective(work.wait, what)

    # ------------------------------------------------------------------ failures
    def begin_step(self, step: int) -> None:
        self._post("begun", step)

    def _collective(self, issue, what: str):
        try:
            return issue()
        except (RuntimeError, dist.DistError) as error:
            raise PeerError(self._diagnose(what, error)) from error

    def _diagnose(self, what: str, error: BaseException) -> str:
        """Who is missing: every live rank posts that it failed; those that do not within a few
        seconds died or hang."""
        step = self._read("begun", self.rank)
        head = f"rank {self.rank}: {what} failed in step {step}"
        if self._store is None:
            return f"{head} ({error}); a peer died or hung past the group's timeout"
        try:
            self._post("failed", step)
            deadline = time.monotonic() + 5.0
            missing: Sequence[int] = ()
            while time.monotonic() < deadline:
                missing = [r for r in range(self.world) if self._read("failed", r) != step]
                if not missing:
                    break
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store lives in rank 0's process (or the launcher): it is gone too
            return f"{head} ({error}); the rendezvous store is unreachable, so its host (rank 0 or the launcher) died"
        if not missing:
            return f"{head}: every rank failed the same way, so no peer is missing: {error}"
        names = ", ".join(map(str, missing))
        return (f"{head}: rank(s) {names} did not report (died, or hung past the group's timeout of "
                f"{self.timeout or 'the default'}); the step was undone here. Exit and let torchrun "
                f"--max-restarts restart from the last checkpoint. Cause: {error}")

    def _post(self, what: str, step: int) -> None:
        if self._store is not None:
            self._store.set(f"harmony_fx/{what}/{self.rank}", str(step))

    def _read(self, what: str, rank: int) -> int:
        if self._store is None:
            return -1
        return int(self._store.get(f"harmony_fx/{what}/{rank}").decode())


def _end(owned: dict) -> None:
    """Destroy the two groups a Cluster made, and let go of them and of the mesh over them: torch
    destroys each group here, with the GIL let go, joining its gloo threads (the module docstring).
    Harmless twice, or after the caller destroyed every group (``destroy_process_group()``)."""
    owned.pop("mesh", None)
    for name in ("control", "worker"):
        group = owned.pop(name, None)
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except ValueError:  # "Invalid process group": destroyed already
                pass


def _fingerprint(tensor: torch.Tensor) -> tuple[float, float]:
    """A tensor's sum and norm, computed without a copy of a floating-point tensor. Ranks holding
    the same values get the same figures where they reduce in the same order (a server whose
    threads split the sum otherwise may send a tensor needlessly); different values of one sum and
    one norm would be missed, which random initialisations never give."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if not tensor.is_floating_point():
        tensor = tensor.to(torch.float64)  # integer and bool buffers: small
    with torch.no_grad():
        return (float(tensor.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(tensor)))


def _all_gather():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # before torch 2.13


def _default_store():
    """The rendezvous store of the default group (private in torch; without it failures name no rank)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None
