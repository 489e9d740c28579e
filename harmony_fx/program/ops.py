"""The harmony ops: the vocabulary of a generated program.

A program is a ``torch.fx`` GraphModule whose nodes call these ops as methods of the runtime
``rt`` (``rt.prefetch('W[p1]', 'h2d')``). They are defined here, as a protocol, and implemented by
``runtime.executor.Runtime``, so the IR names them without importing the runtime.

They are not ``torch.library`` ops: their operands are buffers named by schedule keys and events,
not tensors, so a schema and a fake implementation would add nothing; the static peak comes from
running the same ops on FakeTensors instead.

============  ===============================  ======================================================
op            stream                           effect
============  ===============================  ======================================================
prefetch      h2d                              copy a key's host value to the device; returns an event
offload       d2h                              copy a key's device value to the host; returns an event
wait          the stream named                 that stream (or the host) waits for an event
fwd           compute                          forward of a pack on a microbatch (keeps the graph for
                                               the last pack); returns an event
recompute     compute                          forward again, with grad, from the stashed inputs
bwd           compute                          backward of a pack on a microbatch
free          compute                          drop the device copy of a key
update        host                             the host optimizer steps the parameters whose
                                               gradients are complete
send          peer                             hand a key to another device; its event completes
                                               once the peer has it
recv          peer                             take a key another device sent (adds to a gradient
                                               already here); returns an event
split         host                             cut a host key of a larger forward microbatch into
                                               the backward's microbatches (views); returns an event
read          io                               read a pack's optimizer state from the NVMe tier;
                                               returns an event (its UPDATE names it)
write         io                               write a pack's optimizer state back once its update
                                               ran; returns an event
publish       -                                make an event visible to the other devices' programs
remote        -                                an event another device's program published
============  ===============================  ======================================================
"""
from __future__ import annotations

from typing import Any, Protocol

from harmony_fx.program.actions import ActionKind

__all__ = ["HarmonyOps", "OP_OF_KIND"]


class HarmonyOps(Protocol):
    def prefetch(self, key: str, stream: str) -> Any: ...
    def offload(self, key: str, stream: str) -> Any: ...
    def wait(self, event: Any, stream: str) -> None: ...
    def fwd(self, pack: int, mb: int) -> Any: ...
    def recompute(self, pack: int, mb: int) -> Any: ...
    def bwd(self, pack: int, mb: int) -> Any: ...
    def free(self, key: str) -> None: ...
    def update(self, pack: int, *copies: Any) -> None: ...
    def send(self, key: str, peer: int) -> Any: ...
    def recv(self, key: str, peer: int) -> Any: ...
    def split(self, key: str, *microbatches: int) -> Any: ...
    def read(self, key: str) -> Any: ...
    def write(self, key: str) -> Any: ...
    def publish(self, event: Any, number: int) -> None: ...
    def remote(self, number: int) -> Any: ...


OP_OF_KIND = {
    ActionKind.PREFETCH: HarmonyOps.prefetch.__name__, ActionKind.OFFLOAD: HarmonyOps.offload.__name__,
    ActionKind.WAIT: HarmonyOps.wait.__name__, ActionKind.FWD: HarmonyOps.fwd.__name__,
    ActionKind.RECOMPUTE: HarmonyOps.recompute.__name__, ActionKind.BWD: HarmonyOps.bwd.__name__,
    ActionKind.FREE: HarmonyOps.free.__name__, ActionKind.UPDATE: HarmonyOps.update.__name__,
    ActionKind.SEND: HarmonyOps.send.__name__, ActionKind.RECV: HarmonyOps.recv.__name__,
    ActionKind.SPLIT: HarmonyOps.split.__name__, ActionKind.READ: HarmonyOps.read.__name__,
    ActionKind.WRITE: HarmonyOps.write.__name__,
}
