"""Print each benchmark's mean as a ratio to its group's baseline (the eager run, else the group's
first benchmark), from a pytest-benchmark JSON; a paired benchmark's own ratio where it has one."""
from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    benchmarks = json.load(open(path))["benchmarks"]
    baseline: dict[str, tuple[str, float]] = {}
    for bench in sorted(benchmarks, key=lambda b: not b["name"].startswith("test_eager")):
        baseline.setdefault(bench["group"], (bench["name"], bench["stats"]["mean"]))
    for bench in benchmarks:
        mean = bench["stats"]["mean"]
        name, base = baseline[bench["group"]]
        paired = bench.get("extra_info", {}).get("ratio")
        if paired is not None:  # measured alternating with its baseline (test_step_time.test_paired)
            print(f"{bench['name']:<45} {mean * 1000:9.2f} ms   x{paired:.3f} vs its baseline, paired")
            continue
        print(f"{bench['name']:<45} {mean * 1000:9.2f} ms   x{mean / base:.2f} vs {name}")


if __name__ == "__main__":
    main(sys.argv[1])
