"""A pack: a contiguous run of layers compiled into a GraphModule of its own.

The pack's GraphModule takes ``(*act_inputs, *state_inputs)`` and returns ``tuple(outputs)``:

* ``act_inputs``: every value defined before the pack (by an earlier pack, or a model input) and
  used inside it. Skip connections that jump several packs are inputs of every pack that reads
  them, and stay on the host (stashed) in between.
* ``state_inputs``: the parameter and buffer placeholders the pack reads. Tied parameters are one
  master tensor: ``state_masters`` maps each placeholder to the index of its distinct master.
* ``outputs``: every value defined inside and used after the pack (by later packs or as a model
  output), in node order.
"""
from __future__ import annotations

import dataclasses
import functools

from torch import fx

from harmony_fx.ir import meta

__all__ = ["Pack"]


@dataclasses.dataclass(frozen=True, eq=False)
class Pack:
    index: int
    layers: tuple[int, ...]
    layer_names: tuple[str, ...]
    gm: fx.GraphModule
    act_inputs: tuple[str, ...]
    state_inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # distinct master tensors: names of params (trainable) and buffers, one placeholder name each
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    # buffers the pack writes in place (e.g. BatchNorm running statistics)
    mutated_buffers: tuple[str, ...]
    # the pack draws random numbers (dropout): recompute must replay the same ones
    random: bool
    # state_inputs[i] is fed with the device copy of (params + buffers)[state_slot[i]]
    state_slot: tuple[int, ...]
    # per act input, one flag per leaf of its value: it requires grad in the model (see
    # analysis.requires_grad); a recompute makes exactly these leaves record gradients
    input_requires_grad: tuple[tuple[bool, ...], ...] = ()
    # mutated buffers whose value as the forward begins reaches the pack's outputs (a step counter,
    # spectral_norm's power iteration; not BatchNorm's statistics, which its training output never
    # reads): the recompute reads them as the forward did, not as the forward left them
    replayed_buffers: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"p{self.index}"

    @functools.cached_property
    def written_slots(self) -> frozenset[int]:
        """Slots of ``params + buffers`` the pack writes in place (its mutated buffers)."""
        return frozenset(len(self.params) + i for i, name in enumerate(self.buffers) if name in self.mutated_buffers)

    @functools.cached_property
    def replayed_slots(self) -> tuple[int, ...]:
        """Slots of ``params + buffers`` whose forward values the recompute reads (``replayed_buffers``)."""
        return tuple(len(self.params) + i for i, name in enumerate(self.buffers) if name in self.replayed_buffers)

    @functools.cached_property
    def slot_dtypes(self) -> tuple:
        """The dtype each of ``params + buffers`` has in the pack's graph: what its device copy is
        staged in (under bf16 a weight's copy, while a constant the model makes keeps its own)."""
        placeholders = {node.name: node for node in self.gm.graph.find_nodes(op="placeholder")}
        by_slot = {slot: placeholders[name].meta[meta.VAL].dtype for name, slot in zip(self.state_inputs, self.state_slot)}
        return tuple(by_slot[slot] for slot in range(len(self.params) + len(self.buffers)))

    def describe_layers(self) -> str:
        names = self.layer_names
        return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
