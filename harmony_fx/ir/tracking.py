"""Byte-exact accounting of the tensors created while a task runs.

``AllocationTracker`` is a ``TorchDispatchMode``: every tensor an op returns is registered by the
storage it lives in, and released when the last tensor object on that storage dies (PyTorch keeps a
tensor's Python object alive for as long as autograd holds the tensor, so saved activations count
until backward frees them). Views and in-place results add no bytes.

It runs on real tensors (the HostDevice's measured memory) and on FakeTensors (the analysis'
profile of a task), so prediction and measurement count the same things the same way.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["AllocationTracker", "storage_key", "tensor_bytes"]


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def tensor_bytes(tensor: torch.Tensor) -> int:
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
        self._storages: dict[int, list[int]] = {}  # key -> [nbytes, number of live tensor objects]
        # stream worker threads register, and tensors die on whichever thread drops them last
        self._lock = threading.RLock()

    def register(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor``'s storage until the last tensor object on it is gone."""
        key = storage_key(tensor)
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                nbytes = tensor_bytes(tensor)
                if self.cap is not None and self.live + nbytes > self.cap and self.on_exceed is not None:
                    self.on_exceed(self.live + nbytes, self.cap)  # raises; nothing was counted
                entry = self._storages[key] = [nbytes, 0]
                self.live += nbytes
                if self.live > self.peak:
                    self.peak = self.live
            entry[1] += 1
        weakref.finalize(tensor, self._release, key)
        return tensor

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self._storages[key]

    def reset_peak(self) -> None:
        self.peak = self.live

    def mode(self) -> "_TrackingMode":
        """A dispatch mode that registers every tensor produced while it is active."""
        return _TrackingMode(self)


class _TrackingMode(TorchDispatchMode):
    def __init__(self, tracker: AllocationTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.tracker.register(leaf)
        return out
