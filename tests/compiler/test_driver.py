"""compile_program: the stages it runs, in order, what ``print(hm.passes)`` shows, and errors that
name the stage they came from."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.models import MLPChain
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
    assert hm.devices[0].name in decisions["resolve devices"]


def test_fixed_options_skip_the_search_stages():
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=4)
    hm = harmony_fx.compile(model, torch.randn(8, 16), microbatches=2, pack_boundaries=(0, 2))
    names = [stage.name for stage in hm.passes]
    assert "choose schedule" not in names
    # the whole batch's graph is what a cut by hand is judged and compared by (its sizes, not a microbatch's)
    assert names.index("capture microbatches") < names.index("capture whole batch") < names.index("analyze batch")
    compared = names.index("compare with the whole batch")
    assert names.index("analyze batch") < compared < names.index("plan packs")
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


# ----------------------------------------------------------------------------------- falling back


def _train_like_eager(trainer, model, reference, batch, loss_of, steps: int = 2) -> None:
    """``steps`` SGD steps of ``trainer`` next to the same steps in eager: losses and parameters."""
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    try:
        for step in range(steps):
            loss = trainer.step(batch)
            expected = loss_of(reference, batch)
            expected.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step}: {m}")
    finally:
        trainer.close()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_planner_choice_that_cannot_be_captured_falls_back_and_trains_like_eager(monkeypatch):
    """A padded Hugging Face GPT-2 batch of 4, forward microbatches of 2 and backward ones of 1 (the
    planner's first choice, forced here: which one the planner makes depends on its cost model):
    export captures another graph at size 1 (a ``contiguous`` in the loss is a no-op there and
    disappears). The planner's next schedule, one microbatch size, compiles; the log shows both
    tries, and the Trainer trains as eager does."""
    pytest.importorskip("transformers")
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.compiler import driver
    from harmony_fx.planner.chain import Schedule
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    one_pack = dict(boundaries=(0,), microbatches=4, parallel="single", devices=1)
    monkeypatch.setattr(driver, "choose_schedules", lambda *args: (
        Schedule(**one_pack, forward_microbatches=2), Schedule(**one_pack)))

    model = build_hf_model("gpt2")
    reference = copy.deepcopy(model)
    batch = hf_batch("gpt2", batch=4)
    batch["attention_mask"][1:, -4:] = 0  # padding, as a collator pads to the longest sequence
    budget = int(eager_training_bytes(model, (), lambda out: out.loss, batch) / 1.5)
    trainer = harmony_fx.Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                                 memory_budget=budget)
    stages = list(trainer.hm.passes)
    names = [stage.name for stage in stages]
    fell_back = names.index("fall back")
    assert stages[fell_back - 1].name == "capture microbatches"
    assert "microbatch size 2 differs from the graph at size 1" in stages[fell_back - 1].decision
    assert "2 in the forward" in stages[fell_back].decision and "trying the planner's" in stages[fell_back].decision
    assert names[fell_back + 1:].count("capture microbatches") == 1 and "codegen" in names[fell_back + 1:]
    assert trainer.plan.forward_microbatches == trainer.hm.num_microbatches  # one microbatch size
    _train_like_eager(trainer, model, reference, batch, lambda m, b: m(**b).loss)


def test_when_every_schedule_fails_the_error_says_what_was_tried(monkeypatch):
    """The planner's schedules fail (forced here), then the options' own, then one sample per
    microbatch: the last one's refusal is raised, a ``BudgetTooSmallError`` with its
    ``smallest_budget`` (what callers read), saying what was tried before and why each failed."""
    from harmony_fx.compiler import driver

    def fails(schedule, options, *args):
        if schedule is not None:
            raise ValueError(f"no layout for {schedule.microbatches} microbatches")
        raise harmony_fx.BudgetTooSmallError("plan_packs: does not fit",
                                             smallest_budget=678 if options.microbatches else 12345)

    monkeypatch.setattr(driver, "decide_layout", fails)
    torch.manual_seed(0)
    hm = harmony_fx.compile(MLPChain(width=32, depth=6), memory_budget="24KiB")  # the planner: 2 microbatches
    x = torch.randn(16, 32)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as info:
        hm(x)
    assert info.value.smallest_budget == 678
    message = str(info.value)
    assert message.startswith("plan_packs: no packing fits the memory budget of 24,576 bytes; the smallest budget "
                              "that fits is 678 bytes (678 B), with one sample per microbatch (16 microbatches)")
    tried = re.findall(r"^  - the planner's (.*): ValueError: no layout for (\d+) microbatches$", message, re.M)
    assert tried and all(f"{count} microbatches" in what for what, count in tried), message


def _refused(model, x, **options):
    with pytest.raises(harmony_fx.BudgetTooSmallError) as info:
        harmony_fx.compile(model, (x,), memory_budget=1, **options)
    return info.value


@pytest.mark.parametrize("batch, fewest", [(16, "one microbatch"), (64, "one sample per microbatch")])
def test_a_refusal_names_the_smaller_of_one_microbatch_and_one_sample_each(batch, fewest, monkeypatch):
    """With the microbatches left to the planner, the smallest budget named is the smaller of one
    microbatch's and one sample per microbatch's, each a compile of its own with the microbatches
    fixed: a short batch (weights outweigh activations) fits one microbatch in less, a long batch
    a sample at a time. A compile at that budget fits, the planner free, and trains as eager; a
    byte less is refused."""
    torch.manual_seed(0)
    model, x = MLPChain(width=64, depth=6), torch.randn(batch, 64)
    whole = _refused(model, x, microbatches=1).smallest_budget
    each = _refused(model, x, microbatches=256).smallest_budget
    runs_in_full = _runs_in_full(monkeypatch)
    refusal = _refused(model, x)
    monkeypatch.undo()
    assert refusal.smallest_budget == min(whole, each)
    if fewest == "one sample per microbatch":  # one microbatch's bound passes it: never counted
        assert 1 not in runs_in_full and re.search(r"one microbatch needs at least [\d.]+ KiB", str(refusal))
    assert (whole < each) == (fewest == "one microbatch")
    assert f"smallest budget that fits is {min(whole, each):,} bytes" in str(refusal)
    # it names both counts: no internal refusal ("... not counted yet") chained under it in the traceback
    assert refusal.__cause__ is None and refusal.__suppress_context__
    assert re.search(rf"fits is {min(whole, each):,} bytes \([^)]*\), with {fewest}", str(refusal)), refusal
    hm = harmony_fx.compile(model, (x,), memory_budget=refusal.smallest_budget)
    reference = copy.deepcopy(model)
    hm(x).square().mean().backward()
    assert hm.stats.peak_bytes["host:0"] <= refusal.smallest_budget  # measured on the HostDevice
    reference(x).square().mean().backward()
    assert_grads_equal(model, reference)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as info:
        harmony_fx.compile(model, (x,), memory_budget=refusal.smallest_budget - 1)(x)
    assert info.value.smallest_budget == refusal.smallest_budget


def test_a_batch_cut_to_one_sample_each_says_why_in_the_plan(monkeypatch):
    """The planner's schedules left out (as where its estimate fits nothing): one microbatch does
    not fit, one sample each does, and the plan says so."""
    from harmony_fx.compiler import driver

    torch.manual_seed(0)
    model, x = MLPChain(width=64, depth=6), torch.randn(64, 64)
    budget = _refused(model, x).smallest_budget
    monkeypatch.setattr(driver, "choose_schedules", lambda *args, **kwargs: ())
    runs_in_full = _runs_in_full(monkeypatch)
    hm = harmony_fx.compile(model, (x,), memory_budget=budget)
    hm(x)
    assert hm.compiled.layout.num_microbatches == 64
    assert "policy balanced, one sample per microbatch (64 microbatches): one microbatch does not fit" in str(hm.plan)
    # one microbatch's smallest budget is never counted (a run in full of its most packs): no refusal needs it
    assert 1 not in runs_in_full, runs_in_full


def _runs_in_full(monkeypatch) -> list[int]:
    """The microbatch counts of the packings the compile runs in full (not cut short at the budget)."""
    from harmony_fx.compiler import driver

    counts, evaluate = [], driver.evaluate

    def recorded(context, boundaries, limit=None, **kwargs):
        if limit is None:
            counts.append(context.layout.num_microbatches)
        return evaluate(context, boundaries, limit, **kwargs)

    monkeypatch.setattr(driver, "evaluate", recorded)
    return counts


@pytest.mark.parametrize("why", ["dropout", "mixes samples"])
def test_where_microbatches_change_the_results_the_refusal_names_one_microbatch(why):
    """Dropout draws per microbatch; a softmax over the batch mixes samples: the planner keeps the
    batch whole, and so does the smallest budget a refusal names."""
    torch.manual_seed(0)
    if why == "dropout":
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 32))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Softmax(dim=0), torch.nn.Linear(64, 32))
    x = torch.randn(8, 32)
    refusal = _refused(model, x)
    assert "one sample per microbatch" not in str(refusal), refusal
    assert refusal.smallest_budget == _refused(model, x, microbatches=1).smallest_budget


def test_where_a_sample_alone_cannot_be_compiled_the_one_microbatch_refusal_stands(monkeypatch):
    """The graph of one sample fails (forced here): the options' own refusal is raised, naming
    their smallest budget (a compile with one microbatch names the same), saying what was tried."""
    from harmony_fx.compiler import driver

    captured = driver.cached_capture

    def no_single_sample(model, size, *args):
        if size == 1:
            raise ValueError("this graph cannot be captured for one sample")
        return captured(model, size, *args)

    torch.manual_seed(0)
    model, x = MLPChain(width=64, depth=6), torch.randn(16, 64)
    whole = _refused(model, x, microbatches=1).smallest_budget
    monkeypatch.setattr(driver, "cached_capture", no_single_sample)
    refusal = _refused(model, x)
    assert refusal.smallest_budget == whole
    assert re.search(r"^  - one sample per microbatch \(16 microbatches\): ValueError: this graph cannot be "
                     r"captured for one sample$", str(refusal), re.M), refusal


def test_an_error_of_the_options_own_settings_is_unchanged_without_a_planner():
    torch.manual_seed(0)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as info:
        harmony_fx.compile(MLPChain(width=16, depth=4), torch.randn(8, 16), microbatches=2, memory_budget=1024)
    assert "tried" not in str(info.value)


# ----------------------------------------------------------------------------------- losses


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                         torch.nn.Linear(32, 32), torch.nn.Tanh())
        self.first, self.second = torch.nn.Linear(32, 8), torch.nn.Linear(32, 4)

    def forward(self, x):
        h = self.trunk(x)
        return self.first(h), self.second(h)


def _sum_of_means(out):
    return out[0].pow(2).mean() + out[1].abs().mean()


@pytest.mark.parametrize("microbatches", [8, {"forward": 2, "backward": 8}], ids=["int", "split"])
def test_a_sum_of_batch_means_trains_like_eager_with_either_microbatches(microbatches):
    """The same loss, understood once (``analysis.reductions.scalar_reduction``): the int microbatches weigh
    it as the split does, and the split takes it (a linear combination of batch means is
    separable)."""
    torch.manual_seed(0)
    model = _TwoHeads()
    reference = copy.deepcopy(model)
    x = torch.randn(20, 8)  # microbatches of 3 and 2 samples: weighted by their shares of the batch
    # loss_reduction="sum" is the Trainer's guess where the graph does not say; here it says
    trainer = harmony_fx.Trainer(model, _sum_of_means, torch.optim.SGD(model.parameters(), lr=0.1), x,
                                 microbatches=microbatches, pack_boundaries=(0, 2, 4), loss_reduction="sum")
    assert trainer.hm.num_microbatches == 8 and trainer.hm.batch_analysis.separable
    assert trainer.plan.forward_microbatches == (2 if isinstance(microbatches, dict) else 8)
    _train_like_eager(trainer, model, reference, x, lambda m, b: _sum_of_means(m(b)))


def test_a_compile_past_two_seconds_says_on_stderr_which_stage_and_candidate(monkeypatch, capsys):
    """Each read of the clock a second later than the one before: the compile is past two seconds
    by its packing search, which says on stderr that it started and each candidate it ran."""
    from harmony_fx.compiler import stages

    ticks = iter(range(10**6))
    monkeypatch.setattr(stages.time, "perf_counter", lambda: float(next(ticks)))
    torch.manual_seed(0)
    harmony_fx.compile(MLPChain(width=32, depth=6), (torch.randn(16, 32),), memory_budget="64KiB", microbatches=2)
    lines = capsys.readouterr().err.splitlines()
    assert any(re.fullmatch(r"harmony_fx compile, \d+\.\d s: plan packs: started", line) for line in lines), lines
    candidates = [line for line in lines if re.search(r"plan packs: candidate \d+: \d+ of at most \d+ packs", line)]
    assert candidates and not any("codegen" in line for line in lines)


def test_a_planner_packing_that_does_not_fit_is_searched_again_at_its_microbatches(monkeypatch):
    """The planner's packing comes from its cost model; where the exact count refuses it, its
    microbatches (captured already) are kept and the packs searched for them, rather than falling
    back to another schedule and capturing again."""
    from harmony_fx.compiler import driver
    from harmony_fx.planner.chain import Schedule

    def one_pack_on_four_microbatches(gm, model, batch, devices, *args):
        return (Schedule(boundaries=(0,), microbatches=4, parallel="single", devices=1),)

    monkeypatch.setattr(driver, "choose_schedules", one_pack_on_four_microbatches)
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=6)
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, memory_budget="24KiB")  # one pack of the whole model needs more
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    F.cross_entropy(hm(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    assert_grads_equal(model, reference)
    names = [stage.name for stage in hm.passes]
    assert names.count("plan packs") == 2 and "fall back" not in names and names.count("capture microbatches") == 1
    assert hm.num_microbatches == 4 and len(hm.packs) > 1
    assert hm.plan.policy == "balanced at the planner's microbatches"


def test_when_the_planners_estimate_fits_nothing_its_closest_schedules_get_the_exact_count(monkeypatch):
    """The planner's estimate of a peak is meant to stay above the exact count, so where it finds
    every schedule over the budget (a T5 at a quarter of eager's memory: the closest estimated at
    2.18 MiB of 2.14), the closest still compiles if the planning run's count accepts it, rather than
    falling back to the options' own single microbatch and refusing the budget."""
    from harmony_fx.planner import choose
    from harmony_fx.planner.chain import Schedule
    from harmony_fx.planner.search import PlanningError

    closest = Schedule(boundaries=(0, 2, 4), microbatches=4, parallel="single", devices=1)

    def estimated_over_the_budget(*args, **kwargs):
        raise PlanningError("search: every simulated schedule exceeds the device budget", [(closest, 10**9)])

    monkeypatch.setattr(choose, "search", estimated_over_the_budget)
    model, hm, x, y = _readme_example()
    reference = copy.deepcopy(model)
    F.cross_entropy(hm(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    assert_grads_equal(model, reference)
    assert hm.num_microbatches == 4 and "fall back" not in [stage.name for stage in hm.passes]
    assert hm.schedule.budget_note.startswith("the planner's estimate of every schedule it simulated passed")


class _Centered(torch.nn.Module):
    """Subtracts the batch's mean: each sample's output depends on the others'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0)


@pytest.mark.parametrize("mixes", [False, True])
def test_microbatches_of_one_sample_are_judged_on_the_whole_batch(mixes):
    """A microbatch of one sample cannot show samples apart, so the warning that microbatches may
    change the result is decided on the whole batch's graph: none for an MLP (it was given, naming
    "a batch of one sample"), one for a model that centres the batch."""
    import warnings

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), _Centered() if mixes else torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    hm = harmony_fx.compile(torch.nn.Sequential(*layers), devices=["host:0"], microbatches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm(torch.randn(2, 8))
    messages = [str(warning.message) for warning in caught if "cannot show" in str(warning.message)]
    assert len(messages) == mixes
    assert not any("one sample" in message for message in messages)


@pytest.mark.parametrize("microbatches,dropout,warned", [(2, 0.5, True), (1, 0.5, False), (2, 0.0, False)])
def test_microbatches_set_by_hand_on_a_model_that_draws_say_so(microbatches, dropout, warned):
    """Each microbatch draws its own dropout masks: the step differs from eager's in value (only in
    distribution), which went unsaid; with one microbatch, or nothing drawn, nothing is said."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        harmony_fx.compile(model, (torch.randn(4, 8),), devices=["host:0"], microbatches=microbatches)
    said = [str(w.message) for w in caught if issubclass(w.category, harmony_fx.RandomDrawsPerMicrobatch)]
    assert len(said) == warned
    assert all("draws random numbers (dropout" in message and "microbatches=1" in message for message in said)


class _OtherGraphForOneSample(torch.nn.Module):
    """Captures another graph for one sample than for several (an op only a batch of two or more
    runs, computing nothing new), as export does for some models."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if x.shape[0] > 1:
            h = h + 0.0
        return self.second(h)


def test_a_batch_whose_microbatches_capture_other_graphs_is_cut_into_microbatches_of_one_size(monkeypatch):
    """An epoch's last batch of 3 in microbatches=2 is cut 2 and 1, whose graphs differ: it runs in
    3 microbatches of 1, trains as eager and the plan says why; where those fail too, the first
    error stands, saying what was tried."""
    torch.manual_seed(0)
    model = _OtherGraphForOneSample()
    reference = copy.deepcopy(model)
    hm = harmony_fx.compile(model, microbatches=2, devices=["host:0"])
    for batch in (4, 3):
        x = torch.randn(batch, 8)
        hm(x).square().mean().backward()
        reference(x).square().mean().backward()
        assert_grads_equal(model, reference)
        model.zero_grad(), reference.zero_grad()
    last = hm.for_batch((x,), {})
    assert last.compiled.layout.mb_sizes == (1, 1, 1)
    assert "3 microbatches of 1: microbatches=2 cuts the batch of 3 into sizes 2, 1, whose graphs differ" in str(last.plan)

    from harmony_fx.compiler import driver

    captured, asked = driver.cached_capture, []

    def second_of_one_sample_fails(model, size, *args):
        asked.append(size)
        if asked.count(1) == 2:  # the microbatches of one size
            raise ValueError("no graph of one sample")
        return captured(model, size, *args)

    monkeypatch.setattr(driver, "cached_capture", second_of_one_sample_fails)
    with pytest.raises(ValueError, match=r"differs from the graph at size") as refused:
        harmony_fx.compile(_OtherGraphForOneSample(), (torch.randn(3, 8),), microbatches=2, devices=["host:0"])
    assert re.search(r"^  - 3 microbatches of 1: ValueError: no graph of one sample$", str(refused.value), re.M)


def test_a_model_failing_on_a_microbatch_alone_is_told_so_not_that_eager_fails():
    """An unbatched sample ([features]) cut into microbatches by hand: the refusal said the model
    raised on these inputs "as it would called eagerly", which runs them fine."""
    model, x = torch.nn.Linear(3, 5), torch.randn(3)
    model(x)  # eager runs it
    with pytest.raises(harmony_fx.CaptureError, match=r"raises on a microbatch of \d sample\(s\).*not on the whole "
                                                      r"batch(.|\n)*batch_dims=(.|\n)*microbatches=1"):
        harmony_fx.compile(model, x, devices=["host:0"], microbatches=2)


class _FirstThree(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x):
        return (self.linear(x)[:3] ** 2).mean()  # three samples of the batch, whatever its size


def test_a_cut_by_hand_is_judged_on_the_whole_batchs_sizes():
    """A microbatch's graph has its own sizes baked in: on a microbatch of 2, ``h[:3]`` keeps every
    sample, so the analysis of it called the cut separable, silently (loss 1.67 where eager's is
    0.30). The whole batch's graph is judged, and the cut by hand said to compute otherwise."""
    torch.manual_seed(0)
    with pytest.warns(harmony_fx.MicrobatchesComputeApart, match="picks some samples of the batch"):
        hm = harmony_fx.compile(_FirstThree(), torch.randn(4, 5), devices=["host:0"], microbatches=2)
    assert not hm.compiled.batch_analysis.separable


class _Squeezed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(5, 1)

    def forward(self, x):
        return self.head(x).squeeze()  # [B, 1] -> [B]; a microbatch of one sample: a number


def test_an_output_whose_dims_a_microbatch_changes_is_refused_naming_the_op():
    """squeeze() drops a one-sample microbatch's batch dim: its outputs were joined into another
    shape ([20] for [4, 5]) or refused as "one number per microbatch"."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"output 0 \(squeeze\) is \[4\] on the whole batch of 4 and \[\] on a "
                                         r"microbatch of 1.*squeeze\(\) without a dim"):
        harmony_fx.compile(_Squeezed(), torch.randn(4, 5), devices=["host:0"], microbatches=4)
    hm = harmony_fx.compile(_Squeezed(), torch.randn(4, 5), devices=["host:0"], microbatches=2)
    assert hm(torch.randn(4, 5)).shape == (4,)


class _ScatterSizedForTheBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.src = torch.nn.Parameter(torch.randn(1, 5, 5)), torch.nn.Parameter(torch.randn(5, 5))

    def forward(self, x):
        return torch.select_scatter(x * self.w, self.src, 1, 0)  # src sized for a batch of 5, not a microbatch


def test_a_model_failing_on_a_microbatch_only_in_its_backward_is_told_what_to_do():
    """select_scatter's fake kernel does not check src's size: the failure came from autograd inside
    'plan packs' with nothing about microbatches."""
    with pytest.raises(RuntimeError) as raised:
        harmony_fx.compile(_ScatterSizedForTheBatch(), torch.randn(5, 5, 5), devices=["host:0"], microbatches=2)
    assert "raised running the packs on FakeTensors at microbatches of [2, 3]" in "\n".join(raised.value.__notes__)
    assert "batch_dims" in "\n".join(raised.value.__notes__)


class _PooledAtPositions(torch.nn.Module):
    """Each sample's index made before the body and used after it: it crosses packs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 64)
        self.body = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
                                          for _ in range(5)])
        self.head = torch.nn.Linear(64, 3)

    def forward(self, x, pos, y):
        rows = torch.arange(x.shape[0])
        h = self.body(self.embed(x))
        return torch.nn.functional.cross_entropy(self.head(h[rows, pos]), y)


def test_forward_microbatches_over_one_sample_backward_ones_refuse_a_batch_index_crossing_packs():
    """Read on a one-sample graph, no arange was a batch index: the step failed in the runtime with an
    IndexError where it was refused in words."""
    torch.manual_seed(0)
    model = _PooledAtPositions()
    batch = (torch.randn(4, 6, 8), torch.randint(0, 6, (4,)), torch.randint(0, 3, (4,)))
    with pytest.raises(ValueError, match="is each sample's index in the batch .* and crosses packs"):
        harmony_fx.Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.5), batch, devices=["host:0"],
                           memory_budget="80KiB", microbatches={"forward": 2, "backward": 4})


def test_an_epochs_last_batch_cut_into_one_size_drops_forward_microbatches_that_cannot_group_it():
    """{'forward': 2, 'backward': 4} on a last batch of 6 whose sizes 2, 2, 1, 1 capture other graphs:
    the fallback to 3 microbatches of 2 kept 2 forward microbatches, which cannot group 3, and failed
    splitting the batch."""
    torch.manual_seed(0)
    model = _OtherGraphForOneSample()
    reference = copy.deepcopy(model)
    trainer = harmony_fx.Trainer(model, lambda out, y: (out - y).square().mean(),
                                 torch.optim.SGD(model.parameters(), lr=0.0), (torch.randn(8, 8), torch.randn(8, 8)),
                                 devices=["host:0"],
                                 microbatches={"forward": 2, "backward": 4})
    try:
        x, y = torch.randn(6, 8), torch.randn(6, 8)
        loss = trainer.step((x, y))
        torch.testing.assert_close(loss, (reference(x) - y).square().mean())
        assert "the forward's too" in str(trainer.hm.for_batch((x, y), {}).plan)
    finally:
        trainer.close()


class _PowersUpToTheBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 1)

    def forward(self, x):
        return (self.a(x) ** torch.arange(x.shape[0])).sum(1)  # [B, B]: a dim sized by the batch, not per sample


class _CentredWhenSmall(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if x.shape[0] < 4:  # only a microbatch runs it
            h = h - h.mean(0, keepdim=True)
        return h


def test_a_dim_sized_by_the_batch_is_not_cut_by_the_planner_and_is_said_for_a_cut_by_hand():
    """Each op's shapes on a microbatch differ from the whole batch's along one dim at most: [8, 8]
    against [2, 2] is sized by the batch where each sample's own values should be. The planner's cut
    returned outputs off by 1.6, silently; it is kept whole (here: refused, naming the budget that
    fits whole), and a cut by hand is said."""
    torch.manual_seed(0)
    with pytest.raises(harmony_fx.BudgetTooSmallError, match=r"more than its batch dim follows the batch size"):
        harmony_fx.compile(_PowersUpToTheBatch(), torch.randn(8, 4), devices=["host:0"], memory_budget="1KiB")
    with pytest.warns(harmony_fx.MicrobatchesComputeApart, match=r"as \[8, 8\] on the whole batch of 8 and \[4, 4\]"):
        harmony_fx.compile(_PowersUpToTheBatch(), torch.randn(8, 4), devices=["host:0"], microbatches=2)


def test_a_cut_by_hand_whose_microbatches_run_other_ops_is_said():
    """Judged on the whole batch's graph alone, a branch only microbatches take went unsaid."""
    torch.manual_seed(0)
    with pytest.warns(harmony_fx.MicrobatchesComputeApart, match=r"runs mean.* on a microbatch only"):
        harmony_fx.compile(_CentredWhenSmall(), torch.randn(8, 4), devices=["host:0"], microbatches=4)


class _MeanByHand(torch.nn.Module):
    def __init__(self, through: str) -> None:
        super().__init__()
        self.a, self.through = torch.nn.Linear(4, 4), through

    def forward(self, x):
        size = torch.tensor(float(x.shape[0])) if self.through == "tensor" else torch.full((), x.shape[0])
        return self.a(x).pow(2).sum() / size  # the batch size made a tensor: a microbatch's, cut


@pytest.mark.parametrize("through", ["tensor", "full"])
def test_a_mean_by_hand_over_the_batch_size_made_a_tensor_is_not_cut_and_is_said_when_cut_by_hand(through):
    """Each microbatch divided by its own size and the runtime added them up: loss and gradients
    twice eager's for two microbatches, from the planner's own cut."""
    torch.manual_seed(0)
    model = _MeanByHand(through)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    hm = harmony_fx.compile(model, x, devices=["host:0"], memory_budget="1KiB")
    assert hm.num_microbatches == 1
    loss = hm(x)
    loss.backward()
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_grads_equal(model, reference)
    with pytest.warns(harmony_fx.MicrobatchesComputeApart, match="its batch size as a value"):
        harmony_fx.compile(_MeanByHand(through), x, devices=["host:0"], microbatches=2)


class _ExpandedToFive(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(1, 1), torch.nn.Linear(5, 5)

    def forward(self, x):
        return self.second(self.first(x).expand(5, 5, 5))  # the batch of 5 written as a number


def test_a_batch_dim_written_as_a_number_is_not_cut():
    """One sample expanded to the whole batch's literal shape computed the batch from one sample: the
    Trainer's one-sample microbatches gave 5x eager's loss, a cut by hand (25, 5, 5) for (5, 5, 5)."""
    torch.manual_seed(0)
    model = _ExpandedToFive()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 1, 1)
    y = torch.zeros(5)
    trainer = harmony_fx.Trainer(model, lambda out, y: out.sin().sum() + y.sum(),
                                 torch.optim.SGD(model.parameters(), lr=0.0), (x, y), devices=["host:0"],
                                 memory_budget="1GiB")
    try:
        torch.testing.assert_close(trainer.step((x, y)), reference(x).sin().sum())
    finally:
        trainer.close()
    with pytest.raises(ValueError, match=r"output 0 \(\w+\) is \[5, 5, 5\] on the whole batch of 5 and \[5, 5, 5\] "
                                         r"on a microbatch of 1.*h\.expand\(5, 5, 5\)"):
        harmony_fx.compile(_ExpandedToFive(), x, devices=["host:0"], microbatches=5)


class _Diagonal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x):
        return torch.diagonal(self.linear(x))  # entry i of sample i


def test_data_parallel_over_a_batch_it_cannot_show_apart_is_refused_where_the_microbatches_are_not_given():
    """It cut the batch into one part per device, and warned about "microbatches=2", which nobody set."""
    with pytest.raises(ValueError, match=r"parallel='dp' gives each device its own part of the batch.*diagonal"
                                         r".*parallel='pp' or 'auto'"):
        harmony_fx.compile(_Diagonal(), torch.randn(5, 5), devices=["host:0", "host:1"], parallel="dp")


def test_the_smallest_budget_a_refusal_names_compiles():
    """The options' own packing, counted after one sample per microbatch failed, fitted the budget
    its bound had refused: the compile at the named budget was refused again, naming it again."""
    torch.manual_seed(0)
    x = torch.randn(5, 1, 1)
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        harmony_fx.compile(_ExpandedToFive(), x, devices=["host:0"], memory_budget=1)
    hm = harmony_fx.compile(_ExpandedToFive(), x, devices=["host:0"], memory_budget=refused.value.smallest_budget)
    assert max(hm.plan.predicted_peak.values()) <= refused.value.smallest_budget


def test_a_refusal_with_fixed_packs_says_the_planner_chose_no_microbatches():
    """With pack_boundaries the planner's search does not run: a budget that microbatches would fit
    was refused with nothing about them."""
    with pytest.raises(harmony_fx.BudgetTooSmallError) as refused:
        harmony_fx.compile(MLPChain(width=32, depth=4), torch.randn(16, 32), devices=["host:0"], memory_budget=1,
                           pack_boundaries=[0, 2])
    assert "pass microbatches=N to cut the batch" in "\n".join(refused.value.__notes__)
