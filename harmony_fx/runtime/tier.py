"""The NVMe tier at run time: a pack's optimizer state in a file between its updates.

``StateTier`` keeps, for each pack the plan put on the tier (``compiler.tier``), the optimizer's
state tensors of that pack's parameters (Adam's moments; scalars such as its step count stay in
host memory) in one file under ``nvme_path``, and runs the programs' ``READ`` and ``WRITE``
actions on one I/O worker thread per step:

* ``READ S[pk]``: the file is read into one host buffer, its CRC-32 checked, and the tensors are
  put back into ``optimizer.state`` as views of that buffer, so the pack's update finds them;
* ``WRITE S[pk]``: once the pack's update has run, its state is written to a *new* file (the
  step's generation), flushed to the device (``fsync``), and dropped from host memory.

A step's files become the state only at ``commit``, which replaces the manifest (``tier.json``:
per pack its file, size, CRC-32 and the layout of its tensors) atomically, and only then deletes
the files it replaced. A step that fails (``abort``) deletes the files it wrote and drops what it
read, so the tier is as before the step: the step's all-or-nothing rule extends to it. Writes
go through a page-aligned staging buffer with ``O_DIRECT`` (measured faster than buffered writes
with ``fsync`` here; buffered where the file system refuses it), reads are buffered (faster here:
the kernel reads ahead).

The directory is the trainer's: the files of an earlier run there are replaced.
"""
from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import pathlib
import tempfile
import threading
import time
import zlib
from typing import Mapping, Sequence

import torch
from torch import nn

__all__ = ["StateTier", "TierCorrupted", "on_tier_entry"]

MANIFEST = "tier.json"
_FORMAT = {"format": "harmony_fx.nvme_tier", "version": 1}
_ALIGN = 64  # each tensor starts at a multiple of this in its file, so a dtype view of the buffer is aligned
_PAGE = 4096  # a file's size is a multiple of this: O_DIRECT writes whole pages
_CHUNK = 8 * 2**20  # bytes per write through the aligned staging buffer
# O_DIRECT for the tier's writes: measured 1.2-1.5x buffered writes with fsync here (ext4 on a
# virtual disk, docs/benchmarks.md); reads stay buffered, which read-ahead made faster
DIRECT_WRITES = True


class TierCorrupted(ValueError):
    """A tier file does not hold what the manifest says (size or checksum)."""


def on_tier_entry(value) -> bool:
    """Whether an optimizer state entry lives on the tier: tensors with at least one dim (moments,
    momentum buffers); scalars (a step count) and plain values stay in host memory."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class StateTier:
    """The optimizer state of ``packs`` (each a list of parameters, by pack index) under ``path``."""

    def __init__(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer,
                 packs: Mapping[int, Sequence[nn.Parameter]], names: Mapping[int, str]) -> None:
        self.path = pathlib.Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.optimizer = optimizer
        self.packs = dict(packs)
        self.names = names  # id(parameter) -> its name in the model (what the manifest records)
        self.params = {id(p) for params in self.packs.values() for p in params}
        self.committed: dict[int, dict] = {}  # pack -> its manifest entry
        self.step = 0
        # each step's files are a new generation: no file of the committed state is ever overwritten
        self._replaced, self.generation = _read_manifest(self.path)  # an earlier run's: replaced at the first commit
        self._written: dict[int, dict] = {}   # this step's files, by pack, until commit or abort
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.bytes = {"read": 0, "write": 0}  # this step's, of state (without the files' alignment)
        self.seconds = 0.0                    # this step's I/O worker time
        self._failed: BaseException | None = None

    # ------------------------------------------------------------------ a step
    def begin(self, step: int) -> None:
        """A new step (``step``: the trainer's count, recorded in the manifest) and its generation."""
        self.step = step
        self.generation += 1
        self.bytes = {"read": 0, "write": 0}
        self.seconds = 0.0
        self._failed: BaseException | None = None  # the step's first I/O error: what follows is not done
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harmony-io")

    def read(self, pack: int) -> concurrent.futures.Future:
        """``READ S[p<pack>]`` on the I/O worker."""
        return self._worker.submit(self._timed, self._load, pack)

    def write(self, pack: int, updated: concurrent.futures.Future) -> concurrent.futures.Future:
        """``WRITE S[p<pack>]`` on the I/O worker, once ``updated`` (the pack's update) is done."""
        return self._worker.submit(self._timed, self._store_after, pack, updated)

    def drain(self) -> None:
        """Wait for the I/O worker to finish what it was given (its errors stay in their futures)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def commit(self) -> None:
        """The step succeeded: its files become the state (a new manifest, atomically), and the
        files they replace are deleted."""
        self.drain()
        replaced = [entry["file"] for pack, entry in self.committed.items() if pack in self._written]
        replaced += [entry["file"] for entry in self._replaced.values()]
        self.committed.update(self._written)
        self._written, self._replaced = {}, {}
        _write_manifest(self.path, self.step, self.generation, self.committed)
        keep = {entry["file"] for entry in self.committed.values()}
        for name in set(replaced) - keep:
            (self.path / name).unlink(missing_ok=True)

    def abort(self) -> None:
        """The step failed: the files it wrote are deleted and what it read leaves host memory;
        the manifest and its files are as before the step."""
        self.drain()
        for entry in self._written.values():
            (self.path / entry["file"]).unlink(missing_ok=True)
        self._written = {}
        self._drop_from_memory(list(self.packs))

    # ------------------------------------------------------------------ whole state (checkpoints)
    def store_all(self, step: int) -> None:
        """Move every tiered pack's state now in host memory to the tier (a new optimizer, one just
        loaded from a checkpoint), committed as generation ``step``."""
        self.begin(step)
        try:
            for pack in self.packs:
                if any(on_tier_entry(v) for p in self.packs[pack] for v in self.optimizer.state.get(p, {}).values()):
                    self._store(pack)
        except BaseException:
            self.abort()
            raise
        self.commit()

    def stored(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """``param``'s state entries on the tier, read from the committed file (checked)."""
        for pack, params in self.packs.items():
            if any(p is param for p in params) and pack in self.committed:
                return self._load_entries(pack).get(self.names[id(param)], {})
        return {}

    # ------------------------------------------------------------------ on the I/O worker
    def _timed(self, work, *args) -> None:
        if self._failed is not None:
            raise self._failed  # the step is undone: what waits on this hears why
        started = time.perf_counter()
        try:
            work(*args)
        except BaseException as error:
            self._failed = error
            raise
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - started

    def _load(self, pack: int) -> None:
        by_name = {self.names[id(p)]: p for p in self.packs[pack]}
        for name, entries in self._load_entries(pack).items():
            self.optimizer.state[by_name[name]].update(entries)

    def _load_entries(self, pack: int) -> dict[str, dict[str, torch.Tensor]]:
        """The committed file of ``pack`` read into one buffer, checked, as views per parameter."""
        entry = self.committed.get(pack)
        if entry is None:
            return {}  # no state yet: the optimizer makes it at the pack's first update
        path = self.path / entry["file"]
        buffer = torch.empty(entry["bytes"], dtype=torch.uint8)
        with open(path, "rb") as f:
            got = f.readinto(buffer.numpy())
            extra = f.read(1)
        if got != entry["bytes"] or extra:
            raise TierCorrupted(f"the NVMe tier's {path} holds {got + len(extra)}{'+' if extra else ''} bytes, the "
                                f"manifest says {entry['bytes']}; the tier was changed outside this trainer")
        if zlib.crc32(buffer.numpy()) != entry["crc32"]:
            raise TierCorrupted(f"the NVMe tier's {path} fails its CRC-32 check: its bytes changed since they were "
                                "written (disk error, or a write outside this trainer); resume from a checkpoint")
        with self._lock:  # the state's bytes (the file adds alignment)
            self.bytes["read"] += sum(nbytes for *_, nbytes in entry["tensors"])
        loaded: dict[str, dict[str, torch.Tensor]] = {}
        for name, key, dtype, shape, offset, nbytes in entry["tensors"]:
            view = buffer[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)
            loaded.setdefault(name, {})[key] = view
        return loaded

    def _store_after(self, pack: int, updated: concurrent.futures.Future) -> None:
        updated.result()  # the pack's update has run (its error, if it failed, fails the write too)
        self._store(pack)

    def _store(self, pack: int) -> None:
        """Write ``pack``'s state to this step's file, then drop it from host memory."""
        tensors, layout, offset = [], [], 0
        for param in self.packs[pack]:
            for key, value in self.optimizer.state.get(param, {}).items():
                if on_tier_entry(value):
                    flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
                    layout.append([self.names[id(param)], key, str(value.dtype).removeprefix("torch."),
                                   list(value.shape), offset, flat.numel()])
                    tensors.append((offset, flat))
                    offset += -(-flat.numel() // _ALIGN) * _ALIGN
        offset = -(-offset // _PAGE) * _PAGE
        name = f"p{pack}.g{self.generation:08d}.state"
        checksum = _write_file(self.path / name, tensors, offset)
        with self._lock:
            self._written[pack] = {"file": name, "bytes": offset, "crc32": checksum, "tensors": layout}
            self.bytes["write"] += sum(flat.numel() for _, flat in tensors)
        self._drop_from_memory([pack])

    def _drop_from_memory(self, packs: Sequence[int]) -> None:
        for pack in packs:
            for param in self.packs[pack]:
                state = self.optimizer.state.get(param)
                for key in [k for k, v in (state or {}).items() if on_tier_entry(v)]:
                    del state[key]


def _write_file(path: pathlib.Path, tensors: Sequence[tuple[int, torch.Tensor]], size: int,
                direct: bool | None = None) -> int:
    """``tensors`` (offset, bytes) into a new file of ``size`` bytes (a multiple of the page size;
    the gaps are zeros), on the device before it returns; returns its CRC-32. ``direct``: write
    with ``O_DIRECT`` through a page-aligned buffer (``None``: where the file system takes it)."""
    if direct is None:
        direct = DIRECT_WRITES and hasattr(os, "O_DIRECT")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        if not direct:
            raise
        return _write_file(path, tensors, size, direct=False)  # a file system without O_DIRECT (tmpfs)
    checksum, chunk = 0, mmap.mmap(-1, min(_CHUNK, size) or _PAGE)  # anonymous maps are page-aligned
    try:
        staged = torch.frombuffer(chunk, dtype=torch.uint8)
        pieces = iter(tensors)
        piece = next(pieces, None)
        for start in range(0, size, len(chunk)):
            end = min(start + len(chunk), size)
            staged.zero_()
            # copy every tensor's part that falls in [start, end) into the chunk
            while piece is not None and piece[0] < end:
                offset, flat = piece
                lo, hi = max(offset, start), min(offset + flat.numel(), end)
                staged[lo - start:hi - start].copy_(flat[lo - offset:hi - offset])
                if offset + flat.numel() > end:
                    break
                piece = next(pieces, None)
            view = memoryview(chunk)[:end - start]
            checksum = zlib.crc32(view, checksum)
            written = os.pwrite(fd, view, start)
            if written != end - start:
                raise OSError(f"short write to {path}: {written} of {end - start} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)  # the staging map goes with its last view (torch.frombuffer holds it)
    return checksum


def _read_manifest(path: pathlib.Path) -> tuple[dict[int, dict], int]:
    """The packs' entries and the generation of the manifest under ``path`` (none: ``{}, 0``)."""
    manifest = path / MANIFEST
    if not manifest.exists():
        return {}, 0
    data = json.loads(manifest.read_text())
    return {int(pack): entry for pack, entry in data.get("packs", {}).items()}, int(data.get("generation", 0))


def _write_manifest(path: pathlib.Path, step: int, generation: int, packs: Mapping[int, dict]) -> None:
    """The manifest replaced atomically: a temporary file, flushed, renamed over the old one."""
    fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{MANIFEST}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({**_FORMAT, "step": step, "generation": generation, "packs": {str(p): e for p, e in sorted(packs.items())}}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / MANIFEST)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself is on the device
    finally:
        os.close(directory)
