"""``user_frames.user_stacklevel``: harmony's warnings point at the user's line that led to them, not
into harmony or torch (a compile stage, ``torch.compiler.disable``'s wrapper, Dynamo)."""
from __future__ import annotations

import warnings

import torch
from torch import nn

import harmony_fx
from harmony_fx.api import MANY_VARIANTS
from harmony_fx.compiler.driver import RandomDrawsPerMicrobatch


def _where(caught, category, text: str) -> list[str]:
    return [w.filename for w in caught if issubclass(w.category, category) and text in str(w.message)]


def test_a_compile_stages_warning_names_the_users_call():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    hm = harmony_fx.compile(model, devices=["host:0"], microbatches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm(torch.randn(4, 8))  # compiles here: the warning is the compile's
    assert _where(caught, RandomDrawsPerMicrobatch, "draws random") == [__file__]


def test_a_warning_at_a_call_names_the_users_call_past_torchs_wrapper():
    """``HarmonyModule.__call__`` is wrapped by ``torch.compiler.disable``: a fixed stacklevel named
    torch/_dynamo/eval_frame.py."""
    hm = harmony_fx.compile(nn.Linear(8, 2), devices=["host:0"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in range(1, MANY_VARIANTS + 2):
            hm(torch.randn(rows, 8))
    assert _where(caught, UserWarning, "call states") == [__file__]
