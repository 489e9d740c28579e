"""How long a user waits for ``compile`` and ``harmony-fx plan`` (issue #32), measured once per case.

    OMP_NUM_THREADS=1 python benchmarks/plan_time.py [--case NAME ...] [--json out.json]

Cases:

* ``gpt2-59``: a tiny GPT-2 with 59 blocks (``transformers``, random weights, 114 layers, one
  HostDevice), planned at its smallest budget (named by the refusal of a budget of one byte) and
  refused at 0.7% below it, with and without the planner choosing the microbatches (which may
  fit that budget with more microbatches: then it says so and times the accepted compile); each
  cold (the model's first compile) and warm (after another compile of the same model, which
  keeps its captures: ``compiler.capture_cache``);
* ``gpt-774m``: a GPT-2-large-shaped ``TinyGPT`` (36 layers, 774M parameters, no dropout), batch
  4 x 1024 tokens under 4 GiB;
* ``plan-175b-tier`` and ``plan-175b-4tb``: ``harmony-fx plan gpt3-175b --devices 8 --device-spec
  a100-80gb`` with ``--host-memory 2TB --nvme 8TB``, and with ``--host-memory 4TB``.

Only public names are used, so the same script measures another checkout of the package
(``PYTHONPATH=/path/to/old python benchmarks/plan_time.py``): compare the two in the same minutes,
the machine's load moves every figure. "planning" is a compile's time less its captures (the
stages ``capture whole batch`` and ``capture microbatches``); for the cold compiles of ``gpt2-59``,
refusals included, the time inside ``torch.export`` is timed around torch's function and the
rest is harmony's own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CAPTURES = ("capture whole batch", "capture microbatches")


def _captures(hm) -> float:
    return sum(stage.seconds for stage in hm.passes if stage.name in CAPTURES)


def _cold() -> None:
    """Forget the captures a compile keeps for the next compile of the same model (``harmony_fx.reset``,
    where the package has it), so the next compile captures as a model's first does."""
    import harmony_fx

    getattr(harmony_fx, "reset", lambda: None)()


def _timed(compile_call) -> tuple[float, object]:
    """Seconds to compile, and the module, or the smallest budget a refusal named (an int)."""
    import harmony_fx

    started = time.perf_counter()
    try:
        result = compile_call()
    except harmony_fx.BudgetTooSmallError as error:
        result = error.smallest_budget
    return time.perf_counter() - started, result


def _timed_cold(compile_call) -> tuple[float, float, object]:
    """``_timed`` of the model's first compile, with the seconds of it spent in ``torch.export``
    (timed around torch's function, so a refusal, which leaves no stages to read, is split too)."""
    import torch

    _cold()
    exporting = [0.0]
    export = torch.export.export

    def timed_export(*args, **kwargs):
        started = time.perf_counter()
        try:
            return export(*args, **kwargs)
        finally:
            exporting[0] += time.perf_counter() - started

    torch.export.export = timed_export
    try:
        seconds, result = _timed(compile_call)
    finally:
        torch.export.export = export
    return seconds, exporting[0], result


def gpt2_59() -> dict:
    """Each call twice: cold (the model's first compile in the process: ``harmony_fx.reset`` before
    it) and warm (right after another compile of the same model in the same state, as a user
    compiles again with the budget a refusal named)."""
    import harmony_fx
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    model, batch = build_hf_model("gpt2", num_layers=59), hf_batch("gpt2")
    figures = {}
    for name, options in (("planner chooses", {}), ("one microbatch", {"microbatches": 1})):
        def call(budget, options=options):
            return harmony_fx.compile(model, (), example_kwargs=batch, memory_budget=budget, devices=["host:0"],
                                      **options)

        one_byte_cold, one_byte_export, smallest = _timed_cold(lambda: call(1))
        one_byte_warm, _ = _timed(lambda: call(1))
        planned_warm, hm = _timed(lambda: call(smallest))
        below = int(smallest * 0.993)
        below_warm, refused = _timed(lambda: call(below))
        planned_cold, planned_export, _ = _timed_cold(lambda: call(smallest))
        below_cold, below_export, _ = _timed_cold(lambda: call(below))
        verdict = "refused" if isinstance(refused, int) else "accepted"
        figures[name] = {
            "smallest budget": smallest, "packs": len(hm.packs),
            "refused 1 byte s (cold, warm)": (round(one_byte_cold, 2), round(one_byte_warm, 2)),
            "planned at the smallest s (cold, warm)": (round(planned_cold, 2), round(planned_warm, 2)),
            "captures of the warm plan s": round(_captures(hm), 2),
            f"{verdict} 0.7% below s (cold, warm)": (round(below_cold, 2), round(below_warm, 2)),
            # cold, what torch.export took and the rest (harmony's own work: planning)
            "torch.export / the rest, cold s (1 byte, smallest, 0.7% below)": tuple(
                (round(export, 2), round(wall - export, 2)) for wall, export in
                ((one_byte_cold, one_byte_export), (planned_cold, planned_export), (below_cold, below_export))),
        }
    return figures


def gpt_774m() -> dict:
    import torch

    import harmony_fx
    from harmony_fx.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280, dropout=0.0)
    model = TinyGPT(config)
    idx = torch.randint(0, config.vocab_size, (4, 1024))
    started = time.perf_counter()
    hm = harmony_fx.compile(model, (idx,), devices=["host:0"], memory_budget="4GiB")
    seconds = time.perf_counter() - started
    return {"parameters M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1), "packs": len(hm.packs),
            "compile s": round(seconds, 2), "captures s": round(_captures(hm), 2),
            "planning s": round(seconds - _captures(hm), 2)}


def _plan(*host: str) -> dict:
    command = [sys.executable, "-m", "harmony_fx.cli", "plan", "gpt3-175b", "--devices", "8", "--device-spec",
               "a100-80gb", *host, "--json"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    report = json.loads(done.stdout)
    return {"planned in s": round(report["planning_seconds"], 2) if "planning_seconds" in report else None,
            "wall s": round(wall, 2), "iteration s": round(report["iteration_seconds"], 3),
            "lower bound s": round(report["lower_bound_seconds"], 1), "bound by": report["bound_by"],
            "policy": report["policy"]}


CASES = {
    "gpt2-59": gpt2_59,
    "gpt-774m": gpt_774m,
    "plan-175b-tier": lambda: _plan("--host-memory", "2TB", "--nvme", "8TB"),
    "plan-175b-4tb": lambda: _plan("--host-memory", "4TB"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="run these cases (default: all)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    import harmony_fx

    figures = {"package": os.path.dirname(harmony_fx.__file__), "load average": os.getloadavg()}
    for name in args.case or list(CASES):
        figures[name] = CASES[name]()
        print(f"{name}: {json.dumps(figures[name])}", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
