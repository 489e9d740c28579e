"""The NVMe tier at run time: a pack's optimizer state (and fp32 masters) in a file between its updates.

``StateTier`` keeps, for each pack the plan put on the tier (``compiler.host_memory``, by the
policy of ``tier_policy``), the optimizer's state tensors of that pack's parameters (Adam's
moments; scalars such as its step count stay in host memory) in one file under ``nvme_path``, and
serves the programs' ``READ`` and ``WRITE`` actions with two host threads per step, a reader and a
writer. A pack's state streams through its update one parameter at a time, so host memory holds a
few parameters' state, not a pack's:

* ``READ S[pk]`` opens the pack's stream: the reader reads its first parameters' state (each
  parameter's tensors are one region of the file, each tensor CRC-32-checked) into host buffers;
* the ``UPDATE`` of the pack (``update``) takes each parameter's state as it arrives, steps that
  parameter, hands its state to the writer and asks the reader for the one after next; so the
  reader stays at most ``tier_policy.READ_AHEAD`` parameters ahead of the step;
* the writer appends each stepped parameter's state to the pack's *new* file (the step's
  generation), with ``O_DIRECT`` through a page-aligned buffer (measured faster than buffered
  writes with ``fsync`` here; buffered where the file system refuses it), and the step waits at
  most for one parameter in its queue; ``WRITE S[pk]`` is done once the whole file is on the
  device (``fsync``).

Where the plan put a pack's fp32 masters there too (``master_packs``, weights computed in bf16),
each of its parameters holds its bf16 copy in host memory between updates, the tensor the devices
read, with ``grad_dtype`` fp32 so that its gradient is summed and kept in fp32 as before. Its
master is one more tensor of its region (``MASTER_KEY``): the update swaps it in as the
parameter's data, steps it, refreshes the bf16 copy from it and hands it to the writer with the
state; an undone step refreshes the copy from the committed file (``stored_master``).

The state in flight is therefore at most ``tier_policy.staged_params(devices)`` parameters'
worth (the plan's host memory counts it, and ``peak_staged`` measures it).

A step's files become the state only when it is committed: once its writer has put the last of
them on the device, it replaces the manifest (``tier.json``: per pack its file and the layout and
CRC-32 of each tensor) atomically, and only then deletes the files it replaced. The step itself
does not wait for that (``finish``): its last writes go on while the next step runs its forward,
whose first ``READ`` waits for the commit (the files to read are the committed ones), as does its
first update (``wait_committed``; until then the trainer keeps what undoes the last step). A step
that fails while it runs (``abort``) deletes the files it wrote and drops what it read; a step
whose writes fail after it returned is undone when that is found (``abort_pending``: its files
deleted, the manifest as before it). Either way the tier is as before the step: the step's
all-or-nothing rule extends to it.

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
from typing import Callable, Collection, Mapping, Sequence

import torch
from torch import nn

from harmony_fx.tier_policy import READ_AHEAD, masters_may_move

__all__ = ["StateTier", "TierCorrupted", "StepUndone", "on_tier_entry", "MASTER_KEY"]

MANIFEST = "tier.json"
MASTER_KEY = "harmony_fx.fp32_master"  # a parameter's master among its state tensors in a tier file
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


class _StepIO:
    """One step's I/O: its reader and writer threads, what it read, the files it writes (its
    generation), its first error, and ``committed``, done once its files are the state."""

    def __init__(self, step: int, generation: int, packs: Sequence[int], threads: bool = True) -> None:
        self.step, self.generation = step, generation
        self.reader = self.writer = None
        if threads:
            self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harmony-io-read")
            self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="harmony-io-write")
        self.reads: dict[tuple[int, str], concurrent.futures.Future] = {}  # (pack, parameter) -> its read
        self.files: dict[int, _FileWriter] = {}  # files being written
        self.written: dict[int, dict | None] = {}  # finished files, by pack
        self.done = {pack: concurrent.futures.Future() for pack in packs}  # pack -> its file on the device
        self.committed: concurrent.futures.Future = concurrent.futures.Future()
        self.write_slot = threading.Semaphore(1)  # one parameter in the writer's hands at a time
        self.failed: BaseException | None = None  # the first I/O error: what follows is not done
        self.bytes = {"read": 0, "write": 0}  # of state (without the files' alignment)
        self.seconds = 0.0                    # reader and writer time
        self.staged = self.peak_staged = 0    # state bytes in host memory on the tier's way
        self.lock = threading.Lock()

    def drain(self) -> None:
        """Wait for the reader and the writer to finish what they were given."""
        for worker in (self.reader, self.writer):
            if worker is not None:
                worker.shutdown(wait=True)


class StateTier:
    """The optimizer state of ``packs`` (each a list of parameters, by pack index) under ``path``."""

    def __init__(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer,
                 packs: Mapping[int, Sequence[nn.Parameter]], names: Mapping[int, str],
                 master_packs: Collection[int] = (), compute_dtype: torch.dtype | None = None,
                 pin_copies: bool = False) -> None:
        self.path = pathlib.Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.optimizer = optimizer
        self.packs = dict(packs)
        self.names = names  # id(parameter) -> its name in the model (what the manifest records)
        self._pack_of = {id(p): pack for pack, params in self.packs.items() for p in params}
        self.params = frozenset(self._pack_of)  # id of every parameter whose state is on the tier
        # every parameter whose fp32 master is on the tier (its data: the bf16 copy), and their ids
        self._master_params = [p for pack in master_packs for p in self.packs[pack] if masters_may_move(p, compute_dtype)]
        self.masters = frozenset(map(id, self._master_params))
        self.compute_dtype = compute_dtype
        # on GPUs the bf16 copies are pinned: a device's weight copy reads a pinned tensor of its
        # dtype directly, where it would stage a pageable one into a pinned buffer of its own
        self.pin_copies = pin_copies
        self.committed: dict[int, dict] = {}  # pack -> its manifest entry
        self.committed_step = 0  # the trainer's step count the committed state is after
        # each step's files are a new generation: no file of the committed state is ever overwritten
        self._replaced, self.generation = _read_manifest(self.path)  # an earlier run's: replaced at the first commit
        self.current: _StepIO | None = None  # the running step's
        self.pending: _StepIO | None = None  # the last step's, until it is committed

    # ------------------------------------------------------------------ a step
    def begin(self, step: int) -> None:
        """A new step (``step``: the trainer's count, recorded in the manifest) and its generation;
        the last step's writes and commit may still be going on."""
        self.generation += 1
        self.current = _StepIO(step, self.generation, list(self.packs))

    def read(self, pack: int) -> concurrent.futures.Future:
        """``READ S[p<pack>]``: the reader starts on the pack's first parameters, once the last
        step is committed (its files are the ones to read); done once the first has landed (or at
        once, for a pack with no state yet)."""
        io, pending = self.current, self.pending
        first: concurrent.futures.Future = concurrent.futures.Future()

        def opening() -> None:
            if pending is not None:
                pending.committed.result()  # the last step's error, if its state never reached the tier
            order = self._stored_order(pack)
            for name in order[:READ_AHEAD]:
                self._read_param(io, pack, name)  # queued behind this task
            if not order:
                _settle(first, None)
                return
            io.reads[(pack, order[0])].add_done_callback(lambda read: _settle(first, read.exception()))

        io.reader.submit(self._timed, io, opening).add_done_callback(
            lambda opened: opened.exception() is not None and _settle(first, opened.exception()))
        return first

    def write(self, pack: int) -> concurrent.futures.Future:
        """``WRITE S[p<pack>]``: done once the pack's new file is on the device."""
        return self.current.done[pack]

    def update(self, pack: int, step: Callable[[list[nn.Parameter]], None]) -> None:
        """On the update worker: ``pack``'s update, one parameter at a time, its state streaming in
        from the reader and out to the writer (see the module docstring)."""
        io = self.current
        order = self._stored_order(pack)
        position = {name: index for index, name in enumerate(order)}
        try:
            for param in self.packs[pack]:
                name = self.names[id(param)]
                read = name in position
                if read:
                    ahead = position[name] + READ_AHEAD
                    if ahead < len(order):
                        self._read_param(io, pack, order[ahead])
                    entries = io.reads.pop((pack, name)).result()
                    master = entries.pop(MASTER_KEY, None)
                    self.optimizer.state[param].update(entries)
                if id(param) in self.masters:
                    if not read or master is None:
                        raise TierCorrupted(f"the NVMe tier's file of pack {pack} has no fp32 master for {name}: "
                                            "it was written by another run or changed outside this trainer; "
                                            "resume from a checkpoint")
                    master = _step_master(param, master, step)
                    self._hand_to_writer(io, pack, param, read, {MASTER_KEY: master})
                else:
                    step([param])
                    self._hand_to_writer(io, pack, param, read)
            io.writer.submit(self._timed, io, self._finish_file, io, pack)
        except BaseException as error:
            self.fail(error)
            raise

    def wait_written(self) -> None:
        """Block until every file of the running step is on the device; raise the first write's
        error. Across processes a step waits for this before the ranks agree on it."""
        for done in self.current.done.values():
            done.result()

    def wait_committed(self) -> None:
        """Block until the last step is committed; raise its error if it never will be. A step's
        first update waits for this: until then that step's copies for undoing it are kept."""
        if self.pending is not None:
            self.pending.committed.result()

    def fail(self, error: BaseException) -> None:
        """The running step failed (here, or a device that will never hand some updates over):
        every file not yet on the device fails with ``error``, and the reader and writer stop."""
        _fail(self.current, error)

    def finish(self) -> _StepIO:
        """The running step succeeded: its files become the state once its writer has put the
        last of them on the device (``committed``), while the next step may already run."""
        io, self.current = self.current, None
        io.writer.submit(self._commit_step, io)
        for worker in (io.reader, io.writer):
            worker.shutdown(wait=False)  # their threads end once the queued work is done
        self.pending = io
        return io

    def abort(self) -> None:
        """The running step failed: the files it wrote are deleted and what it read leaves host
        memory; the manifest and its files are as before the step."""
        io, self.current = self.current, None
        if io is None:
            return
        _fail(io, StepUndone("the step failed before this pack's state was written"))
        io.drain()
        self._discard(io)
        for params in self.packs.values():
            for param in params:
                self._take_entries(param)

    def abort_pending(self) -> None:
        """The last step could not be committed (its error came from ``wait_committed``): its files
        are deleted and the manifest rewritten as the state before it, so the tier is consistent
        with that step undone."""
        io, self.pending = self.pending, None
        if io is None:
            return
        io.drain()
        self._discard(io)
        _write_manifest(self.path, self.committed_step, io.generation - 1, self.committed)

    def _commit_step(self, io: _StepIO) -> None:
        """On the writer, after the step's last file: the files become the state, or ``committed``
        carries why they cannot."""
        try:
            if io.failed is not None:
                raise io.failed
            assert len(io.written) == len(self.packs), "commit of a step whose packs were not all written"
            self._commit(io)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the commit
            _settle(io.committed, error)
            return
        _settle(io.committed, None)

    def _commit(self, io: _StepIO) -> None:
        replaced = [self.committed[pack]["file"] for pack in io.written if pack in self.committed]
        replaced += [entry["file"] for entry in self._replaced.values()]
        committed = dict(self.committed)
        for pack, entry in io.written.items():
            if entry is None:  # no state at all
                committed.pop(pack, None)
            else:
                committed[pack] = entry
        _write_manifest(self.path, io.step, io.generation, committed)
        self.committed, self.committed_step, self._replaced = committed, io.step, {}
        keep = {entry["file"] for entry in committed.values()}
        for name in set(replaced) - keep:
            (self.path / name).unlink(missing_ok=True)

    def _discard(self, io: _StepIO) -> None:
        """Delete the files ``io`` wrote or was writing (none is in the manifest)."""
        for file in io.files.values():
            file.discard()
        for entry in io.written.values():
            if entry is not None:
                (self.path / entry["file"]).unlink(missing_ok=True)
        io.written, io.files = {}, {}

    # ------------------------------------------------------------------ whole state (checkpoints)
    def store_all(self, step: int) -> None:
        """Move every tiered pack's state now in host memory to the tier (a new optimizer's, one
        just loaded from a checkpoint), committed as generation ``step``; on this thread. The last
        step must be committed (``wait_committed``)."""
        assert self.pending is None or self.pending.committed.done(), "store_all while a step commits"
        self.pending = None
        self.generation += 1
        io = _StepIO(step, self.generation, list(self.packs), threads=False)
        assert all(p.dtype != self.compute_dtype for p in self._master_params), "store_all with masters on the tier"
        try:
            for pack, params in self.packs.items():
                if any(id(p) in self.masters or self._has_state(p) for p in params):
                    for param in params:
                        master = {MASTER_KEY: param.detach()} if id(param) in self.masters else {}
                        self._write_param(io, pack, param, {**self._take_entries(param), **master})
                    self._finish_file(io, pack)
                else:
                    io.written[pack] = None
            self._commit(io)
        except BaseException:
            self._discard(io)
            raise
        for param in self._master_params:  # committed: host memory keeps the bf16 copy only
            param.grad_dtype = param.dtype
            param.data = self._copy_of(param.data)

    def masters_to_host(self) -> None:
        """Every fp32 master on the tier back in its parameter (read from the committed files), as
        before ``store_all`` moved it: a checkpoint loads into them, ``close`` leaves them there."""
        for param in self._master_params:
            if param.dtype == self.compute_dtype:
                param.data = self.stored_master(param)

    def state_to_host(self) -> None:
        """Every tiered parameter's optimizer state back in the optimizer (read from the committed
        files), as before ``store_all`` moved it, once: the tier then holds nothing (a trainer's
        ``close``, after which the optimizer steps on its own)."""
        for params in self.packs.values():
            for param in params:
                stored = self.stored(param)
                if stored:
                    self.optimizer.state.setdefault(param, {}).update(stored)
        self.committed = {}

    def masters_from_host(self) -> None:
        """Undo ``masters_to_host`` where nothing was loaded into the masters: the tier's committed
        files hold them still, so each parameter goes back to its bf16 copy without a write."""
        for param in self._master_params:
            if param.dtype != self.compute_dtype:
                param.data = self._copy_of(param.data)

    def _copy_of(self, master: torch.Tensor) -> torch.Tensor:
        """The bf16 copy of ``master`` a parameter holds while its master is on the tier."""
        copy = master.to(self.compute_dtype)
        return copy.pin_memory() if self.pin_copies else copy

    def stored(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """``param``'s optimizer state entries on the tier, read from the committed file (checked)."""
        pack = self._pack_of.get(id(param))
        if pack is None:
            return {}
        name = self.names[id(param)]
        entries = self._load(None, pack, name) if name in self._stored_order(pack) else {}
        entries.pop(MASTER_KEY, None)
        return entries

    def stored_master(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s fp32 master, read from the committed file (checked)."""
        assert id(param) in self.masters, "stored_master of a parameter whose master is in host memory"
        return self._load(None, self._pack_of[id(param)], self.names[id(param)])[MASTER_KEY]

    # ------------------------------------------------------------------ reading
    def _stored_order(self, pack: int) -> list[str]:
        """The parameters with state in ``pack``'s committed file, in file order."""
        entry = self.committed.get(pack)
        return list(dict.fromkeys(t[0] for t in entry["tensors"])) if entry else []

    def _read_param(self, io: _StepIO, pack: int, name: str) -> None:
        if (pack, name) not in io.reads:
            io.reads[(pack, name)] = io.reader.submit(self._timed, io, self._load, io, pack, name)

    def _load(self, io: _StepIO | None, pack: int, name: str) -> dict[str, torch.Tensor]:
        """The tensors of parameter ``name`` in ``pack``'s committed file: its region read into one
        buffer, each tensor checked against its CRC-32 (``io``: the step that stages them)."""
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
        if io is not None:
            _count(io, "read", sum(t[5] for t in tensors), staged=sum(t[5] for t in tensors))
        return loaded

    # ------------------------------------------------------------------ writing
    def _hand_to_writer(self, io: _StepIO, pack: int, param: nn.Parameter, read: bool,
                        extra: Mapping[str, torch.Tensor] = {}) -> None:  # noqa: B006 - never changed
        """``param``'s stepped state (and ``extra``: its master) to the writer; the step waits while
        the writer still has the parameter before (``read``: its bytes were counted as staged when
        they were read)."""
        entries = {**self._take_entries(param), **extra}
        if not entries:
            return
        nbytes = sum(v.numel() * v.element_size() for v in entries.values())
        if not read:
            _count(io, None, 0, staged=nbytes)  # made by this step's update
        while not io.write_slot.acquire(timeout=0.1):
            if io.failed is not None:
                raise io.failed
        io.writer.submit(self._write_task, io, pack, param, entries, nbytes)

    def _write_task(self, io: _StepIO, pack: int, param: nn.Parameter, entries: dict, nbytes: int) -> None:
        try:
            self._timed(io, self._write_param, io, pack, param, entries)
        finally:
            _count(io, None, 0, staged=-nbytes)
            io.write_slot.release()

    def _write_param(self, io: _StepIO, pack: int, param: nn.Parameter, entries: dict) -> None:
        if pack not in io.files:
            io.files[pack] = _FileWriter(self.path / f"p{pack}.g{io.generation:08d}.state")
        file = io.files[pack]
        for key, value in entries.items():
            flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
            offset = file.add(flat)
            file.tensors.append([self.names[id(param)], key, str(value.dtype).removeprefix("torch."),
                                 list(value.shape), offset, flat.numel(), zlib.crc32(flat.numpy())])
        _count(io, "write", sum(v.numel() * v.element_size() for v in entries.values()))

    def _finish_file(self, io: _StepIO, pack: int) -> None:
        """``pack``'s new file on the device: its entry is the step's, and its WRITE done."""
        file = io.files.get(pack)
        if file is not None:
            size = file.finish()  # if it fails, the step's abort deletes the file
            del io.files[pack]
            io.written[pack] = {"file": file.path.name, "bytes": size, "tensors": file.tensors}
        else:  # nothing to keep (no state at all): the committed entry goes
            io.written[pack] = None
        _settle(io.done[pack], None)

    def _has_state(self, param: nn.Parameter) -> bool:
        return any(on_tier_entry(v) for v in (self.optimizer.state.get(param) or {}).values())

    def _take_entries(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """Remove ``param``'s tier entries from the optimizer's state and return them."""
        state = self.optimizer.state.get(param) or {}
        return {key: state.pop(key) for key in [k for k, v in state.items() if on_tier_entry(v)]}

    # ------------------------------------------------------------------ accounting
    @staticmethod
    def _timed(io: _StepIO, work, *args):
        if io.failed is not None:
            raise io.failed  # the step is undone: what waits on this hears why
        started = time.perf_counter()
        try:
            return work(*args)
        except BaseException as error:
            _fail(io, error)
            raise
        finally:
            with io.lock:
                io.seconds += time.perf_counter() - started


def _step_master(param: nn.Parameter, master: torch.Tensor, step: Callable[[list[nn.Parameter]], None]) -> torch.Tensor:
    """Step ``param`` (whose data is its bf16 copy) on its fp32 ``master``: the master is its data
    for the optimizer's step, then the copy is refreshed from it; returns the stepped master."""
    copy = param.data
    param.data = master
    try:
        step([param])
        stepped = param.data
        with torch.no_grad():
            copy.copy_(stepped)
    finally:
        param.data = copy  # the tensor the devices read, whatever happened
    return stepped


def _fail(io: _StepIO | None, error: BaseException) -> None:
    """``io``'s step failed: its first error is kept, and every file not yet on the device fails."""
    if io is None:
        return
    with io.lock:
        io.failed = io.failed or error
    for done in io.done.values():
        _settle(done, error)


def _count(io: _StepIO, what: str | None, nbytes: int, staged: int = 0) -> None:
    with io.lock:
        if what is not None:
            io.bytes[what] += nbytes
        io.staged += staged
        io.peak_staged = max(io.peak_staged, io.staged)


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
