"""The NVMe tier at run time: a pack's optimizer state in a file between its updates.

``StateTier`` keeps, for each pack the plan put on the tier (``compiler.tier``), the optimizer's
state tensors of that pack's parameters (Adam's moments; scalars such as its step count stay in
host memory) in one file under ``nvme_path``, and serves the programs' ``READ`` and ``WRITE``
actions with two host threads per step, a reader and a writer. A pack's state streams through its
update one parameter at a time, so host memory holds a few parameters' state, not a pack's:

* ``READ S[pk]`` opens the pack's stream: the reader reads its first parameters' state (each
  parameter's tensors are one region of the file, each tensor CRC-32-checked) into host buffers;
* the ``UPDATE`` of the pack (``update``) takes each parameter's state as it arrives, steps that
  parameter, hands its state to the writer and asks the reader for the one after next; so the
  reader stays at most ``READ_AHEAD`` parameters ahead of the step;
* the writer appends each stepped parameter's state to the pack's *new* file (the step's
  generation), with ``O_DIRECT`` through a page-aligned buffer (measured faster than buffered
  writes with ``fsync`` here; buffered where the file system refuses it), and the step waits at
  most for one parameter in its queue; ``WRITE S[pk]`` is done once the whole file is on the
  device (``fsync``).

The state in flight is therefore at most ``compiler.tier.staged_params(devices)`` parameters'
worth (the plan's host memory counts it, and ``peak_staged`` measures it).

A step's files become the state only at ``commit``, which replaces the manifest (``tier.json``:
per pack its file and the layout and CRC-32 of each tensor) atomically, and only then deletes
the files it replaced. A step that fails (``abort``) deletes the files it wrote and drops what it
read, so the tier is as before the step: the step's all-or-nothing rule extends to it.

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
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from harmony_fx.compiler.tier import READ_AHEAD

__all__ = ["StateTier", "TierCorrupted", "StepUndone", "on_tier_entry"]

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


class StepUndone(RuntimeError):
    """What waits on the tier's work is told when the step fails before that work is done."""


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
        self._pack_of = {id(p): pack for pack, params in self.packs.items() for p in params}
        self.params = frozenset(self._pack_of)  # id of every parameter whose state is on the tier
        self.committed: dict[int, dict] = {}  # pack -> its manifest entry
        self.step = 0
        # each step's files are a new generation: no file of the committed state is ever overwritten
        self._replaced, self.generation = _read_manifest(self.path)  # an earlier run's: replaced at the first commit
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._reader = self._writer = None
        self._written: dict[int, dict] = {}       # this step's finished files, by pack
        self._files: dict[int, _FileWriter] = {}  # this step's files being written
        self._reads: dict[tuple[int, str], concurrent.futures.Future] = {}  # (pack, parameter) -> its read
        self._done: dict[int, concurrent.futures.Future] = {}  # pack -> its file on the device
        self._write_slot = threading.Semaphore(1)  # one parameter in the writer's hands at a time
        self._failed: BaseException | None = None  # the step's first I/O error: what follows is not done
        self.bytes = {"read": 0, "write": 0}       # this step's, of state (without the files' alignment)
        self.seconds = 0.0                         # this step's reader and writer time
        self.staged = self.peak_staged = 0         # state bytes in host memory on the tier's way

    # ------------------------------------------------------------------ a step
    def begin(self, step: int) -> None:
        """A new step (``step``: the trainer's count, recorded in the manifest) and its generation."""
        self._reset()
        self.step = step
        self.generation += 1
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harmony-io-read")
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harmony-io-write")
        self._done = {pack: concurrent.futures.Future() for pack in self.packs}

    def read(self, pack: int) -> concurrent.futures.Future:
        """``READ S[p<pack>]``: the reader starts on the pack's first parameters; done once the
        first has landed (or at once, for a pack with no state yet)."""
        order = self._stored_order(pack)
        for name in order[:READ_AHEAD]:
            self._read_param(pack, name)
        if not order:
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self._reads[(pack, order[0])]

    def write(self, pack: int) -> concurrent.futures.Future:
        """``WRITE S[p<pack>]``: done once the pack's new file is on the device."""
        return self._done[pack]

    def update(self, pack: int, step: Callable[[list[nn.Parameter]], None]) -> None:
        """On the update worker: ``pack``'s update, one parameter at a time, its state streaming in
        from the reader and out to the writer (see the module docstring)."""
        order = self._stored_order(pack)
        position = {name: index for index, name in enumerate(order)}
        try:
            for param in self.packs[pack]:
                name = self.names[id(param)]
                read = name in position
                if read:
                    ahead = position[name] + READ_AHEAD
                    if ahead < len(order):
                        self._read_param(pack, order[ahead])
                    self.optimizer.state[param].update(self._reads[(pack, name)].result())
                step([param])
                self._hand_to_writer(pack, param, read)
            self._writer.submit(self._timed, self._finish_file, pack)
        except BaseException as error:
            self.fail(error)
            raise

    def fail(self, error: BaseException) -> None:
        """The step failed (here, or a device that will never hand some updates over): every file
        not yet on the device fails with ``error``, and the reader and writer stop."""
        with self._lock:
            self._failed = self._failed or error
        for done in self._done.values():
            _settle(done, error)

    def drain(self) -> None:
        """Wait for the reader and the writer to finish what they were given."""
        for worker in (self._reader, self._writer):
            if worker is not None:
                worker.shutdown(wait=True)
        self._reader = self._writer = None

    def commit(self) -> None:
        """The step succeeded: its files become the state (a new manifest, atomically), and the
        files they replace are deleted."""
        self.drain()
        assert self._failed is None and len(self._written) == len(self.packs), "commit of a step that failed"
        self._commit()

    def abort(self) -> None:
        """The step failed: the files it wrote are deleted and what it read leaves host memory;
        the manifest and its files are as before the step."""
        self.fail(StepUndone("the step failed before this pack's state was written"))
        self.drain()
        for file in self._files.values():
            file.discard()
        for entry in self._written.values():
            (self.path / entry["file"]).unlink(missing_ok=True)
        self._written, self._files = {}, {}
        for params in self.packs.values():
            for param in params:
                self._take_entries(param)

    def _commit(self) -> None:
        replaced = [self.committed[pack]["file"] for pack in self._written if pack in self.committed]
        replaced += [entry["file"] for entry in self._replaced.values()]
        for pack, entry in self._written.items():
            if entry is None:  # no state at all
                self.committed.pop(pack, None)
            else:
                self.committed[pack] = entry
        self._written, self._replaced = {}, {}
        _write_manifest(self.path, self.step, self.generation, self.committed)
        keep = {entry["file"] for entry in self.committed.values()}
        for name in set(replaced) - keep:
            (self.path / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------ whole state (checkpoints)
    def store_all(self, step: int) -> None:
        """Move every tiered pack's state now in host memory to the tier (a new optimizer's, one
        just loaded from a checkpoint), committed as generation ``step``; on this thread."""
        self.begin(step)
        self.drain()  # no threads: everything below runs here
        try:
            for pack, params in self.packs.items():
                if any(on_tier_entry(v) for p in params for v in self.optimizer.state.get(p, {}).values()):
                    for param in params:
                        self._write_param(pack, param, self._take_entries(param))
                    self._finish_file(pack)
        except BaseException:
            self.abort()
            raise
        self._commit()

    def stored(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """``param``'s state entries on the tier, read from the committed file (checked)."""
        pack = self._pack_of.get(id(param))
        if pack is None:
            return {}
        name = self.names[id(param)]
        return self._load(pack, name) if name in self._stored_order(pack) else {}

    # ------------------------------------------------------------------ reading
    def _stored_order(self, pack: int) -> list[str]:
        """The parameters with state in ``pack``'s committed file, in file order."""
        entry = self.committed.get(pack)
        return list(dict.fromkeys(t[0] for t in entry["tensors"])) if entry else []

    def _read_param(self, pack: int, name: str) -> None:
        if (pack, name) not in self._reads:
            self._reads[(pack, name)] = self._reader.submit(self._timed, self._load, pack, name, True)

    def _load(self, pack: int, name: str, staged: bool = False) -> dict[str, torch.Tensor]:
        """The tensors of parameter ``name`` in ``pack``'s committed file: its region read into one
        buffer, each tensor checked against its CRC-32."""
        entry = self.committed[pack]
        tensors = [t for t in entry["tensors"] if t[0] == name]
        start, end = tensors[0][4], tensors[-1][4] + tensors[-1][5]
        buffer = torch.empty(end - start, dtype=torch.uint8)
        path = self.path / entry["file"]
        with open(path, "rb") as f:
            f.seek(start)
            got = f.readinto(buffer.numpy())
        if got != end - start:
            raise TierCorrupted(f"the NVMe tier's {path} ends at byte {start + got}, the manifest has {name}'s state "
                                f"up to byte {end}; the tier was changed outside this trainer")
        loaded = {}
        for _, key, dtype, shape, offset, nbytes, crc in tensors:
            data = buffer[offset - start:offset - start + nbytes]
            if zlib.crc32(data.numpy()) != crc:
                raise TierCorrupted(f"the NVMe tier's {path} fails the CRC-32 check of {name}'s {key!r}: its bytes "
                                    "changed since they were written (disk error, or a write outside this trainer); "
                                    "resume from a checkpoint")
            loaded[key] = data.view(getattr(torch, dtype)).view(shape)
        if staged:
            self._count("read", sum(t[5] for t in tensors), staged=sum(t[5] for t in tensors))
        return loaded

    # ------------------------------------------------------------------ writing
    def _hand_to_writer(self, pack: int, param: nn.Parameter, read: bool) -> None:
        """``param``'s stepped state to the writer; the step waits while the writer still has the
        parameter before (``read``: its bytes were counted as staged when they were read)."""
        entries = self._take_entries(param)
        if not entries:
            return
        nbytes = sum(v.numel() * v.element_size() for v in entries.values())
        if not read:
            self._count(None, 0, staged=nbytes)  # made by this step's update
        while not self._write_slot.acquire(timeout=0.1):
            if self._failed is not None:
                raise self._failed
        self._writer.submit(self._write_task, pack, param, entries, nbytes)

    def _write_task(self, pack: int, param: nn.Parameter, entries: dict, nbytes: int) -> None:
        try:
            self._timed(self._write_param, pack, param, entries)
        finally:
            self._count(None, 0, staged=-nbytes)
            self._write_slot.release()

    def _write_param(self, pack: int, param: nn.Parameter, entries: dict) -> None:
        if pack not in self._files:
            self._files[pack] = _FileWriter(self.path / f"p{pack}.g{self.generation:08d}.state")
        file = self._files[pack]
        for key, value in entries.items():
            flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
            offset = file.add(flat)
            file.tensors.append([self.names[id(param)], key, str(value.dtype).removeprefix("torch."),
                                 list(value.shape), offset, flat.numel(), zlib.crc32(flat.numpy())])
        self._count("write", sum(v.numel() * v.element_size() for v in entries.values()))

    def _finish_file(self, pack: int) -> None:
        """``pack``'s new file on the device: its entry is this step's, and its WRITE done."""
        file = self._files.get(pack)
        if file is not None:
            size = file.finish()  # if it fails, ``abort`` deletes the file
            del self._files[pack]
            self._written[pack] = {"file": file.path.name, "bytes": size, "tensors": file.tensors}
        else:  # nothing to keep (no state at all): the committed entry goes
            self._written[pack] = None
        _settle(self._done[pack], None)

    def _take_entries(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """Remove ``param``'s tier entries from the optimizer's state and return them."""
        state = self.optimizer.state.get(param) or {}
        return {key: state.pop(key) for key in [k for k, v in state.items() if on_tier_entry(v)]}

    # ------------------------------------------------------------------ accounting
    def _timed(self, work, *args):
        if self._failed is not None:
            raise self._failed  # the step is undone: what waits on this hears why
        started = time.perf_counter()
        try:
            return work(*args)
        except BaseException as error:
            self.fail(error)
            raise
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - started

    def _count(self, what: str | None, nbytes: int, staged: int = 0) -> None:
        with self._lock:
            if what is not None:
                self.bytes[what] += nbytes
            self.staged += staged
            self.peak_staged = max(self.peak_staged, self.staged)


class _FileWriter:
    """A new state file written front to back through a page-aligned buffer, with ``O_DIRECT``
    where the file system takes it; ``finish`` pads it to whole pages and puts it on the device."""

    def __init__(self, path: pathlib.Path, direct: bool | None = None) -> None:
        self.path = path
        self.tensors: list[list] = []  # the manifest's layout, filled by the caller
        direct = DIRECT_WRITES and hasattr(os, "O_DIRECT") if direct is None else direct
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
        except OSError:
            if not direct:
                raise
            self.fd = os.open(path, flags, 0o644)  # a file system without O_DIRECT (tmpfs)
        self.chunk = mmap.mmap(-1, _CHUNK)  # anonymous maps are page-aligned
        self.staged = torch.frombuffer(self.chunk, dtype=torch.uint8)
        self.filled = 0    # bytes of the chunk in use
        self.written = 0   # bytes of the file written so far (whole chunks)

    @property
    def size(self) -> int:
        return self.written + self.filled

    def add(self, flat: torch.Tensor) -> int:
        """Append ``flat`` (bytes) at the next aligned offset; returns that offset."""
        self._zeros(-self.size % _ALIGN)
        offset, done = self.size, 0
        while done < flat.numel():
            take = min(flat.numel() - done, _CHUNK - self.filled)
            self.staged[self.filled:self.filled + take].copy_(flat[done:done + take])
            self.filled += take
            done += take
            if self.filled == _CHUNK:
                self._flush()
        return offset

    def finish(self) -> int:
        """Pad to whole pages, write, ``fsync``, close; returns the file's size."""
        try:
            self._zeros(-self.size % _PAGE)
            self._flush()
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        return self.written

    def discard(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.path.unlink(missing_ok=True)

    def _zeros(self, count: int) -> None:
        while count:
            take = min(count, _CHUNK - self.filled)
            self.staged[self.filled:self.filled + take].zero_()
            self.filled += take
            count -= take
            if self.filled == _CHUNK:
                self._flush()

    def _flush(self) -> None:
        if self.filled:
            assert self.filled % _PAGE == 0 or self.filled == _CHUNK, "O_DIRECT writes whole pages"
            view = memoryview(self.chunk)[:self.filled]
            if os.pwrite(self.fd, view, self.written) != self.filled:
                raise OSError(f"short write to {self.path}")
            self.written += self.filled
            self.filled = 0


def _settle(future: concurrent.futures.Future, error: BaseException | None) -> None:
    """Finish ``future`` unless it already is (a failing step and a worker may race)."""
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def _read_manifest(path: pathlib.Path) -> tuple[dict[int, dict], int]:
    """The packs' entries and the generation of the manifest under ``path`` (none: ``{}, 0``)."""
    manifest = path / MANIFEST
    if not manifest.exists():
        return {}, 0
    data = json.loads(manifest.read_text())
    return {int(pack): entry for pack, entry in data.get("packs", {}).items()}, int(data.get("generation", 0))


def _write_manifest(path: pathlib.Path, step: int, generation: int, packs: Mapping[int, dict | None]) -> None:
    """The manifest replaced atomically: a temporary file, flushed, renamed over the old one."""
    kept = {str(p): e for p, e in sorted(packs.items()) if e is not None}
    fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{MANIFEST}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({**_FORMAT, "step": step, "generation": generation, "packs": kept}, f, indent=1)
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
