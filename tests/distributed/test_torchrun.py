"""``harmony-fx demo --nodes 2`` under torchrun: a rank that dies is restarted with the others
(``--max-restarts 1``), they resume from the last checkpoint, and the run ends as an unbroken one."""
from __future__ import annotations

import pytest

import subprocess
import sys

from tests.distributed.launch import ROOT


def _demo(out, *extra) -> str:
    result = subprocess.run([sys.executable, "-m", "harmony_fx.cli", "demo", "--nodes", "2", "--steps", "5",
                             "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow  # keeps the default suite under 8 minutes on 2 cores (which run has it: tests/tiers.py)
def test_a_restarted_run_ends_as_an_unbroken_one(tmp_path):
    unbroken = _demo(tmp_path / "unbroken")
    restarted = _demo(tmp_path / "restarted", "--fail-once", "2")
    assert "resumed from step_00000002 (restart 1)" in restarted
    assert "largest loss difference 0.0e+00" in unbroken  # two processes == one process, two HostDevices
    losses = [(tmp_path / run / "nodes" / "losses.txt").read_text().splitlines() for run in ("unbroken", "restarted")]
    assert len(losses[0]) == 5
    assert losses[0] == losses[1]  # bitwise: the losses' reprs
