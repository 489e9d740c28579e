"""An unknown option, at each door that takes options (``harmony_fx.compile``, ``harmony_fx.Trainer``,
``torch.compile(backend="harmony", options=...)``), is a ``TypeError`` that names the door, suggests
the nearest valid name and lists the valid ones, internal fields left out."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import harmony_fx
from harmony_fx.config import check_option_names, option_names
from tests.helpers import four_pack_trainer


def _valid_list(message: str) -> list[str]:
    """The options the message lists after "the valid options are: "."""
    match = re.search(r"the valid options are: (.*)\.$", message)
    assert match, f"no list of valid options in: {message}"
    return match.group(1).split(", ")


def _check_message(message: str, door: str, unknown: str, suggestion: str) -> list[str]:
    assert door in message
    assert repr(unknown) in message
    assert f"did you mean {suggestion!r}?" in message
    listed = _valid_list(message)
    assert listed == sorted(listed)
    assert "memory_budget" in listed
    assert "forward_microbatches" not in message  # internal: set from microbatches={"forward": ...}
    return listed


def test_check_option_names_lists_every_unknown_with_its_nearest():
    with pytest.raises(TypeError) as info:
        check_option_names({"memory_budgt": 1, "xyz": 2, "verify": True}, ["memory_budget", "verify"], "the door")
    message = str(info.value)
    assert message.startswith("the door got the unknown options ")
    assert "'memory_budgt' (did you mean 'memory_budget'?)" in message
    assert ", 'xyz'. " in message  # nothing near it: no suggestion
    assert _valid_list(message) == ["memory_budget", "verify"]


def test_known_names_pass():
    check_option_names({"memory_budget": "1MiB", "verify": False}, option_names(), "harmony_fx.compile")


def test_internal_fields_are_neither_listed_nor_accepted():
    assert "forward_microbatches" not in option_names()
    assert not [name for name in option_names() if name.startswith("_")]
    with pytest.raises(TypeError, match="forward_microbatches"):
        check_option_names({"forward_microbatches": 2}, option_names() + ("forward_microbatches", "_x"), "here")
    with pytest.raises(TypeError, match="'_x'"):
        check_option_names({"_x": 2}, ["_x", "verify"], "here")


def test_compile_names_itself_and_suggests():
    with pytest.raises(TypeError) as info:
        harmony_fx.compile(nn.Linear(4, 4), memory_budgt="1MiB")
    listed = _check_message(str(info.value), "harmony_fx.compile", "memory_budgt", "memory_budget")
    assert set(listed) == set(option_names())


def test_compile_refuses_the_internal_forward_microbatches():
    with pytest.raises(TypeError, match=r"harmony_fx\.compile got the unknown option 'forward_microbatches'"):
        harmony_fx.compile(nn.Linear(4, 4), forward_microbatches=2)


@pytest.mark.parametrize("unknown,suggestion", [("max_grad_norms", "max_grad_norm"), ("memory_budgt", "memory_budget")])
def test_trainer_names_itself_and_lists_its_own_keywords_too(unknown, suggestion, monkeypatch):
    def no_compiling(*args, **kwargs):
        raise AssertionError("the Trainer compiled before refusing an unknown option")

    monkeypatch.setattr(harmony_fx.trainer, "HarmonyModule", no_compiling)
    with pytest.raises(TypeError) as info:
        four_pack_trainer(**{unknown: 1.0})
    message = str(info.value)
    assert "CompileOptions" not in message
    listed = _check_message(message, "harmony_fx.Trainer", unknown, suggestion)
    assert {"max_grad_norm", "loss_reduction", "atomic"} <= set(listed)


def test_backend_names_itself_and_suggests():
    torch._dynamo.reset()
    try:
        compiled = torch.compile(nn.Sequential(nn.Linear(4, 4)), backend="harmony", options={"memory_budgt": "1MiB"})
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
            compiled(torch.randn(8, 4))
    finally:
        torch._dynamo.reset()
    message = str(info.value)
    assert 'torch.compile(backend="harmony") options got the unknown option' in message
    assert "did you mean 'memory_budget'?" in message
    assert "memory_budget, microbatches" in message  # the sorted list
    assert "forward_microbatches" not in message
