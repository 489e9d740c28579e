"""``harmony-fx demo``, small: it exits 0, prints its summary, and writes a trace with events on
every stream it used and a memory plot."""
from __future__ import annotations

import json

import torch

from harmony_fx.cli import main


def _flushes_denormals() -> bool:  # counted here, not with the demo's own check
    return torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() == 0.0


def test_demo_trains_and_writes_its_pictures(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    flushing = _flushes_denormals()
    assert main(["demo", "--quick", "--steps", "3", "--devices", "2", "--parallel", "pp", "--microbatches", "2",
                 "--out", str(out)]) == 0
    assert _flushes_denormals() == flushing  # the CPU's mode put back as it was
    printed = capsys.readouterr().out
    assert "summary" in printed and "losses match eager's" in printed
    assert "1 intra-op thread(s) for harmony and eager alike" in printed
    if torch.set_flush_denormal(flushing):  # the CPU can flush them: the demo did, and says so
        assert "denormals flushed to zero for both" in printed
    assert "on the last step (every tensor counted; the plan predicted" in printed and "under a budget of" in printed
    assert "tokens/s" in printed and "the time" in printed
    # the second-to-last step's time, part by part: they add up to it
    header = next(line for line in printed.splitlines() if line.startswith("  where harmony's step went"))
    step_ms = float(header.split("step 1, ")[1].split(" ms")[0])
    parts = {line.split()[0]: float(line.split(" ms")[0].split()[-1]) for line in printed.splitlines()
             if line.startswith("    ") and " ms  " in line}
    assert set(parts) == {"compute", "recompute", "copies", "optimizer", "runtime"}
    assert abs(sum(parts.values()) - step_ms) <= 0.1 * len(parts)
    assert "simulated on this machine's calibration" in printed
    assert "on an a100-80gb (simulated, the planner's cost model): this plan" in printed and "eager" in printed

    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    rows = {(e["pid"], e["cat"]) for e in events if e["ph"] == "X"}
    for device in (0, 1):
        assert {(device, stream) for stream in ("compute", "h2d", "d2h", "peer")} <= rows
    assert any(e["ph"] == "C" and e["name"] == "memory" for e in events)
    png = (out / "memory.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
