"""Program codegen: a list of schedule ``Action``s → a ``torch.fx.GraphModule`` that runs them.

Each action becomes one ``call_method`` node on the runtime placeholder ``rt`` (the harmony ops,
see ``ir.ops``); an action that records an event returns it, and ``WAIT`` takes it, so the
synchronisation is visible as data flow. ``HarmonyCodeGen`` prints a comment above each task and
leaves out FX's ``x = None`` bookkeeping (events are small), so the code reads as the iteration::

    def forward(self, rt):
        # FWD pack1 (blocks.2 .. blocks.3)
        e5 = rt.prefetch('act[x@0]', 'h2d')
        rt.wait(e5, 'compute')
        e6 = rt.fwd(1, 0)
        rt.wait(e6, 'd2h')
        e7 = rt.offload('act[relu_3@0]', 'd2h')
"""
from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import fx

from harmony_fx.ir import meta
from harmony_fx.program.ops import OP_OF_KIND
from harmony_fx.program.actions import Action, ActionKind

__all__ = ["generate_program", "run_actions", "HarmonyCodeGen"]



class HarmonyCodeGen(fx.graph.CodeGen):
    """FX's codegen, plus a comment above each task and without FX's ``x = None`` lines."""

    def _gen_python_code(self, nodes, root_module, namespace, **kwargs):
        code = super()._gen_python_code(nodes, root_module, namespace, **kwargs)
        steps = {node.name: node.meta.get(meta.STEP) for node in nodes}
        unused = {node.name for node in nodes if not node.users}
        lines, last_step = [], None
        for line in code.src.split("\n"):
            line = re.sub(r";\s+(\w+ = )+None$", "", line)
            match = re.match(r"(\s+)(\w+) = (rt\..*)", line)
            if match:
                indent, name, call = match.groups()
                step = steps.get(name)
                if step and step != last_step:
                    lines.append(f"{indent}# {step}")
                    last_step = step
                line = f"{indent}{call}" if name in unused else line
            lines.append(line)
        code.src = "\n".join(lines)
        return code


def generate_program(actions: Sequence[Action], steps: Sequence[str], name: str,
                     published: frozenset[int] = frozenset()) -> fx.GraphModule:
    """``steps[i]``: the comment for the task ``actions[i]`` belongs to (printed when it changes).
    ``published``: events of this program that other devices' programs wait for."""
    graph = fx.Graph()
    graph.set_codegen(HarmonyCodeGen())
    rt = graph.placeholder("rt")
    events: dict[int, fx.Node] = {}
    for action, step in zip(actions, steps):
        if action.kind == ActionKind.WAIT and action.event not in events:  # recorded by another device's program
            assert action.peer is not None, f"{action!r} waits for an event of an earlier program"
            remote = graph.call_method("remote", (rt, action.event))
            remote.name = f"e{action.event}"
            remote.meta[meta.STEP] = step
            events[action.event] = remote
        op, args = _call_of(action, events)
        args = (rt, *args)
        node = graph.call_method(op, args)
        if action.event is not None and action.kind != ActionKind.WAIT:
            node.name = f"e{action.event}"
            events[action.event] = node
        node.meta[meta.ACTION] = action
        node.meta[meta.STEP] = step
        node.meta[meta.FROM_PASS] = action.created_by
        if action.kind != ActionKind.WAIT and action.event in published:
            publish = graph.call_method("publish", (rt, node, action.event))
            publish.meta[meta.STEP] = step
    graph.output(None)
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph, class_name=name)


def run_actions(actions: Sequence[Action], rt) -> None:
    """What ``generate_program(actions, ...)(rt)`` does, without making the program: for a run that
    only needs the calls (the planning run of each candidate packing, whose code nobody reads)."""
    events: dict[int, object] = {}
    for action in actions:
        if action.kind == ActionKind.WAIT and action.event not in events:
            events[action.event] = rt.remote(action.event)
        op, args = _call_of(action, events)
        result = getattr(rt, op)(*args)
        if action.event is not None and action.kind != ActionKind.WAIT:
            events[action.event] = result


def _call_of(action: Action, events) -> tuple[str, tuple]:
    """The runtime op an action calls and its arguments after the runtime (``events``: each event
    recorded so far, by number: a program's node, or a running program's value)."""
    op = OP_OF_KIND[action.kind]
    if action.kind == ActionKind.WAIT:
        return op, (events[action.event], action.stream.value)
    if action.kind == ActionKind.FREE:
        return op, (str(action.key),)
    if action.kind == ActionKind.UPDATE:
        return op, (action.pack, *(events[event] for event in action.after))
    if action.kind in (ActionKind.PREFETCH, ActionKind.OFFLOAD):
        return op, (str(action.key), action.stream.value)
    if action.kind in (ActionKind.READ, ActionKind.WRITE):
        return op, (str(action.key),)
    if action.kind in (ActionKind.SEND, ActionKind.RECV):
        return op, (str(action.key), action.peer)
    if action.kind == ActionKind.SPLIT:
        return op, (str(action.key), *(key.mb for key in action.writes))
    return op, (action.pack, action.mb)
