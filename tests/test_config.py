"""config: sizes such as "2GiB", and the options dataclass."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from harmony_fx.config import CompileOptions, format_size, options_from_environment, parse_size, with_environment


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2**31),
    ("1.5GB", 1_500_000_000),
    ("1.5 GB", 1_500_000_000),
    ("512MiB", 512 * 2**20),
    ("512mib", 512 * 2**20),
    ("1k", 1024),
    ("1kb", 1000),
    ("100", 100),
    ("100B", 100),
    (" 3 TiB ", 3 * 2**40),
    (".5KiB", 512),
    (1048576, 1048576),
    (7, 7),
    (2.5e3, 2500),
    ("1e9", 10**9),
    ("2.5e3KiB", 2560000),
    (None, None),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "2 GiBs", "GiB", "2GiB!", "1e", "-5MiB", "1,000", "two GB", "0", "0GiB",
                                  "0.1B"])
def test_bad_size_strings_are_refused_with_an_example(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text) in message
    if text not in ("0", "0GiB", "0.1B"):
        assert "2GiB" in message or "512MiB" in message  # shows how to write one


@pytest.mark.parametrize("value", [0, -1, -0.5])
def test_non_positive_sizes_are_refused(value):
    with pytest.raises(ValueError, match="positive"):
        parse_size(value)


@pytest.mark.parametrize("value,why", [(1.5, "whole number"), (float("inf"), "finite"), (float("nan"), "finite")])
def test_a_number_of_bytes_must_be_whole_and_finite(value, why):
    """1.5 was read as 1 byte, and infinity raised Python's OverflowError."""
    with pytest.raises(ValueError, match=why):
        parse_size(value)


def test_bool_is_not_a_size():
    with pytest.raises(TypeError):
        parse_size(True)


@pytest.mark.parametrize("num_bytes,text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (2**31, "2.00 GiB"),
                                            (3 * 2**40, "3.00 TiB"), (2**50, "1024.00 TiB")])
def test_format_size(num_bytes, text):
    assert format_size(num_bytes) == text


def test_compile_options_parse_the_budget_and_are_frozen():
    options = CompileOptions(memory_budget="1MiB", microbatches=2, parallel="dp")
    assert options.memory_budget == 2**20
    assert options.verify and options.track_memory is None  # resolved by ``tracks_memory``
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.memory_budget = 5


@pytest.mark.parametrize("kwargs", [{"microbatches": 0}, {"microbatches": 1.5}, {"parallel": "tp"},
                                    {"memory_budget": "huge"}])
def test_compile_options_refuse_bad_values(kwargs):
    with pytest.raises(ValueError):
        CompileOptions(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"grouping": "no"}, "grouping must be True or False, got 'no'"),
    ({"precision": "bf16", "frozen_to_bf16": "no"}, "frozen_to_bf16 must be True or False"),
    ({"verify": 0}, "verify must be True or False"), ({"timeline": None}, "timeline must be True or False"),
    ({"compile_packs": "yes"}, "compile_packs must be True or False (or None)"),
    ({"chaos": "x"}, "chaos must be an int seed"),
])
def test_a_flag_that_is_not_a_bool_is_refused(kwargs, message):
    """A string is true: grouping="no" turned grouping on, frozen_to_bf16="no" converted the weights."""
    with pytest.raises(TypeError, match=re.escape(message)):
        CompileOptions(**kwargs)


def test_numpys_flags_and_counts_are_taken_as_pythons():
    """Options read from a sweep's table arrive as NumPy scalars, which mean what Python's do."""
    import numpy

    options = CompileOptions(verify=numpy.True_, grouping=numpy.False_, chaos=numpy.int64(3), microbatches=numpy.int64(2))
    assert (options.verify, options.grouping, options.chaos, options.microbatches) == (True, False, 3, 2)
    assert type(options.grouping) is bool and type(options.microbatches) is int


def test_microbatches_true_is_not_one_microbatch():
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        CompileOptions(microbatches=True)


def test_memory_tracking_is_off_by_default_outside_the_tests(monkeypatch):
    monkeypatch.setattr("harmony_fx.config.TRACK_MEMORY_BY_DEFAULT", False)
    assert not CompileOptions().tracks_memory
    assert CompileOptions(track_memory=True).tracks_memory
    monkeypatch.setattr("harmony_fx.config.TRACK_MEMORY_BY_DEFAULT", True)  # as conftest sets it
    assert CompileOptions().tracks_memory and not CompileOptions(compile_packs=True).tracks_memory


def test_options_from_the_environment_are_parsed_and_named_by_their_variable():
    environ = {"HARMONY_FX_MEMORY_BUDGET": "2GiB", "HARMONY_FX_DEVICES": "cuda:0, cuda:1", "HARMONY_FX_MICROBATCHES": "4",
               "HARMONY_FX_CACHE": "/tmp/cache", "PATH": "/bin"}
    assert options_from_environment(environ) == {"memory_budget": "2GiB", "devices": ["cuda:0", "cuda:1"],
                                                 "microbatches": 4}
    assert options_from_environment({"HARMONY_FX_DEVICES": "2"}) == {"devices": 2}
    with pytest.raises(ValueError, match="HARMONY_FX_MEMORY_BUDGT is not one of harmony_fx's .did you mean "
                                         "HARMONY_FX_MEMORY_BUDGET"):
        options_from_environment({"HARMONY_FX_MEMORY_BUDGT": "2GiB"})
    with pytest.raises(ValueError, match="HARMONY_FX_MEMORY_BUDGET='lots' .harmony_fx's memory_budget option"):
        options_from_environment({"HARMONY_FX_MEMORY_BUDGET": "lots"})
    with pytest.raises(ValueError, match="HARMONY_FX_PRECISION='fp16'.*'fp32' or 'bf16'"):
        options_from_environment({"HARMONY_FX_PRECISION": "fp16"})


def test_options_the_code_passes_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("HARMONY_FX_MEMORY_BUDGET", "2GiB")
    monkeypatch.setenv("HARMONY_FX_MICROBATCHES", "4")
    assert with_environment({"microbatches": 2}) == {"memory_budget": "2GiB", "microbatches": 2}


def test_a_trainer_option_at_a_door_that_does_not_step_the_optimizer_says_where_it_goes():
    """compile(max_grad_norm=1.0) was told to "correct the name", which is right."""
    import inspect

    import harmony_fx
    from harmony_fx.config import TRAINER_OPTIONS

    own = [name for name, p in inspect.signature(harmony_fx.Trainer.__init__).parameters.items()
           if p.kind is p.KEYWORD_ONLY]
    assert sorted(own) == sorted(TRAINER_OPTIONS)
    with pytest.raises(TypeError, match=r"harmony_fx.compile does not take 'max_grad_norm': it is an option of "
                                        r"harmony_fx.Trainer.*clip_grad_norm_"):
        harmony_fx.compile(torch.nn.Linear(2, 2), max_grad_norm=1.0)
