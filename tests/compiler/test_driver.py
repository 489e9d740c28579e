"""compile_program: the stages it runs, in order, what ``print(hm.passes)`` shows, and errors that
name the stage they came from."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.testing.models import MLPChain
from tests.helpers import assert_grads_equal

STAGES_WITH_SEARCH = ["resolve devices", "capture whole batch", "analyze batch", "choose schedule", "lay out",
                      "capture microbatches", "signature", "plan packs", "annotate packs", "check peak",
                      "codegen", "plan"]


def _readme_example(**options):
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=6)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    return model, harmony_fx.compile(model, memory_budget="64KiB", **options), x, y


def test_the_readme_example_lists_every_stage_with_its_time():
    model, hm, x, y = _readme_example()
    reference = copy.deepcopy(model)
    F.cross_entropy(hm(x), y).backward()  # compiled on this first call
    F.cross_entropy(reference(x), y).backward()
    assert_grads_equal(model, reference)
    assert [stage.name for stage in hm.passes] == STAGES_WITH_SEARCH
    printed = str(hm.passes)
    lines = printed.splitlines()
    for stage in hm.passes:
        row = next(line for line in lines if line.startswith(stage.name + "  "))
        assert re.search(r"\d+\.\d ms", row), row
        assert stage.seconds >= 0
    assert lines[-1].startswith("total")
    total = float(re.search(r"(\d+\.\d) ms", lines[-1]).group(1))
    assert total == pytest.approx(sum(stage.seconds for stage in hm.passes) * 1e3, abs=0.1)
    # the decisions are what the artifact holds
    decisions = {stage.name: stage.decision for stage in hm.passes}
    assert f"{len(hm.packs)} pack(s)" in decisions["plan packs"]
    assert f"{2 * len(hm.devices)} program(s)" in decisions["codegen"]
    assert hm.device.name in decisions["resolve devices"]


def test_fixed_options_skip_the_search_stages():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    hm = harmony_fx.compile(model, torch.randn(8, 16), microbatches=2, pack_boundaries=(0, 2))
    names = [stage.name for stage in hm.passes]
    assert "choose schedule" not in names and "capture whole batch" not in names
    assert names.index("capture microbatches") < names.index("analyze batch") < names.index("plan packs")
    assert "fixed: 2 pack(s)" in dict((s.name, s.decision) for s in hm.passes)["plan packs"]


def test_an_error_names_the_stage_it_was_raised_in():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as info:
        harmony_fx.compile(model, torch.randn(8, 16), microbatches=2, memory_budget=1024)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "compile stage 'plan packs'" in notes
    assert "resolve devices" in notes and "signature" in notes  # the stages that ran before it
    assert info.value.smallest_budget > 1024  # the error itself is unchanged


def test_a_capture_error_names_its_stage():
    class Untraceable(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: neither export nor symbolic_trace
                return x * 2
            return x

    with pytest.raises(harmony_fx.CaptureError) as info:
        harmony_fx.compile(Untraceable(), torch.randn(4, 3), microbatches=1)
    assert any("compile stage 'capture microbatches'" in note for note in info.value.__notes__)
