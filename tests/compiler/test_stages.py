"""StageLog: every stage timed and logged; a compile past two seconds says what it is doing."""
from __future__ import annotations

import pytest

from harmony_fx.compiler import stages
from harmony_fx.compiler.stages import PROGRESS_AFTER, StageLog


class _Clock:
    """``time.perf_counter`` as the log reads it, moved by the test (no test depends on how fast
    this machine is)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(stages.time, "perf_counter", clock)
    return clock


def test_a_compile_past_two_seconds_says_its_slow_stages_and_their_reports(clock):
    said: list[str] = []
    log = StageLog(progress=said.append, announced=frozenset({"plan packs"}))
    log.run("capture", lambda: None)
    log.run("plan packs", lambda: log.report("candidate 1: 2 of at most 9 packs"))
    assert said == []  # a short compile says nothing
    clock.now += PROGRESS_AFTER

    def search() -> None:
        log.report("candidate 1: 2 of at most 9 packs")
        clock.now += 1.5
        log.report("candidate 2: 9 of at most 9 packs")

    log.run("plan packs", search)
    log.run("codegen", lambda: None)  # not announced: it takes milliseconds
    assert said == ["harmony_fx compile, 2.0 s: plan packs: started",
                    "harmony_fx compile, 2.0 s: plan packs: candidate 1: 2 of at most 9 packs",
                    "harmony_fx compile, 3.5 s: plan packs: candidate 2: 9 of at most 9 packs"]
    assert log.names() == ["capture", "plan packs", "plan packs", "codegen"]


def test_without_a_sink_the_log_says_nothing(clock, capsys):
    log = StageLog()
    clock.now += 10 * PROGRESS_AFTER
    log.run("plan packs", lambda: log.report("candidate 1"))
    assert capsys.readouterr() == ("", "")
