"""A pack's update across processes: its gradients summed over the ranks, then the update.

Replicated (``shard_optimizer=False``): one all-reduce of the pack's gradients, then every rank
steps the pack's parameters, as one process would. Each pack has one fp32 buffer for its gradients,
made once: every parameter's view of it is where its gradient lands (lent through
``runtime.host.GradientBuffers``, as the last step's ``.grad`` is in one process), the buffer is
all-reduced in place, and the view is the parameter's ``.grad``: one set of host gradients, not the
landed ones, a concatenated copy and the last step's ``.grad``. A gradient that landed elsewhere (a
tied weight's or another device's share that held the sum, a device that hands its gradients over,
a parameter whose gradients are not fp32) is copied into its view first; a bf16 parameter's
``.grad`` is then a bf16 copy of its view, made each step, as before.

Sharded (``shard_optimizer=True``): each rank keeps an fp32 master chunk of every parameter
(``shards``) and the optimizer holds those chunks instead of the parameters (swapped into its
``param_groups`` in place, so LR schedulers stay bound to it), with its state 1/N per rank. Per
pack: reduce-scatter of the gradients -> the rank's chunks stepped -> all-gather of the updated
chunks, issued and not waited for. The gathered weights are written into the full parameters (what
every rank prefetches from) at ``commit``, once every rank's step has succeeded: until then the
parameters are as before the step, which keeps a step all or nothing across ranks.

Every rank runs the packs' collectives in one fixed order (``order``: the backward's, last pack
first), whatever order its packs finish in (``TurnOrder``). With ``max_grad_norm`` the gradients'
global norm is over every rank's chunks (``clip_grad_norm_``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from harmony_fx.distributed.cluster import Cluster
from harmony_fx.distributed.shards import PackBuffers
from harmony_fx.runtime.host import GradientBuffers, grad_dtype

__all__ = ["CrossProcessUpdates", "TurnOrder"]


class CrossProcessUpdates:
    def __init__(self, cluster: Cluster, optimizer: torch.optim.Optimizer, groups: dict[int, list[nn.Parameter]],
                 grad_buffers: GradientBuffers | None = None, pin_memory: bool = False) -> None:
        self.cluster = cluster
        self.optimizer = optimizer
        self.order = sorted((pack for pack, params in groups.items() if params), reverse=True)
        self.buffers = {pack: PackBuffers(groups[pack], cluster.rank, cluster.world) for pack in self.order}
        self.shards: dict[int, nn.Parameter] = {}  # id(parameter) -> this rank's master chunk
        self.chunks = {id(p): chunk for buffers in self.buffers.values() for p, chunk in zip(buffers.params, buffers.chunks)}
        # replicated: per pack, its gradients' fp32 buffer and each parameter's view of it (the module docstring)
        self.grad_buffers = grad_buffers
        self.flats: dict[int, torch.Tensor] = {}
        self.grad_views: dict[int, list[torch.Tensor]] = {}
        if cluster.shard_optimizer:
            self._shard_optimizer()
        else:
            for pack in self.order:
                self._make_flat(pack, pin_memory)
        self._gathers: list[tuple[PackBuffers, torch.Tensor, object]] = []
        self.bytes: dict[str, int] = {}

    # ------------------------------------------------------------------ set up
    @torch.no_grad()
    def _shard_optimizer(self) -> None:
        for buffers in self.buffers.values():
            for param, chunk in zip(buffers.params, buffers.chunks):
                flat = param.detach().reshape(-1)[chunk.start:chunk.stop]
                self.shards[id(param)] = nn.Parameter(flat.float().clone(), requires_grad=param.requires_grad)
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            swapped = []
            for param in group["params"]:
                shard = self.shards.get(id(param), param)
                if shard is not param and param in state:  # state made before the Trainer: cut it the same way
                    state[shard] = {key: self._chunk(param, value) for key, value in state.pop(param).items()}
                swapped.append(shard)
            group["params"][:] = swapped  # in place: schedulers and the user's references see it

    def _make_flat(self, pack: int, pin_memory: bool) -> None:
        """``pack``'s gradient buffer, pinned where a GPU's copies land in it (a pageable buffer makes
        them synchronous: ``CudaDevice.landing_fits`` refuses it)."""
        params = self.buffers[pack].params
        flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, pin_memory=pin_memory)
        views, offset = [], 0
        for param in params:
            views.append(flat[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        self.flats[pack], self.grad_views[pack] = flat, views
        self._lend(pack)

    def _lend(self, pack: int) -> None:
        """The next step's gradients of ``pack`` land in their views (``GradientBuffers.take_all``
        hands each out once a step): those of parameters whose gradients are fp32, the views' dtype."""
        if self.grad_buffers is None:
            return
        for param, view in zip(self.buffers[pack].params, self.grad_views[pack]):
            if grad_dtype(param) == view.dtype:
                self.grad_buffers.keep(id(param), view)

    def _chunk(self, param: nn.Parameter, value):
        """This rank's chunk of a parameter-shaped state tensor (other state, like Adam's step, stays)."""
        if not isinstance(value, torch.Tensor) or value.shape != param.shape:
            return value
        chunk = self.chunks[id(param)]
        return value.detach().reshape(-1)[chunk.start:chunk.stop].clone()

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """Each master chunk from its full parameter again (after a checkpoint was loaded into them);
        replicated, there are none: the optimizer steps the parameters themselves."""
        if not self.shards:
            return
        for buffers in self.buffers.values():
            for param, chunk in zip(buffers.params, buffers.chunks):
                self.shards[id(param)].copy_(param.detach().reshape(-1)[chunk.start:chunk.stop])

    def refuse_gradient_hooks(self, model: nn.Module) -> None:
        """Sharded, no rank holds a parameter's whole summed gradient (each has its chunk), so a hook
        on it (``register_hook``, ``register_post_accumulate_grad_hook``) has nothing to run on: refused
        before the step, rather than skipped. Replicated, each rank runs it on the summed gradient."""
        if not self.cluster.shard_optimizer:
            return
        for buffers in self.buffers.values():
            for param in buffers.params:
                kinds = [kind for kind, hooks in (("register_hook", getattr(param, "_backward_hooks", None)),
                                                  ("register_post_accumulate_grad_hook",
                                                   getattr(param, "_post_accumulate_grad_hooks", None))) if hooks]
                if kinds:
                    name = next((n for n, p in model.named_parameters(remove_duplicate=False) if p is param), "?")
                    raise ValueError(
                        f"Trainer.step: the parameter {name!r} has a gradient hook "
                        f"({' and '.join(kinds)}), which shard_optimizer=True (the default across processes) cannot "
                        "run: each rank holds 1/N of the summed gradient, not the whole gradient the hook is "
                        "given. Pass shard_optimizer=False (each rank then runs the hook on the gradient summed "
                        "over the ranks), or remove the hook.")

    def updated_params(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer steps for ``params``: their chunks when sharded."""
        return [self.shards.get(id(p), p) for p in params]

    # ------------------------------------------------------------------ a pack (the update thread)
    def reduce(self, pack: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Sum ``pack``'s gradients over the ranks; they become ``.grad`` of what the optimizer steps."""
        buffers, cluster = self.buffers[pack], self.cluster
        what = f"pack p{pack}'s gradients"
        if cluster.shard_optimizer:
            send = buffers.rank_major(grads)
            mine = send.new_empty(buffers.shard_numel)
            cluster.reduce_scatter(mine, send, f"the reduce-scatter of {what}")
            self._count("reduce_scatter", send)
            for param, grad in zip(buffers.params, buffers.split_shard(mine)):
                self.shards[id(param)].grad = grad
        else:
            flat, views = self.flats[pack], self.grad_views[pack]
            with torch.no_grad():
                for view, grad in zip(views, grads):
                    if grad is None:
                        view.zero_()
                    elif not _same_tensor(grad, view):  # it landed elsewhere (the module docstring)
                        view.copy_(grad)
            cluster.all_reduce(flat, f"the all-reduce of {what}")
            self._count("all_reduce", flat)
            for param, view in zip(buffers.params, views):
                dtype = grad_dtype(param)
                param.grad = view if dtype == view.dtype else view.to(dtype)
            self._lend(pack)

    def gather(self, pack: int) -> None:
        """Sharded: send ``pack``'s updated chunks to every rank (issued; written at ``commit``)."""
        if not self.cluster.shard_optimizer:
            return
        buffers = self.buffers[pack]
        send = buffers.join_shards([self.shards[id(p)] for p in buffers.params])
        gathered = send.new_empty(self.cluster.world * buffers.shard_numel)
        work = self.cluster.all_gather(gathered, send, f"the all-gather of pack p{pack}'s weights")
        self._count("all_gather", gathered)
        self._gathers.append((buffers, gathered, work))

    def step(self, pack: int, grads: Sequence[torch.Tensor | None], update: Callable[[list[nn.Parameter]], None]) -> None:
        """``pack``'s whole turn: reduce, ``update`` (the optimizer over what it holds), gather."""
        self.reduce(pack, grads)
        update(self.updated_params(self.buffers[pack].params))
        self.gather(pack)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every summed gradient (all packs reduced) by ``max_norm`` over their global norm
        where that is below 1, as ``torch.nn.utils.clip_grad_norm_`` on one process; sharded, the
        norm adds up every rank's chunks. Returns the norm (before clipping)."""
        stepped = [q for pack in self.order for q in self.updated_params(self.buffers[pack].params)]
        grads = [q.grad for q in stepped if q.grad is not None]
        squares = sum(float(g.double().pow(2).sum()) for g in grads)
        norm = (self.cluster.total(squares) if self.cluster.shard_optimizer else squares) ** 0.5
        coefficient = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coefficient < 1:
            torch._foreach_mul_(grads, coefficient)
        return norm

    def stand_in(self, pack: int) -> None:
        """A rank whose step failed still takes its part in ``pack``'s collectives (zero gradients,
        unchanged chunks), so that no peer waits for it; nothing is updated."""
        self.reduce(pack, [None] * len(self.buffers[pack].params))
        self.gather(pack)

    # ------------------------------------------------------------------ the step's end
    def commit(self, write: bool) -> None:
        """Wait for the step's all-gathers; write them into the parameters if ``write``."""
        gathers, self._gathers = self._gathers, []
        for buffers, gathered, work in gathers:
            self.cluster.wait(work, "an all-gather of weights")
            if write:
                buffers.write_gathered(gathered)

    def _count(self, collective: str, tensor: torch.Tensor) -> None:
        """Bytes this rank sends for a collective over the full buffer ``tensor``: an all-gather sends
        (N-1)/N of it, an all-reduce twice that (a ring: reduce-scatter, then all-gather), and so
        does gloo's reduce-scatter, which is an all-reduce that keeps one chunk."""
        world = self.cluster.world
        full = tensor.numel() * tensor.element_size()
        factor = 1 if collective == "all_gather" else 2
        self.bytes[collective] = self.bytes.get(collective, 0) + factor * full * (world - 1) // world


def _same_tensor(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``grad`` is ``view``'s memory (the gradient landed in its buffer)."""
    return grad.dtype == view.dtype and grad.shape == view.shape and grad.data_ptr() == view.data_ptr()


class TurnOrder:
    """The order in which every rank issues its packs' collectives, whatever order its packs'
    gradients complete in: a pack whose gradients are complete waits until the packs before it in
    ``order`` have had their turn."""

    def __init__(self, order: Sequence[int]) -> None:
        self.order = list(order)
        self.taken = 0  # packs whose turn came
        self._ready: dict[int, object] = {}

    def arrive(self, pack: int, item: object) -> list[tuple[int, object]]:
        """``pack`` is complete (``item``: what its turn needs); returns the packs whose turn came
        now, in order, with their items."""
        self._ready[pack] = item
        turns = []
        while self.taken < len(self.order) and self.order[self.taken] in self._ready:
            turn = self.order[self.taken]
            self.taken += 1
            turns.append((turn, self._ready.pop(turn)))
        return turns

    def remaining(self) -> list[int]:
        """The packs whose turn has not come (a failed step still takes its part in them)."""
        return self.order[self.taken:]
