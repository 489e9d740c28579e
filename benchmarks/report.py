"""Print each benchmark's mean as a ratio to its group's eager run, from a pytest-benchmark JSON."""
from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    benchmarks = json.load(open(path))["benchmarks"]
    baseline = {b["group"]: b["stats"]["mean"] for b in benchmarks if b["name"].startswith("test_eager")}
    for bench in benchmarks:
        mean = bench["stats"]["mean"]
        ratio = mean / baseline[bench["group"]] if bench["group"] in baseline else float("nan")
        print(f"{bench['name']:<45} {mean * 1000:9.2f} ms   x{ratio:.2f} vs eager")


if __name__ == "__main__":
    main(sys.argv[1])
