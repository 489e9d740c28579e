"""Run a scenario in N local processes on gloo over 127.0.0.1, as torchrun would on N servers.

``run(scenario, world, tmp_path, **options)`` starts ``python -m tests.distributed.launch`` once per
rank and returns each rank's result (what the scenario saved). Scenarios live in ``scenarios.py``.
``torchrun(module, tmp_path)`` runs a script under torchrun itself, for the integrations that read
its environment (transformers, Lightning).
"""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(scenario: str, world: int, out: pathlib.Path, **options) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    torch.save(options, out / "options.pt")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return [subprocess.Popen([sys.executable, "-m", "tests.distributed.launch", scenario, str(rank), str(world),
                              str(port), str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for rank in range(world)]


def finish(processes: list[subprocess.Popen], out: pathlib.Path, timeout: float = 240,
           dying: dict[int, int] | None = None) -> list[dict | None]:
    """Each rank's result; ``dying``: ranks meant to exit early, with their exit codes (no result)."""
    dying = dying or {}
    outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    for rank, (p, output) in enumerate(zip(processes, outputs)):
        assert p.returncode == dying.get(rank, 0), f"rank {rank} exited {p.returncode}:\n{output}"
    return [None if rank in dying else torch.load(out / f"rank{rank}.pt", weights_only=False)
            for rank in range(len(processes))]


def run(scenario: str, world: int, out: pathlib.Path, dying: dict[int, int] | None = None, **options) -> list[dict]:
    return finish(start(scenario, world, out, **options), out, dying=dying)


def torchrun(module: str, out: pathlib.Path, processes: int = 2) -> list[dict]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N -m module out``, as a user
    launches a script (torchrun sets each process's environment, which the libraries read); each
    rank's result, what ``module`` wrote to ``<out>/rank<r>.json``."""
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={processes}", "-m", module, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]


def _main(scenario: str, rank: int, world: int, port: int, out: str) -> None:
    import datetime
    import faulthandler

    faulthandler.enable()  # a crash in C++ still prints each thread's Python stack into the failure

    import torch.distributed as dist

    from tests.distributed import scenarios

    torch.set_num_threads(1)
    options = torch.load(pathlib.Path(out) / "options.pt", weights_only=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=options.pop("timeout", 60)))
    result = getattr(scenarios, scenario)(rank, world, pathlib.Path(out), **options)
    torch.save(result, pathlib.Path(out) / f"rank{rank}.pt")
    if result.get("error") is None:
        dist.destroy_process_group()
    else:  # a peer died: the group cannot be shut down in order
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
