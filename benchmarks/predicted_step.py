"""An untracked Trainer step measured against ``simulate_module``'s prediction of the same plan
(issue #33): how far this machine's calibrated cost model is from what a run takes.

    OMP_NUM_THREADS=1 python benchmarks/predicted_step.py [--steps 12] [--case NAME ...] [--parts]

Each case compiles a model with ``harmony_fx.Trainer`` (AdamW, per-pack updates on the host
worker), runs ``--steps`` untracked, unrecorded steps and takes their median less the first two
(warm-up), then predicts the same plan with ``simulate_module`` on this machine's calibration
(``calibrate.spec_for``, ``calibrate.host_spec``), as ``harmony-fx demo`` does. ``--parts``
records one more step's spans (memory not counted) and sets its breakdown
(``runtime.breakdown.step_breakdown``) beside the same breakdown of the simulated spans, each
predicted in the mode it ran in. The 1-minute load average is printed before and after each case:
the machine is shared, and its load moves every measured figure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import harmony_fx
from harmony_fx import calibrate
from harmony_fx.analysis.memory import eager_training_bytes
from harmony_fx.models import GPTConfig, MLPChain, TinyGPT
from harmony_fx.planner.module import simulate_module
from harmony_fx.runtime.breakdown import step_breakdown


def _gpt(layers: int, width: int, batch: int):
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=layers, n_head=4, n_embd=width, dropout=0.0)
    torch.manual_seed(0)
    model = TinyGPT(config)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), target.reshape(-1))
    return model, loss_fn, idx, torch.roll(idx, 1, dims=1)


def _mlp(width: int, depth: int, batch: int):
    torch.manual_seed(0)
    model = MLPChain(width=width, depth=depth)
    x = torch.randn(batch, width)
    return model, torch.nn.functional.cross_entropy, x, torch.randint(0, 10, (batch,))


# name: (model maker, its arguments, budget as a fraction of eager training's need, microbatches)
CASES = {
    "demo": (_gpt, (8, 64, 16), 0.25, None),          # harmony-fx demo's model and options
    "gpt-wide": (_gpt, (4, 128, 8), 0.5, 2),
    "gpt-mb8": (_gpt, (6, 64, 16), 0.4, 8),
    "mlp": (_mlp, (512, 16, 256), 0.3, 4),
}


def _load() -> float:
    return os.getloadavg()[0]


def run_case(name: str, steps: int, parts: bool) -> dict:
    make, args, fraction, microbatches = CASES[name]
    model, loss_fn, x, y = make(*args)
    need = eager_training_bytes(model, (x,), lambda out: loss_fn(out, y))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_before = _load()
    trainer = harmony_fx.Trainer(model, loss_fn, optimizer, ((x,), y), memory_budget=int(need * fraction),
                                 microbatches=microbatches)
    hm = trainer.hm
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.step(((x,), y))
        seconds.append(time.perf_counter() - started)
    measured = statistics.median(seconds[2:])
    spec, host = calibrate.spec_for(hm.devices[0], hm.budget), calibrate.host_spec()
    predicted = simulate_module(hm, spec, host).seconds
    row = {"case": name, "packs": len(hm.packs), "microbatches": len(hm.mb_sizes), "measured": measured,
           "fastest": min(seconds[2:]), "predicted": predicted, "ratio": measured / predicted,
           "load": (load_before, _load())}
    if parts:
        trainer.record_timeline(memory=False)
        started = time.perf_counter()
        trainer.step(((x,), y))
        step = time.perf_counter() - started
        stats = trainer.stats
        row["parts"] = step_breakdown(stats.spans, step, stats.update_exposed_seconds)
        row["parts_step"] = step
        row["update_seconds"] = stats.update_seconds
        recorded = simulate_module(hm, calibrate.spec_for(hm.devices[0], hm.budget, recorded=True), host)
        row["predicted_parts"] = _simulated_parts(recorded)
        row["predicted_recorded"] = recorded.seconds
        row["predicted_update"] = sum(end - start for _, stream, _, start, end in recorded.spans if stream == "host")
    trainer.close()
    return row


def _simulated_parts(simulation) -> dict[str, float]:
    """The simulated step shared out as a measured one is: the updates after the last other span
    are the optimizer exposed."""
    spans = [s for s in simulation.spans if s[1] != "host"]
    last = max((end for *_, end in spans), default=0.0)
    return step_breakdown(spans, simulation.seconds, max(simulation.seconds - last, 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--parts", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1, as the demo's)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine afresh first (in place of the cached entry), under the load "
                             "the cases then run under")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    print(f"load {_load():.2f}")
    calibration = calibrate.recalibrate(merge=False) if options.calibrate else calibrate.host_calibration()
    print(f"calibration: {', '.join(f'{k} {v:.3g}' for k, v in calibration.figures.items())}")
    for name in options.case or list(CASES):
        row = run_case(name, options.steps, options.parts)
        print(f"{name:<9} {row['packs']:>2} packs x {row['microbatches']} mb: measured {row['measured'] * 1e3:7.1f} ms "
              f"(fastest {row['fastest'] * 1e3:.1f}), predicted {row['predicted'] * 1e3:7.1f} ms, "
              f"measured/predicted {row['ratio']:.2f}; load {row['load'][0]:.2f}-{row['load'][1]:.2f}", flush=True)
        if "parts" in row:
            print(f"          recorded step {row['parts_step'] * 1e3:.1f} ms, predicted "
                  f"{row['predicted_recorded'] * 1e3:.1f}; updates {row['update_seconds'] * 1e3:.1f} ms, "
                  f"predicted {row['predicted_update'] * 1e3:.1f}")
            for part, value in row["parts"].items():
                predicted = row["predicted_parts"][part]
                print(f"            {part:<18} {value * 1e3:7.1f} ms   predicted {predicted * 1e3:7.1f}")


if __name__ == "__main__":
    main()
