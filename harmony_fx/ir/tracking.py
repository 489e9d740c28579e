"""Byte-exact accounting of a device's memory: its storages, from birth to death.

A device's bytes are its storages' bytes. ``AllocationTracker`` counts a storage when it first
appears on the device (a copy made by ``register``, or the result of an op run under ``mode()``, a
``TorchDispatchMode``) and releases it when the storage itself dies: PyTorch keeps one Python
object per storage alive exactly as long as the storage, so a finalizer on it fires when the last
tensor, view, alias or autograd reference to the memory is gone, whichever Python objects came and
went meanwhile. Views and in-place results add no bytes; a detached alias keeps its storage counted.

It runs on real tensors (the HostDevice's measured memory) and on FakeTensors (the planning run),
so prediction and measurement count the same things the same way.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["AllocationTracker", "storage_key", "tensor_bytes", "SIZED_AT_MOST"]


def storage_key(tensor: torch.Tensor) -> int:
    """The storage ``tensor`` is in (a sparse tensor, which has none: its values')."""
    if tensor.layout != torch.strided:
        return storage_key(_sparse_parts(tensor)[-1])
    return tensor.untyped_storage()._cdata


def tensor_bytes(tensor: torch.Tensor) -> int:
    if tensor.layout != torch.strided:
        return sum(tensor_bytes(part) for part in _sparse_parts(tensor))
    return tensor.untyped_storage().nbytes()


class AllocationTracker:
    """Live bytes of registered storages, their high-water mark, and an optional cap.

    ``on_exceed(live, cap)`` is called (and expected to raise) when registering a storage takes the
    live bytes past ``cap``.
    """

    def __init__(self, cap: int | None = None, on_exceed: Callable[[int, int], None] | None = None) -> None:
        self.cap = cap
        self.on_exceed = on_exceed
        self.live = 0
        self.peak = 0
        self._storages: dict[int, int] = {}  # key -> nbytes, for every live storage counted
        self.registrations = 0  # storages counted so far, dead ones too: a mark for ``storages_since``
        self._born: dict[int, int] = {}  # key -> ``registrations`` when it was counted (keys are reused)
        # stream worker threads register, and tensors die on whichever thread drops them last
        self._lock = threading.RLock()

    def register(self, tensor: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
        """Count ``tensor``'s storage until the storage dies (once, however many tensors share it);
        ``nbytes``: its size, where the tensor's own storage does not tell (see ``_TrackingMode``). A
        sparse tensor has no storage of its own: its indices and values are counted."""
        if tensor.layout != torch.strided:
            for part in _sparse_parts(tensor):
                self.register(part)
            return tensor
        storage = tensor.untyped_storage()
        key = storage._cdata
        with self._lock:
            if key in self._storages:
                return tensor
            nbytes = storage.nbytes() if nbytes is None else nbytes
            if self.cap is not None and self.live + nbytes > self.cap and self.on_exceed is not None:
                self.on_exceed(self.live + nbytes, self.cap)  # raises; nothing was counted
            self._storages[key] = nbytes
            self.registrations += 1
            self._born[key] = self.registrations
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        weakref.finalize(storage, self._release, key)
        return tensor

    def _release(self, key: int) -> None:
        with self._lock:
            self.live -= self._storages.pop(key)
            del self._born[key]

    def reset_peak(self) -> None:
        self.peak = self.live

    def storages_since(self, mark: int) -> dict[int, int]:
        """``{storage key: bytes}`` of the live storages counted after ``registrations`` was
        ``mark``, in the order they were counted (a key alone does not tell: a storage that dies
        hands its key to the next one at its address)."""
        with self._lock:
            return {key: nbytes for key, nbytes in self._storages.items() if self._born[key] > mark}

    def mode(self) -> "_TrackingMode":
        """A dispatch mode that registers every tensor produced while it is active."""
        return _TrackingMode(self)


def _sparse_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors a sparse one holds its indices and values in."""
    if tensor.layout == torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    return tensor.ccol_indices(), tensor.row_indices(), tensor.values()


class _TrackingMode(TorchDispatchMode):
    def __init__(self, tracker: AllocationTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except DynamicOutputShapeException:
            out = _at_most(func, args, kwargs or {})
        inputs = _InputStorages(args, kwargs)
        if func not in _META_SHARES and func not in _META_UNDERSIZES:
            # nearly every ATen op returns a tensor, or a tuple or list of tensors and Nones; this runs
            # for every op of every planning run, where torch's generic pytree would cost more than the rest
            register = self.tracker.register
            if isinstance(out, torch.Tensor):
                return register(_compact(out, inputs))
            if type(out) in (tuple, list) and all(leaf is None or isinstance(leaf, torch.Tensor) for leaf in out):
                return type(out)(None if leaf is None else register(_compact(leaf, inputs)) for leaf in out)
        out = tree_map(lambda leaf: _compact(leaf, inputs) if isinstance(leaf, torch.Tensor) else leaf, out)
        if func in _META_SHARES:
            out = _apart(out)
        leaves = tree_flatten(out)[0]
        sizes = _real_sizes(func, args, kwargs) if func in _META_UNDERSIZES else [None] * len(leaves)
        for leaf, nbytes in zip(leaves, sizes):
            if isinstance(leaf, torch.Tensor):
                self.tracker.register(leaf, nbytes)
        return out


class _InputStorages:
    """The storages of an op's tensor arguments, found only when asked (``in``): ``_compact`` asks
    only of a result whose storage is larger than the result itself, which few are."""

    __slots__ = ("_args", "_keys")

    def __init__(self, args, kwargs) -> None:
        self._args, self._keys = (args, kwargs), None

    def __contains__(self, key: int) -> bool:
        if self._keys is None:
            self._keys = {storage_key(t) for t in tree_flatten(self._args)[0] if isinstance(t, torch.Tensor)}
        return key in self._keys


# Ops whose meta kernels (what a FakeTensor run calls) cannot size a result the real kernel makes:
# oneDNN's RNN layers return a workspace, kept for the backward, whose size oneDNN alone decides.
_META_UNDERSIZES = {torch.ops.aten.mkldnn_rnn_layer.default}


# Ops whose meta kernels return results that share a storage where the real kernel gives each its
# own: oneDNN's RNN layer backward, its two bias gradients (one storage counted once, 128 B short
# for a layer of width 8, and only in some runs: FakeTensor's cache of op results makes them apart).
_META_SHARES = {torch.ops.aten.mkldnn_rnn_layer_backward.default}


def _apart(out):
    """``out`` with each FakeTensor result that shares an earlier result's storage copied into a
    storage of its own, as the real kernel returns them."""
    seen: set[int] = set()

    def own(leaf):
        if not isinstance(leaf, FakeTensor):
            return leaf
        key = storage_key(leaf)
        if key in seen:
            return leaf.clone()
        seen.add(key)
        return leaf

    return tree_map(own, out)


def _real_sizes(func, args, kwargs) -> list[int | None]:
    """On FakeTensors: the bytes of each result of ``func`` as the real kernel makes them, from one
    run on zeros of the same shapes; on real tensors: ``None`` (their storages tell)."""
    fakes = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, FakeTensor)]
    if not fakes:
        return [None] * len(tree_flatten(func._schema.returns)[0])
    with unset_fake_temporarily():
        real_args, real_kwargs = tree_map(
            lambda t: torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, FakeTensor) else t, (args, kwargs))
        real = func(*real_args, **(real_kwargs or {}))
    return [leaf.untyped_storage().nbytes() if isinstance(leaf, torch.Tensor) else None
            for leaf in tree_flatten(real)[0]]


def _compact(tensor: torch.Tensor, input_storages) -> torch.Tensor:
    """``tensor``, or a copy of it in a storage of its own size where a kernel handed back a view
    into a larger buffer of its own (CPU ``mse_loss`` returns its scalar in the storage of the
    elementwise losses): the buffer would otherwise stay alive as long as the result, unseen by a
    plan made from shapes. Results that alias an input are left as they are, and sparse ones (their
    parts are their own)."""
    if (tensor.layout != torch.strided or tensor.untyped_storage().nbytes() <= _extent(tensor)
            or storage_key(tensor) in input_storages):
        return tensor
    return tensor.clone()


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from the storage's start to the tensor's last element."""
    if tensor.numel() == 0:
        return 0
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


# the ops whose result's size depends on the values that a planning run makes as large as it can be
SIZED_AT_MOST = frozenset({torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                           torch.ops.aten.index.Tensor, torch.ops.aten._unique2.default})


def _at_most(func, args, kwargs):
    """On FakeTensors, an op whose result's size depends on the values (``x[mask]``, ``nonzero``)
    made as large as it can be: the planning run sizes it as ``passes.bound_sizes`` sized the
    captured graph. Any other such op raises as before."""
    aten = torch.ops.aten
    if func is aten.nonzero.default:
        (x,) = args
        return x.new_empty((x.numel(), x.dim()), dtype=torch.long)
    if func is aten.masked_select.default:
        x, mask = args
        return x.new_empty((torch.broadcast_shapes(x.shape, mask.shape).numel(),))
    if func is aten._unique2.default:  # torch.unique: values, inverse indices, counts
        x = args[0]
        given = {**dict(zip(("sorted", "return_inverse", "return_counts"), args[1:])), **kwargs}
        inverse, counts = given.get("return_inverse", False), given.get("return_counts", False)
        return (x.new_empty((x.numel(),)), x.new_empty(x.shape if inverse else (0,), dtype=torch.long),
                x.new_empty((x.numel(),) if counts else (0,), dtype=torch.long))
    if func is aten.index.Tensor:
        x, indices = args
        # each boolean mask of k dims selects at most all of its elements: k index tensors that long
        spread = []
        for index in indices:
            if index is not None and index.dtype in (torch.bool, torch.uint8):
                spread += [index.new_zeros((index.numel(),), dtype=torch.long)] * index.dim()
            else:
                spread.append(index)
        return func(x, spread)
    raise DynamicOutputShapeException(func)
