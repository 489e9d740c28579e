"""The GPU check: on one GPU, no network, by phases that each fit a short command.

    PYTHONPATH=. python benchmarks/gpu_check.py --phase env --out gpu_check.json
    PYTHONPATH=. python benchmarks/gpu_check.py --phase tests --out gpu_check.json
    ...                                          --phase probes | gpt-eager | gpt-harmony | gpt-resident | gpt-fsdp | table
    PYTHONPATH=. python benchmarks/gpu_check.py --quick --out gpu_check.json   # every phase, small GPT

Each phase adds its entry to the JSON at ``--out`` (read first, so phases run as separate commands
add up) and writes it as soon as it ends; a phase that times out keeps what it printed.

- ``env``: versions, the device, ``torch.cuda.mem_get_info()``.
- ``tests``: ``pytest -m cuda`` (the suite's GPU tests; they run packs as graphs).
- ``probes``, figures the tests do not report: the largest gradient difference of dropout
  replayed on CUDA against eager on the same (one) microbatch, the implicit syncs of a Trainer step
  (``torch.cuda.set_sync_debug_mode``), predicted vs allocated / requested / reserved peaks over
  two iterations. Packs run as graphs (compiled packs, the GPU default, would spend minutes here).
- ``gpt-eager``, ``gpt-harmony``, ``gpt-resident``, ``gpt-fsdp``: a GPT of about 1B parameters (width 2048, 20 layers,
  sequence 1024; ``--quick``: 4 layers of 512, sequence 256), one CPU state dict for every run,
  1 warm-up + 3 timed steps by (i) eager, uncapped, fused AdamW on the GPU; (ii) the harmony
  Trainer under ``set_per_process_memory_fraction`` of an 8 GiB cap; (iii) the model fits, so a
  GPU user keeps it there: ``harmony_fx.compile`` of the model on the GPU (weights resident, the
  planner's packs and microbatches) with a fused AdamW on the GPU, uncapped as eager is: what harmony's
  packs and recomputation cost where nothing needs swapping; (iv) FSDP2 ``fully_shard``
  per block with ``CPUOffloadPolicy(pin_memory=True)`` and activation checkpointing per block,
  world size 1, under the same cap; the same global batch. Each run is a subprocess of its own (the
  memory cap is per process).
- ``table``: the side-by-side table of what the JSON holds.

Without a GPU every phase says so; ``env`` runs, and ``plan`` (the harmony plan of the GPT for an
H200, the planner alone) stands in for the runs.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import harmony_fx
from harmony_fx.models import GPTConfig, TinyGPT

GIB = 1 << 30
CAP = 8 * GIB
BIG = GPTConfig(vocab_size=50304, block_size=1024, n_layer=20, n_head=16, n_embd=2048, dropout=0.0)
QUICK = GPTConfig(vocab_size=50304, block_size=256, n_layer=4, n_head=8, n_embd=512, dropout=0.0)
BATCH, MICROBATCHES, STEPS = 8, 4, 3


# ---------------------------------------------------------------------------------- the phases


def env() -> dict:
    info = {"date": datetime.date.today().isoformat(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(gpu=props.name, gpu_memory=props.total_memory, free=free, total=total,
                    capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count())
    return info


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def cuda_tests(timeout: float) -> dict:
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-rf", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        stdout, returncode, summary = run.stdout, run.returncode, None
    except subprocess.TimeoutExpired as expired:  # what ran until then is still worth reading
        stdout, returncode, summary = _text(expired.stdout), None, f"timed out after {timeout:.0f} s"
    lines = stdout.strip().splitlines()
    return {"returncode": returncode, "summary": summary or (lines[-1:] or ["(no output)"])[0],
            "seconds": time.perf_counter() - started,
            "failures": [line for line in lines if line.startswith("FAILED")][:20], "tail": "\n".join(lines[-15:])}


def _grads_equal(model, reference, exact: bool = False) -> float:
    """The largest gradient difference (raises if over the tolerance)."""
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        got, want = p.grad.float().cpu(), q.grad.float().cpu()
        worst = max(worst, (got - want).abs().max().item())
        if exact:
            assert torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
    return worst


def _small_gpt(dropout: float = 0.0):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=96, block_size=32, n_layer=6, n_head=4, n_embd=64, dropout=dropout)
    return TinyGPT(config), torch.randint(0, 96, (8, 32)), torch.randint(0, 96, (8, 32))


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def probes() -> dict:
    results: dict = {}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def probe(name, fn):
        started = time.perf_counter()
        try:
            results[name] = {"ok": True, **(fn() or {})}
        except Exception as error:  # noqa: BLE001 - a probe's failure is its result
            results[name] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        results[name]["seconds"] = round(time.perf_counter() - started, 2)

    def dropout_replay():
        # one microbatch: eager draws one mask over the whole batch, and so must the compared run
        model, x, y = _small_gpt(dropout=0.2)
        reference = copy.deepcopy(model).cuda()
        hm = harmony_fx.compile(model, x, devices=["cuda:0"], microbatches=1, memory_budget="256KiB",
                                compile_packs=False)
        torch.manual_seed(1)
        _loss(hm(x), y).backward()
        torch.manual_seed(1)
        _loss(reference(x.cuda()), y.cuda()).backward()
        return {"packs": len(hm.packs), "max_grad_diff": _grads_equal(model, reference)}

    def syncs_and_peaks():
        model, x, y = _small_gpt()
        trainer = harmony_fx.Trainer(model, _loss, torch.optim.AdamW(model.parameters()), (x, y),
                                     devices=["cuda:0"], microbatches=2, memory_budget="512KiB", compile_packs=False)
        trainer.step((x, y))  # warm-up
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.step((x, y))
            finally:
                torch.cuda.set_sync_debug_mode(0)
        peaks = []
        for _ in range(2):
            trainer.step((x, y))
            stats = trainer.stats
            peaks.append({"predicted": trainer.plan.predicted_peak["cuda:0"], **stats.memory_peaks["cuda:0"]})
        trainer.close()
        budget = trainer.plan.budget
        return {"implicit_syncs": len(caught), "peaks": peaks, "budget": budget,
                "requested_within_budget": all(p["requested"] <= budget for p in peaks)}

    probe("dropout_replay", dropout_replay)
    probe("syncs_and_peaks", syncs_and_peaks)
    return results


# ---------------------------------------------------------------------------------- the big GPT


def _gpt_batch(config: GPTConfig):
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (BATCH, config.block_size), generator=generator)
    return idx, torch.roll(idx, -1, dims=1)


def _model_flops(config: GPTConfig, params: int) -> float:
    """Model FLOPs of one step (6 per parameter and token, and attention), recompute not counted."""
    tokens = BATCH * config.block_size
    attention = 12 * config.n_layer * config.n_embd * config.block_size * tokens
    return 6 * params * tokens + attention


def _timed_steps(step, sync=True) -> tuple[list[float], list[float]]:
    losses, seconds = [], []
    for _ in range(1 + STEPS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        losses.append(float(loss))
    return losses, seconds[1:]


def _busy_fraction(step) -> float:
    """GPU kernel time over wall time of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    kernels = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total) / 1e6
    return min(1.0, kernels / wall)


def _plain_step(model, optimizer, idx, target):
    """One eager training step on the GPU (eager and FSDP2 alike)."""
    idx, target = idx.cuda(), target.cuda()

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model(idx), target)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def run_gpt(kind: str, state_path: str, quick: bool) -> dict:
    """One of the three runs, in this process (``--run``)."""
    config = QUICK if quick else BIG
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    with torch.device("meta"):
        model = TinyGPT(config)
    model = model.to_empty(device="cpu")
    model.load_state_dict(torch.load(state_path, map_location="cpu", mmap=True))
    model.lm_head.weight = model.wte.weight
    for block in model.h:  # the masks are not in the state dict: make them again
        size = config.block_size
        block.attn.causal_mask = torch.tril(torch.ones(size, size, dtype=torch.bool)).view(1, 1, size, size)
    params = sum(p.numel() for p in model.parameters())
    idx, target = _gpt_batch(config)
    result: dict = {"params": params, "tokens_per_step": BATCH * config.block_size}
    total = torch.cuda.get_device_properties(0).total_memory
    if kind != "eager":
        torch.cuda.set_per_process_memory_fraction(CAP / total)
        result["cap"] = CAP
    torch.cuda.reset_peak_memory_stats()
    if kind == "eager":
        model = model.cuda()
        step = _plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), idx, target)
    elif kind == "resident":
        model = model.cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        started = time.perf_counter()
        hm = harmony_fx.compile(model, idx.cuda(), devices=["cuda:0"], compile_packs=False)
        result["compile_seconds"] = time.perf_counter() - started
        result["packs"], result["microbatches"] = len(hm.packs), hm.plan.microbatches
        step = _plain_step(hm, optimizer, idx, target)
    elif kind == "harmony":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        started = time.perf_counter()
        # packs run as graphs, as eager and FSDP2 here run uncompiled (compiled packs, the GPU default,
        # would spend minutes of this check's budget in inductor)
        trainer = harmony_fx.Trainer(model, _loss, optimizer, (idx, target), devices=["cuda:0"],
                                     memory_budget=CAP, microbatches=MICROBATCHES, compile_packs=False)
        result["compile_seconds"] = time.perf_counter() - started
        result["packs"] = len(trainer.hm.packs)

        def step():
            return trainer.step((idx, target))
    else:  # fsdp
        from torch.distributed import init_process_group
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
        apply_activation_checkpointing(model, check_fn=lambda module: module in set(model.h))
        for block in model.h:
            fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=True))
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=True))
        step = _plain_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4), idx, target)

    losses, seconds = _timed_steps(step)
    stats = torch.cuda.memory_stats()
    mean = sum(seconds) / len(seconds)
    result.update(losses=losses, step_seconds=seconds, tokens_per_second=result["tokens_per_step"] / mean,
                  tflops=_model_flops(config, params) / mean / 1e12,
                  allocated_peak=stats.get("allocated_bytes.all.peak"), requested_peak=stats.get("requested_bytes.all.peak"),
                  reserved_peak=stats.get("reserved_bytes.all.peak"),
                  pinned_bytes=int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)))
    if kind in ("harmony", "resident"):
        from harmony_fx.planner.choose import device_spec
        from harmony_fx.planner.module import simulate_module

        hm = trainer.hm if kind == "harmony" else hm
        moved = hm.stats.as_dict()["bytes_by_kind"]
        result.update(bytes_moved=moved, bytes_planned=hm.plan.predicted_bytes,
                      bytes_equal_plan=moved == hm.plan.predicted_bytes,
                      predicted_peak=hm.plan.predicted_peak["cuda:0"], budget=hm.plan.budget,
                      simulated_seconds=simulate_module(hm, device_spec(hm.devices[0], hm.budget)).seconds)
    if kind == "harmony":
        result.update(update_seconds=trainer.stats.update_seconds, exposed_update_seconds=trainer.stats.update_exposed_seconds,
                      undo_seconds=trainer.stats.undo_seconds)
    result["gpu_busy_fraction"] = _busy_fraction(step)
    return result


STATE_PATH = "/tmp/harmony_gpu_check_gpt.pt"


def gpt(kind: str, quick: bool, timeout: float) -> dict:
    """One GPT run (``kind``) in a subprocess; the initial state is saved once for all of them."""
    if not os.path.exists(STATE_PATH + (".quick" if quick else "")):
        torch.manual_seed(0)
        torch.save(TinyGPT(QUICK if quick else BIG).state_dict(), STATE_PATH + (".quick" if quick else ""))
    started = time.perf_counter()
    command = [sys.executable, __file__, "--run", kind, "--state", STATE_PATH + (".quick" if quick else "")]
    # every run alike: expandable segments, so that near the cap the allocator grows a segment
    # instead of failing on fragmentation (or freeing its cache, a device-wide sync)
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    try:
        run = subprocess.run(command + (["--quick"] if quick else []), capture_output=True, text=True,
                             timeout=timeout, env=env)
        stdout, stderr = run.stdout, run.stderr
    except subprocess.TimeoutExpired as expired:
        return {"error": f"timed out after {timeout:.0f} s", "output": _text(expired.stdout)[-800:],
                "stderr": _text(expired.stderr)[-800:], "wall_seconds": time.perf_counter() - started}
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        result = {"error": (stderr or stdout).strip()[-800:]}
    result["wall_seconds"] = time.perf_counter() - started
    return result


def plan_only(quick: bool) -> dict:
    """Without a GPU: the harmony plan of the GPT for an H200 under the 8 GiB cap (the planner)."""
    run = subprocess.run([sys.executable, "-c", "from harmony_fx.cli import main; raise SystemExit(main())", "plan", "gpt2-medium" if quick else "gpt2-xl",
                          "--devices", "1", "--device-spec", "h200", "--memory-budget", "8GiB", "--json"],
                         capture_output=True, text=True, timeout=300)
    return {"returncode": run.returncode, "output": run.stdout.strip()[-1500:] or run.stderr.strip()[-800:]}


# ---------------------------------------------------------------------------------- the table


def table(out: dict) -> str:
    gpt_runs = out.get("gpt", {})
    kinds = ("eager", "harmony", "resident", "fsdp")
    rows = [("figure", "eager", "harmony", "harmony resident", "fsdp2 offload")]

    def row(name, fmt, key):
        values = []
        for kind in kinds:
            value = gpt_runs.get(kind, {}).get(key)
            values.append("-" if value is None else fmt(value))
        rows.append((name, *values))

    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    row("tokens/s", lambda v: f"{v:,.0f}", "tokens_per_second")
    row("TFLOP/s (model)", lambda v: f"{v:.1f}", "tflops")
    row("first-step loss", lambda v: f"{v[0]:.4f}", "losses")
    row("allocated peak", gib, "allocated_peak")
    row("requested peak", gib, "requested_peak")
    row("reserved peak", gib, "reserved_peak")
    row("pinned host", gib, "pinned_bytes")
    row("GPU busy", lambda v: f"{v:.0%}", "gpu_busy_fraction")
    row("step s (measured)", lambda v: f"{sum(v) / len(v):.3f}", "step_seconds")
    row("step s (simulated)", lambda v: f"{v:.3f}", "simulated_seconds")
    row("update s (host optimizer)", lambda v: f"{v:.3f}", "update_seconds")
    row("update s exposed", lambda v: f"{v:.3f}", "exposed_update_seconds")
    row("undo copy s (in update)", lambda v: f"{v:.3f}", "undo_seconds")
    row("bytes = plan", str, "bytes_equal_plan")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    harmony, fsdp = gpt_runs.get("harmony", {}), gpt_runs.get("fsdp", {})
    if harmony.get("tokens_per_second") and fsdp.get("tokens_per_second"):
        lines.append(f"harmony / fsdp2 offload tokens/s: {harmony['tokens_per_second'] / fsdp['tokens_per_second']:.2f}x")
    eager, resident = gpt_runs.get("eager", {}), gpt_runs.get("resident", {})
    if eager.get("tokens_per_second") and resident.get("tokens_per_second"):
        lines.append(f"harmony resident / eager tokens/s (the model fits): "
                     f"{resident['tokens_per_second'] / eager['tokens_per_second']:.2f}x")
    return "\n".join(lines)


PHASES = ("env", "tests", "probes", "gpt-eager", "gpt-harmony", "gpt-resident", "gpt-fsdp", "table")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON each phase adds its entry to")
    parser.add_argument("--phase", choices=[*PHASES, "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="a small GPT instead of the 1B one (every phase in minutes)")
    parser.add_argument("--timeout", type=float, default=220, help="seconds for a subprocess phase (tests, each GPT run)")
    parser.add_argument("--run", choices=["eager", "harmony", "resident", "fsdp"], help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_gpt(args.run, args.state, args.quick)))
        return
    out: dict = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, default=str)

    gpu = torch.cuda.is_available()
    for phase in PHASES if args.phase == "all" else (args.phase,):
        started = time.perf_counter()
        if phase == "env":
            out["env"] = env()
        elif phase == "table":
            out["table"] = table(out)
        elif not gpu:
            if "plan" not in out:
                out["plan"] = plan_only(args.quick)
            out[phase] = {"skipped": "no GPU here (torch.cuda.is_available() is False)"}
        elif phase == "tests":
            out["cuda_tests"] = cuda_tests(args.timeout)
        elif phase == "probes":
            out["probes"] = probes()
        else:
            out.setdefault("gpt", {})[phase.removeprefix("gpt-")] = gpt(phase.removeprefix("gpt-"), args.quick,
                                                                        args.timeout)
        save()
        shown = out.get("table") if phase == "table" else json.dumps(out.get(phase, out.get("gpt", {}).get(
            phase.removeprefix("gpt-"), out.get("cuda_tests"))), default=str)[:1500]
        print(f"{phase} ({time.perf_counter() - started:.0f} s): {shown}", flush=True)


if __name__ == "__main__":
    main()
