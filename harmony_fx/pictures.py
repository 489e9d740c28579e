"""Pictures of the last iteration: the measured timeline as a Chrome trace, and memory over time.

``save_trace``: one process per device, one row per stream (compute, host→device, device→host,
peer), every op as a span, and the device's memory as a counter; open it in ``chrome://tracing``
or https://ui.perfetto.dev. ``plot_memory``: per device, memory measured after every op next to
the simulator's prediction for the same programs (the caller simulates them: ``planner.module``),
with the budget; time is shown as a fraction of each one's iteration, so the shapes compare (the
totals are in the legend).
"""
from __future__ import annotations

import os

from harmony_fx.trace import chrome_events, write_trace

__all__ = ["save_trace", "plot_memory"]


def save_trace(hm, path: str | os.PathLike) -> None:
    stats = hm.stats
    if not stats.recording:
        raise ValueError("save_trace: the last call's timeline was not recorded; call hm.record_timeline() (or "
                         "trainer.record_timeline()) before it, or compile with timeline=True")
    if not stats.spans:
        raise ValueError("save_trace: nothing has run yet; call the module (and backward), or Trainer.step, first")
    memory = [stats.memory.get(i, []) for i in range(len(hm.devices))]
    write_trace(path, chrome_events(stats.spans, memory, [device.name for device in hm.devices]))


def check_recorded(stats) -> None:
    """Raise unless ``stats`` hold a recorded timeline to draw (checked before anything is simulated)."""
    if not stats.recording:
        raise ValueError("plot_memory: the last call's timeline was not recorded; call hm.record_timeline() (or "
                         "trainer.record_timeline()) before it, or compile with timeline=True")
    if not stats.memory and stats.spans:
        raise ValueError("plot_memory: the last call's timeline was recorded without the device's memory "
                         "(record_timeline(memory=False)); call record_timeline() before it")
    if not stats.memory:
        raise ValueError("plot_memory: nothing has run yet; call the module (and backward), or Trainer.step, first")


def plot_memory(hm, path: str | os.PathLike, predicted) -> None:
    """A PNG (or any format matplotlib writes, by the file's extension); ``predicted``: the
    simulation of ``hm``'s programs (a ``planner.simulate.Simulation``), drawn beside what it measured."""
    import matplotlib
    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    stats = hm.stats
    check_recorded(stats)
    mib = 2**20
    figure, axes = plt.subplots(len(hm.devices), 1, figsize=(9, 2.6 * len(hm.devices)), squeeze=False)
    for index, (device, ax) in enumerate(zip(hm.devices, axes[:, 0])):
        measured = stats.memory.get(index, [])
        if measured:
            _step(ax, measured, "measured")
        _step(ax, predicted.memory[index], "predicted (simulated)", linestyle="--")
        if hm.budget is not None:
            ax.axhline(hm.budget / mib, color="red", linewidth=1, label="budget")
        ax.set_title(f"{device.name}: memory over one iteration")
        ax.set_xlabel("fraction of the iteration")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _step(ax, timeline, label: str, **style) -> None:
    times, values = zip(*timeline)
    total = max(times[-1], 1e-12)
    ax.step([t / total for t in times], [v / 2**20 for v in values], where="post",
            label=f"{label}, {total * 1e3:.1f} ms", **style)
