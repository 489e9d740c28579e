"""The program as data: ``Action``s over logical streams, events and buffer ``Key``s.

A device program is a ``list[Action]`` in issue order. Compute runs on the ``COMPUTE`` stream,
host→device copies on ``H2D``, device→host copies on ``D2H``; ``HOST`` is the controller thread.
Every transfer and compute action records an event (``event``); ``WAIT`` makes a stream (or the
host) wait for one. ``FREE`` drops the device copy of a key, in compute-stream order.

``repr`` is compact and ``parse_action`` is its exact inverse::

    PREFETCH W[p1] h2d -> e4
    WAIT e4 compute
    RECV act[relu_1@0] <- d0 -> e9
    WAIT e3 h2d from d1
    FWD p1@0 -> e5
    OFFLOAD act[relu_3@0] d2h -> e6
    SPLIT act[relu_3@4] into 0 1 -> e7
    READ S[p3] io -> e8
    WRITE S[p3] io -> e9

``READ``/``WRITE`` move a pack's optimizer state between the NVMe tier and host memory on the
host's tier reader and writer (``IO``): the ``UPDATE`` of the pack names the read's event, and the
write is done once what that update left is back on the tier.
"""
from __future__ import annotations

import dataclasses
import functools
import enum
import re
from typing import NamedTuple

__all__ = ["ActionKind", "Stream", "KeyKind", "Key", "Action", "parse_action", "parse_key"]


class _Enum(enum.Enum):
    """An Enum hashed by identity, in C: its members are singletons compared by identity, and
    Enum's own ``__hash__`` (the name's, in Python) took a tenth of planning a large model, whose
    simulations hash these tens of millions of times (streams, key kinds, in dict keys)."""

    __hash__ = object.__hash__


class ActionKind(_Enum):
    PREFETCH = "PREFETCH"    # host → device copy of a key
    OFFLOAD = "OFFLOAD"      # device → host copy of a key
    WAIT = "WAIT"            # stream waits for an event
    FWD = "FWD"              # forward of one pack on one microbatch (no grad, or keeping its graph)
    RECOMPUTE = "RECOMPUTE"  # forward again with grad from the stashed inputs, in backward
    BWD = "BWD"              # backward of one pack on one microbatch
    FREE = "FREE"            # drop the device copy of a key
    UPDATE = "UPDATE"        # the host's optimizer updates the parameters whose gradients are complete
    SEND = "SEND"            # device → device copy of a key (peer stream); done once the peer has it
    RECV = "RECV"            # take a key a peer sent (peer stream)
    SPLIT = "SPLIT"          # on the host: a larger forward microbatch's stash cut into the backward's
    READ = "READ"            # the tier's reader starts on a pack's optimizer state (NVMe to host)
    WRITE = "WRITE"          # the pack's stepped state back on the NVMe tier


class Stream(_Enum):
    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    PEER = "peer"
    HOST = "host"
    IO = "io"          # the host's NVMe tier: one reader and one writer per process


class KeyKind(_Enum):
    WEIGHTS = "W"      # parameters and buffers of a pack (one copy per distinct master)
    BUFFERS = "B"      # the buffers a pack updates in place (a part of W), written back to host
    ACT = "act"        # an activation (or model input/output) on one microbatch
    GRAD = "grad"      # the gradient of an activation on one microbatch
    WGRAD = "dW"       # the weight gradients of a pack, summed over microbatches
    GRAPH = "graph"    # the autograd graph of a pack on one microbatch (between RECOMPUTE and BWD)
    STATE = "S"        # the optimizer state of a pack's parameters, kept on the NVMe tier


class Key(NamedTuple):
    """A buffer the program moves or frees: ``W[p1]``, ``act[relu_3@0]``, ``dW[p0]``."""

    kind: KeyKind
    name: str
    mb: int | None = None

    def __str__(self) -> str:
        suffix = "" if self.mb is None else f"@{self.mb}"
        return f"{self.kind.value}[{self.name}{suffix}]"


_KIND_BY_VALUE = {kind.value: kind for kind in KeyKind}


@functools.lru_cache(maxsize=None)
def parse_key(text: str) -> Key:
    match = re.fullmatch(r"(\w+)\[([^@\]]+)(?:@(\d+))?\]", text)
    if not match or match.group(1) not in _KIND_BY_VALUE:
        raise ValueError(f"not a key: {text!r}")
    mb = None if match.group(3) is None else int(match.group(3))
    return Key(_KIND_BY_VALUE[match.group(1)], match.group(2), mb)


@dataclasses.dataclass(frozen=True)
class Action:
    kind: ActionKind
    stream: Stream
    key: Key | None = None
    pack: int | None = None
    mb: int | None = None
    event: int | None = None       # recorded after the action (or waited on, for WAIT)
    device: int = 0
    # SEND/RECV: the other device; WAIT: the device whose program recorded the event, if not this one
    peer: int | None = None
    created_by: str = dataclasses.field(default="", compare=False)
    # keys a compute task reads and keeps / takes over and drops / creates or adds to
    reads: tuple[Key, ...] = dataclasses.field(default=(), compare=False)
    consumes: tuple[Key, ...] = dataclasses.field(default=(), compare=False)
    writes: tuple[Key, ...] = dataclasses.field(default=(), compare=False)
    # UPDATE: the weight-gradient copies (and the READ of the pack's state) the host's update worker
    # waits for before it steps (the device's issuing thread does not wait: it goes on with the next pack)
    after: tuple[int, ...] = ()

    def __repr__(self) -> str:
        kind = self.kind
        if kind == ActionKind.WAIT:
            remote = "" if self.peer is None else f" from d{self.peer}"
            return f"WAIT e{self.event} {self.stream.value}{remote}"
        if kind in (ActionKind.SEND, ActionKind.RECV):
            arrow = "->" if kind == ActionKind.SEND else "<-"
            return f"{kind.value} {self.key} {arrow} d{self.peer} -> e{self.event}"
        if kind == ActionKind.FREE:
            return f"FREE {self.key}"
        if kind in (ActionKind.PREFETCH, ActionKind.OFFLOAD, ActionKind.READ, ActionKind.WRITE):
            return f"{kind.value} {self.key} {self.stream.value} -> e{self.event}"
        if kind == ActionKind.UPDATE:
            return f"UPDATE p{self.pack}" + (" after " + " ".join(f"e{e}" for e in self.after) if self.after else "")
        if kind == ActionKind.SPLIT:
            return f"SPLIT {self.key} into {' '.join(str(key.mb) for key in self.writes)} -> e{self.event}"
        return f"{kind.value} p{self.pack}@{self.mb} -> e{self.event}"


def parse_action(text: str) -> Action:
    """Inverse of ``repr(action)`` (without ``device`` and ``created_by``)."""
    parts = text.split()
    kind = ActionKind(parts[0])
    if kind == ActionKind.WAIT:
        peer = int(parts[4][1:]) if len(parts) > 3 else None
        return Action(kind, Stream(parts[2]), event=int(parts[1][1:]), peer=peer)
    if kind in (ActionKind.SEND, ActionKind.RECV):
        return Action(kind, Stream.PEER, key=parse_key(parts[1]), peer=int(parts[3][1:]), event=int(parts[5][1:]))
    if kind == ActionKind.FREE:
        return Action(kind, Stream.COMPUTE, key=parse_key(parts[1]))
    if kind in (ActionKind.PREFETCH, ActionKind.OFFLOAD, ActionKind.READ, ActionKind.WRITE):
        return Action(kind, Stream(parts[2]), key=parse_key(parts[1]), event=int(parts[4][1:]))
    if kind == ActionKind.UPDATE:
        return Action(kind, Stream.HOST, pack=int(parts[1][1:]), after=tuple(int(e[1:]) for e in parts[3:]))
    if kind == ActionKind.SPLIT:
        key = parse_key(parts[1])
        return Action(kind, Stream.HOST, key=key, event=int(parts[-1][1:]), reads=(key,),
                      writes=tuple(key._replace(mb=int(mb)) for mb in parts[3:-2]))
    pack, mb = parts[1][1:].split("@")
    return Action(kind, Stream.COMPUTE, pack=int(pack), mb=int(mb), event=int(parts[3][1:]))
