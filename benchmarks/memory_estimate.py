"""The planner's peak estimate against the compiler's exact count, for the same schedule.

    OMP_NUM_THREADS=1 python benchmarks/memory_estimate.py [--case NAME ...]

Each case compiles a model under a budget (HostDevices), then simulates the schedule it runs with
the planner's own cost model (``planner.chain``: the layers' profile, as ``search`` sees it) and
sets that peak beside the plan's (the compiler's FakeTensor run, exact). The ratio estimate/exact
should be at least 1 (below it, the compiler falls back to another capture and its own search) and
not much more (above it, the planner leaves budget unused).

Only public names are used, so the same script measures another checkout of the package
(``PYTHONPATH=/path/to/old python benchmarks/memory_estimate.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.nn.functional as F


def _gpt(layers: int, width: int, batch: int, fraction: float):
    import harmony_fx
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.models import GPTConfig, TinyGPT

    config = GPTConfig(vocab_size=64, block_size=32, n_layer=layers, n_head=4, n_embd=width, dropout=0.0)
    torch.manual_seed(0)
    model = TinyGPT(config)
    idx = torch.randint(0, 64, (batch, 32), generator=torch.Generator().manual_seed(0))
    target = torch.roll(idx, 1, 1)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, 64), target.reshape(-1))

    budget = int(eager_training_bytes(model, (idx,), lambda out: loss_fn(out, target)) * fraction)
    trainer = harmony_fx.Trainer(model, loss_fn, torch.optim.AdamW(model.parameters()), ((idx,), target),
                                 devices=["host:0"], memory_budget=budget)
    return trainer.hm, trainer


def _zoo(name: str, fraction: float):
    import harmony_fx
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.testing.models import zoo

    entry = zoo()[name]
    model, inputs, target = entry.build(0)
    budget = int(eager_training_bytes(model, inputs, lambda out: entry.loss_fn(out, target)) * fraction)
    trainer = harmony_fx.Trainer(model, entry.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                                 (inputs, target), devices=["host:0"], memory_budget=budget)
    return trainer.hm, trainer


def _hf(name: str, fraction: float):
    import harmony_fx
    from harmony_fx.analysis.memory import eager_training_bytes
    from harmony_fx.testing.hf_models import build_hf_model, hf_batch

    model, batch = build_hf_model(name, num_layers=4), hf_batch(name)
    budget = int(eager_training_bytes(model, (), lambda out: out.loss, kwargs=batch) * fraction)
    hm = harmony_fx.compile(model, (), example_kwargs=batch, memory_budget=budget, devices=["host:0"])
    return hm, None


CASES = {
    "demo": lambda: _gpt(8, 64, 16, 0.25),
    "demo-quick": lambda: _gpt(6, 32, 8, 0.25),
    "gpt-wide-50": lambda: _gpt(4, 128, 8, 0.5),
    **{f"{name}-{int(f * 100)}": (lambda name=name, f=f: _zoo(name, f))
       for name in ("mlp_chain", "residual_mlp", "tiny_gpt", "small_cnn") for f in (0.5, 0.25)},
    **{f"hf-{name}-{int(f * 100)}": (lambda name=name, f=f: _hf(name, f)) for name in ("gpt2", "llama")
       for f in (0.5, 0.3)},
}


def estimate_and_exact(hm) -> tuple[int, int, str]:
    """The planner's simulated peak of the schedule ``hm`` runs, and the plan's exact one."""
    from harmony_fx.planner.chain import Schedule, chain_schedule
    from harmony_fx.planner.choose import device_spec
    from harmony_fx.planner.profile import profile_graph
    from harmony_fx.planner.simulate import simulate
    from harmony_fx.planner.specs import HostSpec

    size = hm.mb_sizes[0] or 1
    # captured in the compute dtype: the graph's bytes are the devices' (no itemsize to apply)
    profile = profile_graph("model", hm.captured.gm, size, None, hm.options.precision)
    # the packs it runs: the planner's may have been refused by the exact count and replaced by the
    # compiler's own (at the same microbatches), or the compiler chose without the planner
    boundaries = tuple(pack.layers[0] for pack in hm.packs)
    schedule = hm.compiled.schedule or Schedule(boundaries, hm.plan.microbatches, "single", 1)
    schedule = dataclasses.replace(schedule, boundaries=boundaries, fuse_last=hm.compiled.trainer)
    batch = sum(s for s in hm.compiled.layout.sizes[:schedule.microbatches] if s) or size
    spec = device_spec(hm.devices[0], hm.budget)
    programs, costs = chain_schedule(profile, schedule, batch, spec, HostSpec())
    simulation = simulate(programs, costs, spec, HostSpec(), 1)
    return max(simulation.peak_bytes), max(hm.plan.predicted_peak.values()), schedule.describe()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratios = []
    for name in args.case or CASES:
        try:
            hm, trainer = CASES[name]()
        except Exception as error:  # noqa: BLE001 - a refusal is a figure too
            tried = [line.strip() for line in str(error).splitlines() if line.strip().startswith("- ")]
            print(f"{name:20s} did not compile: {type(error).__name__}: {str(error).splitlines()[0]}", *tried,
                  sep="\n    ", flush=True)
            continue
        fell_back = any(stage.name == "fall back" for stage in hm.passes)
        try:
            estimate, exact, what = estimate_and_exact(hm)
        finally:
            if trainer is not None:
                trainer.close()
        ratios.append(estimate / exact)
        print(f"{name:20s} estimate {estimate:>10,} B  exact {exact:>10,} B  estimate/exact {estimate / exact:5.2f}"
              f"  ({what}, budget {hm.budget:,} B{', the planner fell back' if fell_back else ''})", flush=True)
    if ratios:
        print(f"estimate/exact: min {min(ratios):.2f}, max {max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
