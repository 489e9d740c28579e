"""The planning run with each kind of compute task run once: the others replayed from its record.

A FakeTensor run of a device's programs (``runtime.probe.Probe``) spends nearly all its time in the
packs' graphs, op by op. Packs with the same graph (a transformer's blocks) run the same ops on
values of the same layout, so their tasks allocate and free the same bytes in the same order and
leave the same values behind. ``ReplayingProbe`` runs a task for real the first time its signature
is met and records what it did to the device's memory; after that it replays the record:

1. the task's peak above the bytes live at its start (the device's high-water mark is raised to
   it, and a probe with a cap stops there as a real run would);
2. the keys it drops (a recompute's inputs, a backward's graph and gradients), so that what dies
   with them dies, as in the real run;
3. the values it leaves: fresh storages of the recorded sizes, or views of what it read where the
   real values were views, or what it read itself where the real value was that tensor, laid out
   as the real ones (shape, strides, offset, dtype); a recompute's
   graph keeps the bytes of the storages the real graph alone kept (autograd's saved tensors), as
   one storage (they die together, with the graph); a backward's summed weight gradients are the
   weights' ``.grad`` again.

The device's live bytes after a replay must be the record's (an internal check); where they are
not, the probe says so (``replay_failed``) and the caller runs the packing again without replays.

A task's signature is everything its memory depends on: its kind and pack graph
(``runtime.inductor.structure_key``: ops, their arguments, each value's shape and dtype), the
pack's state slots and gradient flags, the layout of every value it reads (shape, strides, offset,
dtype, ``requires_grad``, storage size, and which share a storage), for a backward the recompute
that made its graph and which gradients already exist (added to in place, not made), and that
nothing else holds a storage it drops. The last pack (it keeps its forward's graph) always runs.
A pack that draws random numbers replays like any other: a random op's results have sizes its
inputs decide (a dropout mask is its input's size, whatever it draws), and on FakeTensors nothing
is drawn; the RNG states the runtime saves for its recompute are host tensors, not the device's.

``TaskRecords`` holds the records of one compile: a candidate packing evaluated after another
replays the packs they share.
"""
from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.utils import _pytree as pytree

from harmony_fx.ir.tracking import storage_key
from harmony_fx.ir.values import alias_fake, empty_fake
from harmony_fx.program.actions import Key, KeyKind
from harmony_fx.runtime.inductor import structure_key
from harmony_fx.runtime.probe import Probe

__all__ = ["TaskRecords", "ReplayingProbe"]


_ABSENT = object()  # a key the device did not hold
_NONE = ("none", ())  # the template of a key a task wrote as None (no items: it views nothing)


class _Unreplayable(Exception):
    """What a task left cannot be rebuilt from a record (a view of a storage it did not read or
    make, a dtype its storage cannot be viewed as): the task always runs."""


@dataclasses.dataclass(frozen=True)
class _Record:
    transient: int                     # the task's peak above the bytes live at its start
    net: int                           # live bytes after it less before it
    storages: tuple[tuple | None, ...]  # each storage it made that outlives it: ("raw", bytes) or its base's
                                       # ("base", shape, strides, dtype), the tensor the others view; a
                                       # recompute's kept storages are one, of their bytes (the others None)
    writes: tuple[Any, ...]            # per key it writes, its value's template (None: left as it was; _NONE: None)
    kept: tuple[int, ...] = ()         # recompute: the storages (indices) only its graph keeps
    grads: tuple[int | None, ...] = ()  # backward: per weight, its ``.grad`` as a leaf of dW (None: unset)


class TaskRecords:
    """The records of one compile's planning runs, by task signature (``None``: the task always
    runs); ``ran`` and ``replayed`` count tasks."""

    def __init__(self) -> None:
        self._records: dict[tuple, _Record | None] = {}
        self._structures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.ran = 0
        self.replayed = 0

    def structure(self, gm) -> object:
        key = self._structures.get(gm)
        if key is None:
            key = self._structures[gm] = structure_key(gm)
        return key


class _Sources(NamedTuple):
    by_storage: dict[int, tuple[int, torch.dtype]]  # storage key -> (leaf index, dtype) of its first leaf
    by_identity: dict[int, int]                      # id of a leaf it read -> its index


class _ReplayedGraph:
    """What a replayed recompute leaves under its ``graph`` key: its inputs (as the real graph
    keeps them), its outputs, and the storages only the real graph's saved tensors kept."""

    __slots__ = ("inputs", "outputs", "kept")

    def __init__(self, inputs: list, outputs: list, kept: list) -> None:
        self.inputs, self.outputs, self.kept = inputs, outputs, kept


class ReplayingProbe(Probe):
    """A ``Probe`` whose compute tasks replay ``records`` where they can (see the module docstring);
    ``target``: the device the values are placed on."""

    def __init__(self, *args: Any, records: TaskRecords, target: torch.device, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device_values = _Holders(self.device_values)
        self.records = records
        self.target = target
        self.replay_failed = False
        self._graph_signatures: dict[Key, tuple] = {}  # graph key -> the recompute's signature

    # ------------------------------------------------------------------ the three kinds of task
    def _forward(self, pack_index: int, mb: int) -> None:
        pack = self.packs_for_mb[mb][pack_index]
        if pack_index == self.last:
            return self._task(None, [], lambda: Probe._forward(self, pack_index, mb), None, [])
        values = self.device_values
        read = [values[Key(KeyKind.ACT, name, mb)] for name in pack.act_inputs] + [self._weights(pack)]
        signature = ("FWD", self.records.structure(pack.gm), pack.state_slot, _layout(read))
        self._task(signature, read, lambda: Probe._forward(self, pack_index, mb), lambda *_: None,
                   [Key(KeyKind.ACT, name, mb) for name in pack.outputs])

    def _recompute(self, pack_index: int, mb: int) -> None:
        pack = self.packs_for_mb[mb][pack_index]
        graph_key = Key(KeyKind.GRAPH, pack.name, mb)
        values = self.device_values
        consumed = [Key(KeyKind.ACT, name, mb) for name in pack.act_inputs]
        read = [values[key] for key in consumed] + [self._weights(pack)]
        signature = ("RECOMPUTE", self.records.structure(pack.gm), pack.state_slot, pack.input_requires_grad,
                     _layout(read))
        self._graph_signatures[graph_key] = signature

        def replay(record: _Record, storages: list[torch.Tensor], outputs: dict) -> None:
            inputs = [_leaf(values.pop(key), flags) for key, flags in zip(consumed, pack.input_requires_grad)]
            values[graph_key] = _ReplayedGraph(inputs, outputs.pop(graph_key), [storages[i] for i in record.kept])

        self._task(signature, read, lambda: Probe._recompute(self, pack_index, mb), replay, [graph_key],
                   graph=True)

    def _backward(self, pack_index: int, mb: int) -> None:
        pack = self.packs_for_mb[mb][pack_index]
        graph_key = Key(KeyKind.GRAPH, pack.name, mb)
        made_by = self._graph_signatures.pop(graph_key, None)
        if made_by is None or pack_index == self.last:
            return self._task(None, [], lambda: self._run_backward(pack_index, mb), None, [])
        values = self.device_values
        wanted = set(self.grad_inputs[pack_index])
        grad_keys = [Key(KeyKind.GRAD, name, mb) for name in pack.act_inputs if name in wanted]
        wgrad_key = Key(KeyKind.WGRAD, pack.name)
        dropped = [graph_key] + [Key(KeyKind.GRAD, name, mb) for name in pack.outputs]
        weights = self._weights(pack)
        # what it adds to (in place) and the weights: the leaves a replay may lay its values over
        read = [[values.get(key) for key in grad_keys], values.get(wgrad_key), weights]
        graph = values[graph_key]
        graph = [graph.inputs, graph.outputs] if isinstance(graph, _ReplayedGraph) else list(graph)
        signature = ("BWD", made_by, tuple(i for i, name in enumerate(pack.act_inputs) if name in wanted),
                     _layout([graph] + [values.get(key) for key in dropped[1:]]), _layout(read),
                     _grad_states(weights, read[1]),
                     self._held_elsewhere(dropped))
        del graph

        def replay(record: _Record, storages: list[torch.Tensor], outputs: dict) -> None:
            values.update(outputs)
            summed = pytree.tree_leaves(values.get(wgrad_key))
            for weight, index in zip(weights, record.grads):
                grad = None if index is None else summed[index]
                if weight.grad is not grad:  # a later microbatch's: added in place, the same tensor
                    weight.grad = grad

        self._task(signature, read, lambda: self._run_backward(pack_index, mb), replay, [*grad_keys, wgrad_key],
                   weights=weights, dropped=dropped)

    # ------------------------------------------------------------------ running, recording, replaying
    def _run_backward(self, pack_index: int, mb: int) -> None:
        """The real backward; over a replayed graph, the graph is made first (a recompute of the
        inputs it keeps), with the device's high-water mark left as it was: the real program made
        it earlier, at the recorded cost."""
        pack = self.packs_for_mb[mb][pack_index]
        graph_key = Key(KeyKind.GRAPH, pack.name, mb)
        if isinstance(self.device_values.get(graph_key), _ReplayedGraph):
            tracker = self.device.tracker
            live, peak = tracker.live, tracker.peak
            inputs = self.device_values.pop(graph_key).inputs
            outputs = self._run_pack(pack, inputs, grad=True, what="recompute")
            self.device_values[graph_key] = (inputs, outputs)
            del inputs, outputs
            if tracker.live != live:
                self.replay_failed = True
            tracker.peak = peak
        Probe._backward(self, pack_index, mb)

    def _task(self, signature: tuple | None, read: list, run: Callable[[], None],
              replay: Callable[[_Record, list, dict], None] | None, writes: Sequence[Key], graph: bool = False,
              weights: Sequence[torch.Tensor] = (), dropped: Sequence[Key] = ()) -> None:
        """Replay the record of ``signature``, or ``run`` the task (recording it, the first time;
        ``None``: a task that always runs). ``read``: what it reads and keeps; ``dropped``: the keys
        it drops, whose storages what it leaves may reuse (a gradient passed through unchanged)."""
        records, tracker = self.records, self.device.tracker
        record = records._records.get(signature) if signature is not None else None
        before = tracker.live
        if record is not None:
            records.replayed += 1
            level = before + record.transient
            if level > tracker.peak:
                if tracker.cap is not None and level > tracker.cap and tracker.on_exceed is not None:
                    tracker.on_exceed(level, tracker.cap)  # raises, as the real task would have
                tracker.peak = level
            peak = tracker.peak
            # what its values view, then what it drops dies (the graph, the outputs' gradients), and
            # then what it makes is made: live bytes never pass the recorded peak on the way
            sources = pytree.tree_leaves(read) + self._dropped_leaves(dropped)
            viewed = {item[1] for template in record.writes if template is not None for item in template[1]
                      if item[0] in ("source", "same")}
            sources = [leaf if i in viewed else None for i, leaf in enumerate(sources)]
            for key in dropped:
                self.device_values.pop(key, None)
            storages = self._storages(record)
            unused = set(range(len(storages)))  # storages whose base tensor no value has taken yet
            outputs = {key: None if template is _NONE else _build(template, storages, sources, unused)
                       for key, template in zip(writes, record.writes) if template is not None}
            del sources
            replay(record, storages, outputs)
            self.device_values.update(outputs)
            del storages, outputs
            if tracker.live - before != record.net or tracker.peak != peak:
                self.replay_failed = True
            return
        records.ran += 1
        if signature is None or signature in records._records:  # always runs
            run()
            return
        mark = tracker.registrations
        prior = {key: self.device_values.get(key, _ABSENT) for key in writes}
        sources = self._sources(read, dropped)
        run()
        try:
            records._records[signature] = self._record(before, mark, sources, writes, prior, graph, weights)
        except _Unreplayable:
            records._records[signature] = None

    def _record(self, before: int, mark: int, sources: _Sources, writes: Sequence[Key],
                prior: dict, graph: bool, weights: Sequence[torch.Tensor]) -> _Record:
        tracker = self.device.tracker
        made = tracker.storages_since(mark)
        index = {key: i for i, key in enumerate(made)}
        templates, referenced = [], set()
        bases: dict[int, tuple] = {}  # made storage -> its base's layout, from the first value on it
        for key in writes:
            value = self.device_values.get(key, _ABSENT)
            if value is _ABSENT or value is prior[key]:
                templates.append(None)  # not written, or added to in place
                continue
            if value is None:  # written as None (a backward no gradient reached): a receiver takes that
                templates.append(_NONE)
                continue
            if graph:  # a recompute's (inputs, outputs): the inputs are the ones it read
                value = value[1]
            templates.append(_template(value, index, bases, sources))
            referenced.update(storage_key(leaf) for leaf in _tensors(value))
        kept = tuple(i for key, i in index.items() if key not in referenced) if graph else ()
        if not graph and not referenced >= set(made):
            raise _Unreplayable  # a storage it made is held by something other than the keys it wrote
        grads: tuple[int | None, ...] = ()
        if weights:
            summed = pytree.tree_leaves(self.device_values.get(writes[-1]))
            grads = tuple(None if weight.grad is None else
                          next((i for i, leaf in enumerate(summed) if leaf is weight.grad), -1) for weight in weights)
            if -1 in grads:
                raise _Unreplayable  # a gradient the weight alone holds
        sizes = list(made.values())
        storages: list[tuple | None] = [bases.get(i, ("raw", nbytes)) for i, nbytes in enumerate(sizes)]
        if kept:  # the graph alone holds them and lets them go together: one storage of all their bytes
            storages[kept[0]] = ("raw", sum(sizes[i] for i in kept))
            for i in kept[1:]:
                storages[i] = None
            kept = kept[:1]
        return _Record(tracker.peak - before, tracker.live - before, tuple(storages), tuple(templates), kept, grads)

    def _storages(self, record: _Record) -> list[torch.Tensor]:
        """Fresh storages of the record's sizes on the device, counted as the real ones were: each
        the tensor the values on it view (as their ``_base``), or raw bytes a graph keeps (``None``:
        counted in another's)."""
        register = self.device.tracker.register
        return [None if spec is None else
                register(empty_fake((spec[1],), (1,), torch.uint8, self.target) if spec[0] == "raw" else
                         empty_fake(spec[1], spec[2], spec[3], self.target))
                for spec in record.storages]

    def _sources(self, read: list, dropped: Sequence[Key]) -> _Sources:
        """What a task may leave views of: the leaves it reads, then those it drops, by storage:
        ``{storage key: (leaf index, dtype)}`` (no tensor: one held here would outlive the drop),
        and the leaves it reads by identity (``read`` holds them until the record is made, so an
        id is not reused meanwhile)."""
        by_storage: dict[int, tuple[int, torch.dtype]] = {}
        read_leaves = pytree.tree_leaves(read)
        for i, leaf in enumerate(read_leaves + self._dropped_leaves(dropped)):
            if isinstance(leaf, torch.Tensor):
                by_storage.setdefault(storage_key(leaf), (i, leaf.dtype))
        by_identity = {id(leaf): i for i, leaf in enumerate(read_leaves) if isinstance(leaf, torch.Tensor)}
        return _Sources(by_storage, by_identity)

    def _dropped_leaves(self, keys: Sequence[Key]) -> list:
        """The tensors of the values of ``keys``, a graph as ``[inputs, outputs]`` whether replayed or
        not (a record's sources index them, after the leaves the task read)."""
        values = []
        for key in keys:
            value = self.device_values.get(key)
            if isinstance(value, _ReplayedGraph):
                value = [value.inputs, value.outputs]
            elif key.kind == KeyKind.GRAPH and value is not None:
                value = list(value)
            values.append(value)
        return _tensors(values)

    def _weights(self, pack) -> list:
        return self.device_values[Key(KeyKind.WEIGHTS, pack.name)]

    def _held_elsewhere(self, keys: Sequence[Key]) -> bool:
        """Whether a storage of the values of ``keys`` is also held by another key (dropping them
        then frees less than where the task was recorded: such a task always runs)."""
        values = self.device_values
        mine = collections.Counter(storage for key in set(keys) for storage in _storages(values.get(key)))
        return any(values.holders[storage] > count for storage, count in mine.items())


class _Holders(dict):
    """The device's values, with how many keys hold each storage (``holders``), kept as values come
    and go: ``_held_elsewhere`` asks it at every task, where a scan of every value made a program of
    n microbatches O(n^2) (refusing a batch of 2,048 one-sample microbatches took 44 s, now 12 s)."""

    def __init__(self, values: dict) -> None:
        super().__init__()
        self.holders: collections.Counter = collections.Counter()
        self.update(values)

    def _count(self, value: object, sign: int) -> None:
        for storage in _storages(value):
            self.holders[storage] += sign

    def __setitem__(self, key, value) -> None:
        if key in self:
            self._count(dict.__getitem__(self, key), -1)
        dict.__setitem__(self, key, value)
        self._count(value, 1)

    def __delitem__(self, key) -> None:
        self._count(dict.__getitem__(self, key), -1)
        dict.__delitem__(self, key)

    def pop(self, key, default=_ABSENT):
        if key in self:
            value = dict.pop(self, key)
            self._count(value, -1)
            return value
        if default is _ABSENT:
            raise KeyError(key)
        return default

    def popitem(self):
        key, value = dict.popitem(self)
        self._count(value, -1)
        return key, value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def update(self, *others, **values) -> None:
        for key, value in dict(*others, **values).items():
            self[key] = value

    def clear(self) -> None:
        dict.clear(self)
        self.holders.clear()


# ---------------------------------------------------------------------- layouts and templates


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # most values: asked at every task, where a pytree walk costs
        return [value]
    if isinstance(value, _ReplayedGraph):
        value = [value.inputs, value.outputs, value.kept]
    found: list[torch.Tensor] = []
    _collect_tensors(value, found)
    return found


def _collect_tensors(value: object, found: list[torch.Tensor]) -> None:
    """The tensors among ``pytree.tree_leaves(value)``, in its order; plain lists and tuples (a
    task's values, a graph's inputs and outputs) walked here, at a fraction of pytree's cost."""
    if type(value) is list or type(value) is tuple:
        for item in value:
            _collect_tensors(item, found)
    elif isinstance(value, torch.Tensor):
        found.append(value)
    elif value is not None:
        found.extend(leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor))


def _storages(value: object) -> set:
    """The storages ``value``'s tensors are in, each once."""
    return {storage_key(leaf) for leaf in _tensors(value)}


def _layout(value: object) -> tuple:
    """Every leaf of ``value`` as a task's signature sees it; tensors sharing a storage share a
    number."""
    storages: dict[int, int] = {}
    leaves, spec = pytree.tree_flatten(_unwrap(value))
    out: list = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            out.append((tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype, leaf.requires_grad,
                        storage.nbytes(), storages.setdefault(storage._cdata, len(storages))))
        else:
            out.append(leaf if isinstance(leaf, (int, float, bool, str, type(None))) else type(leaf).__name__)
    return tuple(out)


def _unwrap(value: object) -> object:
    if isinstance(value, _ReplayedGraph):
        return [value.inputs, value.outputs]
    if isinstance(value, list):
        return [_unwrap(item) for item in value]
    return value


def _grad_states(weights: Sequence[torch.Tensor], summed: object) -> tuple:
    """Per weight, where its ``.grad`` is among the summed gradients ``summed`` (``None``: it has none;
    ``"other"``: another tensor)."""
    index = {id(leaf): i for i, leaf in reversed(list(enumerate(pytree.tree_leaves(summed))))}
    return tuple(None if weight.grad is None else index.get(id(weight.grad), "other") for weight in weights)


def _template(value: object, made: dict[int, int], bases: dict[int, tuple], sources: _Sources) -> tuple:
    """How to rebuild ``value``: per leaf, a constant, the ``i``-th leaf the task read itself (a
    weight's ``.grad`` a later microbatch added to in place, in the tuple the runtime makes anew),
    or a tensor laid out over the ``i``-th storage the task made (whose base tensor's layout goes
    into ``bases``) or over the storage of the ``i``-th leaf it read or dropped; a view where the
    real one was a view (``_base``: the runtime owns a gradient as it is only where it is none)."""
    leaves, spec = pytree.tree_flatten(value)
    items = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            items.append(("value", leaf))
            continue
        if id(leaf) in sources.by_identity:
            items.append(("same", sources.by_identity[id(leaf)]))
            continue
        key = storage_key(leaf)
        layout = (tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype, leaf.requires_grad,
                  leaf._base is not None)
        if key in made:
            root = leaf if leaf._base is None else leaf._base
            base = ("base", tuple(root.shape), root.stride(), root.dtype)
            extent = _extent(root)
            if root.storage_offset() or extent != leaf.untyped_storage().nbytes():
                raise _Unreplayable  # a storage larger than the tensor that owns it
            if bases.setdefault(made[key], base) != base:
                raise _Unreplayable  # two bases on one storage
            items.append(("made", made[key], *layout))
        elif key in sources.by_storage and sources.by_storage[key][1] == leaf.dtype:
            items.append(("source", sources.by_storage[key][0], *layout))
        else:
            raise _Unreplayable
    return spec, tuple(items)


def _extent(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


def _build(template: tuple, storages: list[torch.Tensor], sources: list, unused: set[int]) -> object:
    """``template``'s value over ``storages`` and ``sources``; a value that is a made storage's base
    tensor itself takes it (``unused``: those not taken yet), the rest are views and aliases."""
    spec, items = template
    leaves = []
    for item in items:
        if item[0] in ("value", "same"):
            leaves.append(item[1] if item[0] == "value" else sources[item[1]])
            continue
        source, index, shape, stride, offset, dtype, requires_grad, is_view = item
        base = storages[index] if source == "made" else sources[index]
        if (source == "made" and not is_view and index in unused and offset == 0 and base.dtype == dtype
                and tuple(base.shape) == shape and base.stride() == stride):
            unused.discard(index)
            leaf = base  # the storage's own tensor (one op fewer for each of a task's values)
        elif is_view:
            leaf = base.as_strided(shape, stride, offset)
        else:
            leaf = alias_fake(base, shape, stride, offset)  # an alias of its own, as ``detach`` makes: no ``_base``
        if requires_grad:
            leaf.requires_grad_(True)
        leaves.append(leaf)
    return pytree.tree_unflatten(leaves, spec)


def _leaf(value: object, requires_grad: Sequence[bool]) -> object:
    """As the runtime makes a recompute's inputs: detached, recording gradients where flagged."""
    leaves, spec = pytree.tree_flatten(value)
    fresh = [alias_fake(leaf, leaf.shape, leaf.stride(), leaf.storage_offset()).requires_grad_(flag)
             if isinstance(leaf, torch.Tensor) else leaf for leaf, flag in zip(leaves, requires_grad, strict=True)]
    return pytree.tree_unflatten(fresh, spec)
