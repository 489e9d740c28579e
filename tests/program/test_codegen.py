"""codegen: the generated program is readable Python, one harmony op per action.

The golden below is the forward program of MLPChain(width=8, depth=2) on a budget that makes two
packs. To update it after an intended change, run with ``EXPECTTEST_ACCEPT=1``.
"""
from __future__ import annotations

import functools

import pytest
import torch

import harmony_fx
from harmony_fx.ir import meta
from harmony_fx.models import MLPChain
from harmony_fx.program.codegen import generate_program
from harmony_fx.program.actions import Action, ActionKind, Key, KeyKind, Stream
from tests.helpers import smallest_budget

# the golden's checker: without it (the GPU machine has none) this module skips, and `pytest -m cuda` still collects
assert_expected_inline = pytest.importorskip("expecttest").assert_expected_inline

TWO_PACK_BUDGET = 1664  # bytes: MLPChain(8, 2) on a batch of 4 needs 1,824 in one pack, 1,664 in two


@functools.lru_cache(maxsize=None)
def _two_packs():
    torch.manual_seed(0)
    model = MLPChain(width=8, depth=2, num_classes=4)
    x = torch.randn(4, 8)
    return harmony_fx.compile(model, (x,), memory_budget=TWO_PACK_BUDGET, microbatches=1), model, x


def test_two_pack_forward_program_golden():
    hm, _, _ = _two_packs()
    assert len(hm.packs) == 2
    assert_expected_inline(hm.programs["forward"].code.strip(), """\
def forward(self, rt):
    # FWD p0 (blocks.0 .. blocks.1) microbatch 0
    e0 = rt.prefetch('W[p0]', 'h2d')
    rt.wait(e0, 'compute')
    e1 = rt.prefetch('W[p1]', 'h2d')
    e2 = rt.prefetch('act[x@0]', 'h2d')
    rt.wait(e2, 'compute')
    e3 = rt.fwd(0, 0)
    # FWD p1 (linear_2) microbatch 0
    rt.wait(e3, 'd2h')
    e4 = rt.offload('act[relu_1@0]', 'd2h')
    rt.free('act[x@0]')
    rt.free('W[p0]')
    rt.wait(e1, 'compute')
    rt.wait(e4, 'compute')
    e5 = rt.fwd(1, 0)
    # end of the iteration
    rt.wait(e5, 'd2h')
    e6 = rt.offload('act[linear_2@0]', 'd2h')
    rt.wait(e4, 'host')
    rt.wait(e6, 'host')
    return None""")


def test_code_has_a_comment_per_task():
    hm, _, _ = _two_packs()
    lines = [line.strip() for line in hm.code.splitlines()]
    assert any(line.startswith("# FWD p0") for line in lines)
    assert any(line.startswith("# FWD p1") for line in lines)
    assert any(line.startswith("# BWD p1") for line in lines)
    assert any(line.startswith("# RECOMPUTE p0") for line in lines)
    assert "# ---- forward program ----" in hm.code and "# ---- backward program ----" in hm.code
    assert " = None" not in hm.code.replace("return None", "")  # FX's bookkeeping is left out


def test_program_nodes_carry_their_actions():
    hm, _, _ = _two_packs()
    for name, actions in (("forward", hm.forward_actions), ("backward", hm.backward_actions)):
        nodes = [n for n in hm.programs[name].graph.nodes if n.op == "call_method"]
        assert [n.meta[meta.ACTION] for n in nodes] == list(actions)
        assert all(n.meta[meta.FROM_PASS] == "lower_program" for n in nodes)


def test_the_smallest_budget_makes_more_packs_than_the_golden():
    _, model, x = _two_packs()
    smallest = smallest_budget(model, (x,), microbatches=1)
    assert smallest < TWO_PACK_BUDGET
    assert len(harmony_fx.compile(model, (x,), memory_budget=smallest, microbatches=1).packs) > 2


def test_generate_program_from_hand_written_actions():
    actions = [
        Action(ActionKind.PREFETCH, Stream.H2D, key=Key(KeyKind.WEIGHTS, "p0"), event=0),
        Action(ActionKind.WAIT, Stream.COMPUTE, event=0),
        Action(ActionKind.FWD, Stream.COMPUTE, pack=0, mb=0, event=1),
        Action(ActionKind.FREE, Stream.COMPUTE, key=Key(KeyKind.WEIGHTS, "p0")),
    ]
    program = generate_program(actions, ["FWD p0", "FWD p0", "FWD p0", "after"], "Hand")
    code = program.code

    class Recorder:
        def __init__(self):
            self.calls = []

        def __getattr__(self, op):
            def record(*args):
                self.calls.append((op, *args))
                return f"event{len(self.calls)}"
            return record

    rt = Recorder()
    program(rt)
    assert rt.calls == [("prefetch", "W[p0]", "h2d"), ("wait", "event1", "compute"), ("fwd", 0, 0),
                        ("free", "W[p0]")]
    assert code.count("# FWD p0") == 1 and "# after" in code



class _Recorder:
    """A runtime that notes each op called and its arguments; an op's result is its call's number."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, op: str):
        def call(*args):
            self.calls.append((op, args))
            return ("result of call", len(self.calls) - 1)

        return call


def test_run_actions_makes_the_calls_the_generated_program_makes():
    """The planning run calls the runtime's ops from the actions directly; the program users print
    must be the same calls: a pipeline's Trainer on two devices (waits on the other device's
    events, UPDATEs after their copies, SPLITs of larger forward microbatches)."""
    from harmony_fx.program.codegen import run_actions
    from tests.helpers import four_pack_trainer

    trainer = four_pack_trainer(devices=["host:0", "host:1"], parallel="pp")
    actions = [program for device in trainer.hm.device_actions for program in device]
    kinds = {action.kind for program in actions for action in program}
    assert {ActionKind.UPDATE, ActionKind.WAIT, ActionKind.FREE, ActionKind.OFFLOAD} <= kinds
    assert any(a.kind == ActionKind.WAIT and a.peer is not None for program in actions for a in program)
    for program in actions:
        generated, interpreted = _Recorder(), _Recorder()
        generate_program(program, [""] * len(program), "P")(generated)
        run_actions(program, interpreted)
        assert interpreted.calls == generated.calls
        assert len(generated.calls) >= len(program)
