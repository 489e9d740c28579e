"""``harmony-fx demo``, small: it exits 0, prints its summary, and writes a trace with events on
every stream it used and a memory plot."""
from __future__ import annotations

import json

from harmony_fx.cli import main


def test_demo_trains_and_writes_its_pictures(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--steps", "2", "--devices", "2", "--parallel", "pp", "--microbatches", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "summary" in printed and "losses match eager" in printed
    assert "under a budget of" in printed

    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    rows = {(e["pid"], e["cat"]) for e in events if e["ph"] == "X"}
    for device in (0, 1):
        assert {(device, stream) for stream in ("compute", "h2d", "d2h", "peer")} <= rows
    assert any(e["ph"] == "C" and e["name"] == "memory" for e in events)
    png = (out / "memory.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
