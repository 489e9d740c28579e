"""How long a user waits for ``compile`` and ``harmony-fx plan`` (issue #32), measured once per case.

    OMP_NUM_THREADS=1 python benchmarks/plan_time.py [--case NAME ...] [--json out.json]

Cases:

* ``gpt2-59``: a tiny GPT-2 with 59 blocks (``transformers``, random weights, 114 layers, one
  HostDevice), planned at its smallest budget (named by the refusal of a budget of one byte) and
  refused at 0.7% below it, with and without the planner choosing the microbatches (which may
  fit that budget with more microbatches: then it says so and times the accepted compile);
* ``gpt-774m``: a GPT-2-large-shaped ``TinyGPT`` (36 layers, 774M parameters, no dropout), batch
  4 x 1024 tokens under 4 GiB;
* ``plan-175b-tier`` and ``plan-175b-4tb``: ``harmony-fx plan gpt3-175b --devices 8 --device-spec
  a100-80gb`` with ``--host-memory 2TB --nvme 8TB``, and with ``--host-memory 4TB``.

Only public names are used, so the same script measures another checkout of the package
(``PYTHONPATH=/path/to/old python benchmarks/plan_time.py``): compare the two in the same minutes,
the machine's load moves every figure. "planning" is a compile's time less its captures (the
stages ``capture whole batch`` and ``capture microbatches``); a refusal's is its time less the
captures of the accepted compile of the same call.
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


def _timed_refusal(compile_call) -> tuple[float, int | None]:
    """Seconds to refuse, and the smallest budget named (``None``: accepted after all, which a
    planner choosing more microbatches than the options' one may find below that budget)."""
    import harmony_fx

    started = time.perf_counter()
    try:
        compile_call()
    except harmony_fx.BudgetTooSmallError as error:
        return time.perf_counter() - started, error.smallest_budget
    return time.perf_counter() - started, None


def gpt2_59() -> dict:
    import harmony_fx
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    model, batch = build_hf_model("gpt2", num_layers=59), hf_batch("gpt2")
    figures = {}
    for name, options in (("planner chooses", {}), ("one microbatch", {"microbatches": 1})):
        def call(budget, options=options):
            return harmony_fx.compile(model, (), example_kwargs=batch, memory_budget=budget, devices=["host:0"],
                                      **options)

        one_byte, smallest = _timed_refusal(lambda: call(1))
        started = time.perf_counter()
        hm = call(smallest)
        planned = time.perf_counter() - started
        captures = _captures(hm)
        below, refused = _timed_refusal(lambda: call(int(smallest * 0.993)))
        figures[name] = {
            "smallest budget": smallest, "packs": len(hm.packs),
            "refused 1 byte s": round(one_byte, 2),
            "planned at the smallest s": round(planned, 2), "captures s": round(captures, 2),
            "planning at the smallest s": round(planned - captures, 2),
            ("refused 0.7% below s" if refused else "0.7% below accepted s"): round(below, 2),
            "refusal's planning s" if refused else "planning below s": round(below - captures, 2),
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
