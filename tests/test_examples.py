"""The scripts in ``examples/`` run as a user runs them (a subprocess, torchrun for the distributed one)
and train equal to eager: each prints its final loss beside eager's, and exits 1 if they differ.
Slow (a fresh interpreter and torch each, about a minute in all): CI runs the Lightning and torchrun ones
with ``-m slow`` (the Hugging Face one under torchrun too), the Hugging Face one in one process (35 s) is in
``-m extended``."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(*command: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_lightning_example_trains_equal_to_lightnings_own_strategy():
    pytest.importorskip("lightning")
    out = _run(str(EXAMPLES / "lightning_train.py"), "--epochs", "2", "--samples", "512")
    eager, harmony = map(float, re.search(r"final train_loss\s+(\S+)\s+(\S+)", out).groups())
    assert harmony == pytest.approx(eager, rel=1e-5)
    packs, peak, budget = re.search(r"budget (\d+) KiB: (\d+) packs, a peak of (\d+) KiB", out).group(2, 3, 1)
    assert int(packs) >= 2 and int(peak) <= int(budget)


def test_torchrun_example_trains_across_two_processes_equal_to_one_eager_process():
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(EXAMPLES / "torchrun_train.py"), "--steps", "4")
    assert len(re.findall(r"^step +\d+ +loss", out, re.MULTILINE)) == 4  # rank 0 alone prints
    harmony, eager = map(float, re.search(r"across 2 processes (\S+), eager in one process (\S+)", out).groups())
    assert harmony == pytest.approx(eager, rel=1e-5)


def test_hf_example_under_torchrun_fine_tunes_equal_to_transformers_trainer_with_ddp():
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLES / "hf_finetune.py"),
               "--steps", "4")
    _assert_hf_example_equal(out)


def test_hf_example_fine_tunes_equal_to_transformers_trainer():
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    out = _run(str(EXAMPLES / "hf_finetune.py"), "--steps", "4")
    _assert_hf_example_equal(out)


def _assert_hf_example_equal(out: str) -> None:
    for run in ("full fine-tune", "LoRA (peft)"):
        eager, harmony, eager_eval, harmony_eval = map(float, re.search(rf"{re.escape(run)}\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)",
                                                                        out).groups())
        assert harmony == pytest.approx(eager, rel=1e-5) and harmony_eval == pytest.approx(eager_eval, rel=1e-5), run
    packs = [int(n) for n in re.findall(r"   (\d+), \S+ MiB, \S+ MiB", out)]
    assert len(packs) == 2 and min(packs) >= 2
