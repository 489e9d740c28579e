"""The compile driver's log: every stage that ran, in order, with its time and what it decided.

``hm.passes`` is one; ``print(hm.passes)`` shows it as a table. ``StageLog.run(name, fn, ...)``
times a stage and records its one-line summary; if the stage raises, it is recorded as such and a
note naming it (and the stages before it) is added to the error, whose type and message stay as
they were::

    stage                time      decision
    -------------------  --------  -----------------------------------------------
    resolve devices      0.0 ms    host:0, budget 24.00 KiB
    capture whole batch  312.5 ms  torch.export: 14 layers, 1,290 parameters
    ...

Progress: once a compile has run for ``PROGRESS_AFTER`` seconds, the log tells its ``progress``
sink (``progress_to_stderr``: a line on stderr) each of the ``announced`` stages it starts (those
that may take long) and what a stage reports on the way (``report``: the packing search, each
candidate it runs). A short compile says nothing.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, Iterator

from harmony_fx.program.format import format_table

__all__ = ["Stage", "StageLog", "PROGRESS_AFTER", "progress_to_stderr"]

PROGRESS_AFTER = 2.0  # seconds a compile runs before it says what it is doing


def progress_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    seconds: float
    decision: str


class StageLog:
    """The stages run so far (``list(log)``); printable. ``progress``: where to say what the
    compile is doing once it has run for ``PROGRESS_AFTER`` seconds; ``announced``: the stages
    whose start it says."""

    def __init__(self, progress: Callable[[str], None] | None = None, announced: frozenset[str] = frozenset()) -> None:
        self._stages: list[Stage] = []
        self._progress = progress
        self._announced = announced
        self._started = time.perf_counter()
        self._running = ""  # the stage running now

    def run(self, name: str, fn: Callable[..., Any], *args: Any,
            decision: Callable[[Any], str] | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as the stage ``name``; ``decision(result)`` is its summary."""
        self._running = name
        if name in self._announced:
            self.report("started")
        started = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except Exception as error:
            before = ", ".join(stage.name for stage in self._stages) or "none"
            error.add_note(f"harmony_fx: raised in the compile stage {name!r} (after: {before})")
            first_line = (str(error).strip().splitlines() or [""])[0]
            self._stages.append(Stage(name, time.perf_counter() - started,
                                      f"raised {type(error).__name__}: {first_line[:100]}"))
            raise
        self._stages.append(Stage(name, time.perf_counter() - started, decision(result) if decision else ""))
        return result

    def report(self, what: str) -> None:
        """Tell the progress sink ``what`` the running stage does, once the compile has run for
        ``PROGRESS_AFTER`` seconds."""
        elapsed = time.perf_counter() - self._started
        if self._progress is not None and elapsed >= PROGRESS_AFTER:
            self._progress(f"harmony_fx compile, {elapsed:.1f} s: {self._running}: {what}")

    def add(self, name: str, seconds: float, decision: str) -> None:
        """A stage timed elsewhere (the packs' inductor compiles, which happen on the first calls)."""
        self._stages.append(Stage(name, seconds, decision))

    def __add__(self, other: "StageLog") -> "StageLog":
        """A new log of this one's stages, then ``other``'s (``hm.passes``: the compile's, then
        those after it)."""
        joined = StageLog()
        joined._stages = [*self._stages, *other._stages]
        return joined

    def __iter__(self) -> Iterator[Stage]:
        return iter(self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    def names(self) -> list[str]:
        return [stage.name for stage in self._stages]

    @property
    def seconds(self) -> float:
        return sum(stage.seconds for stage in self._stages)

    def __str__(self) -> str:
        rows = [(stage.name, f"{stage.seconds * 1e3:.1f} ms", stage.decision) for stage in self._stages]
        rows.append(("total", f"{self.seconds * 1e3:.1f} ms", ""))
        return format_table(("stage", "time", "decision"), rows)

    def __repr__(self) -> str:
        return f"StageLog({', '.join(self.names())})"
