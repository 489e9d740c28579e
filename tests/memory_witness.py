"""An independent count of what lives on HostDevices, to check the runtime's own accounting against.

The runtime counts a device's bytes with ``ir.tracking.AllocationTracker`` (registered copies, and
results of ops under its dispatch mode). ``DeviceMemoryWitness`` shares none of that code: it wraps
the HostDevice streams' ``submit`` so that each piece of device work (compute, host-to-device copies,
peer receives; not device-to-host copies, whose results live on the host) runs under a dispatch
mode of its own, and counts every storage an op makes there, from the op's return until the
storage object dies. It sees what the kernels hand back before anything in harmony_fx touches it.

    with DeviceMemoryWitness() as witness:
        loss = hm(x).sum(); loss.backward()
    assert witness.peak_of(hm.devices[0]) == hm.stats.peak_bytes["host:0"] <= budget
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harmony_fx.runtime.streams import ChaosStreams, HostStreams
from harmony_fx.program.actions import Stream

__all__ = ["DeviceMemoryWitness"]

_DEVICE_STREAMS = (Stream.COMPUTE, Stream.H2D, Stream.PEER)


class _Count:
    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.storages: dict[int, int] = {}
        self.lock = threading.Lock()

    def add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        with self.lock:
            if key in self.storages:
                return
            self.storages[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self.remove, key)

    def remove(self, key: int) -> None:
        with self.lock:
            self.live -= self.storages.pop(key)


class _Watch(TorchDispatchMode):
    def __init__(self, count: _Count) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage()._cdata not in inputs:
                self.count.add(leaf.untyped_storage())
        return out


class DeviceMemoryWitness:
    """While active, every HostDevice's device work is watched (devices made inside the ``with``,
    by a ``compile`` or a ``Trainer``, too). ``peak_of(device)``: the most bytes of storages its
    device work made that were alive at once; ``live_of(device)``: those alive now."""

    _STREAMS = (HostStreams, ChaosStreams)

    def __init__(self) -> None:
        self._counts: dict[int, _Count] = {}  # id(device.streams) -> its count
        self._lock = threading.Lock()

    def _count(self, streams) -> _Count:
        with self._lock:
            return self._counts.setdefault(id(streams), _Count())

    def peak_of(self, device) -> int:
        return self._count(device.streams).peak

    def live_of(self, device) -> int:
        return self._count(device.streams).live

    def __enter__(self) -> "DeviceMemoryWitness":
        witness = self
        for cls in self._STREAMS:
            original = cls.submit

            def submit(streams, stream, work, original=original):
                if stream not in _DEVICE_STREAMS:
                    return original(streams, stream, work)
                count = witness._count(streams)

                def watched():
                    with _Watch(count):
                        work()

                return original(streams, stream, watched)

            cls.submit = submit
            cls._witness_original = original
        return self

    def __exit__(self, *exc) -> None:
        for cls in self._STREAMS:
            cls.submit = cls._witness_original
            del cls._witness_original
