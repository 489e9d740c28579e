"""The Action IR: ``repr`` is compact and ``parse_action`` is its exact inverse."""
from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")  # a test extra: without it this module skips
from hypothesis import given, settings, strategies as st

from harmony_fx.program.actions import Action, ActionKind, Key, KeyKind, Stream, parse_action, parse_key

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
small = st.integers(min_value=0, max_value=10_000)
keys = st.builds(Key, st.sampled_from(list(KeyKind)), names, st.none() | small)
TASKS = [kind for kind in ActionKind if kind.name in ("FWD", "RECOMPUTE", "BWD")]


def _action(kind: ActionKind, draw) -> Action:
    if kind == ActionKind.WAIT:
        return Action(kind, draw(st.sampled_from(list(Stream))), event=draw(small), peer=draw(st.none() | small))
    if kind in (ActionKind.SEND, ActionKind.RECV):
        return Action(kind, Stream.PEER, key=draw(keys), peer=draw(small), event=draw(small))
    if kind == ActionKind.FREE:
        return Action(kind, Stream.COMPUTE, key=draw(keys))
    if kind == ActionKind.PREFETCH:
        return Action(kind, Stream.H2D, key=draw(keys), event=draw(small))
    if kind == ActionKind.OFFLOAD:
        return Action(kind, Stream.D2H, key=draw(keys), event=draw(small))
    if kind in TASKS:
        return Action(kind, Stream.COMPUTE, pack=draw(small), mb=draw(small), event=draw(small))
    if kind.name == "UPDATE":  # the host updates a pack's parameters (no event)
        return Action(kind, Stream.HOST, pack=draw(small))
    if kind.name == "SPLIT":  # a forward microbatch's host value cut into backward microbatches
        key = Key(KeyKind.ACT, draw(names), draw(small))
        parts = draw(st.lists(small, min_size=1, max_size=6))
        return Action(kind, Stream.HOST, key=key, event=draw(small), reads=(key,),
                      writes=tuple(key._replace(mb=mb) for mb in parts))
    if kind in (ActionKind.READ, ActionKind.WRITE):  # a pack's optimizer state to or from the NVMe tier
        return Action(kind, Stream.IO, key=Key(KeyKind.STATE, f"p{draw(small)}"), event=draw(small))
    raise AssertionError(f"the test does not know how to build a {kind} action; teach it")


@st.composite
def actions(draw):
    return _action(draw(st.sampled_from(list(ActionKind))), draw)


@settings(deadline=None, max_examples=300)
@given(action=actions())
def test_repr_parse_round_trip(action):
    text = repr(action)
    assert "\n" not in text
    parsed = parse_action(text)
    assert parsed == action
    assert repr(parsed) == text


@settings(deadline=None, max_examples=200)
@given(key=keys)
def test_key_str_parse_round_trip(key):
    assert parse_key(str(key)) == key


def test_repr_examples_from_the_docstring():
    examples = {
        "PREFETCH W[p1] h2d -> e4": Action(ActionKind.PREFETCH, Stream.H2D, key=Key(KeyKind.WEIGHTS, "p1"), event=4),
        "WAIT e4 compute": Action(ActionKind.WAIT, Stream.COMPUTE, event=4),
        "FWD p1@0 -> e5": Action(ActionKind.FWD, Stream.COMPUTE, pack=1, mb=0, event=5),
        "OFFLOAD act[relu_3@0] d2h -> e6": Action(ActionKind.OFFLOAD, Stream.D2H,
                                                  key=Key(KeyKind.ACT, "relu_3", 0), event=6),
        "FREE dW[p0]": Action(ActionKind.FREE, Stream.COMPUTE, key=Key(KeyKind.WGRAD, "p0")),
        "SPLIT act[relu_3@4] into 0 1 -> e7": Action(
            ActionKind.SPLIT, Stream.HOST, key=Key(KeyKind.ACT, "relu_3", 4), event=7,
            writes=(Key(KeyKind.ACT, "relu_3", 0), Key(KeyKind.ACT, "relu_3", 1))),
    }
    for text, action in examples.items():
        assert repr(action) == text
        assert parse_action(text) == action


def test_equality_ignores_bookkeeping_fields():
    key = Key(KeyKind.ACT, "x", 0)
    a = Action(ActionKind.FWD, Stream.COMPUTE, pack=0, mb=0, event=1, created_by="a", reads=(key,))
    b = Action(ActionKind.FWD, Stream.COMPUTE, pack=0, mb=0, event=1, created_by="b")
    assert a == b
    assert a != Action(ActionKind.FWD, Stream.COMPUTE, pack=0, mb=1, event=1)


@pytest.mark.parametrize("text", ["W[p1", "Q[p1]", "act[]", "act[x@y]", "act[x@0]extra"])
def test_parse_key_refuses_malformed_text(text):
    with pytest.raises(ValueError, match="not a key"):
        parse_key(text)


def test_parse_action_refuses_unknown_kinds():
    with pytest.raises(ValueError):
        parse_action("TELEPORT p0@0 -> e1")
