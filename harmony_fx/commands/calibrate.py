"""``harmony-fx calibrate``: this machine's measured figures (what HostDevice predictions use), the
checks they pass or fail, and ``--refresh`` to measure them afresh (on a quiet machine).

Without ``--refresh`` it does what a first prediction in a process does (``calibrate.host_calibration``):
the stored figures are used if they are plausible and agree with a quick re-measure, else they are
measured again; it prints which, and why.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import warnings

__all__ = ["add_parser", "run"]


def add_parser(commands) -> None:
    calibrate = commands.add_parser("calibrate", help="show (or --refresh) this machine's measured figures",
                                    description=__doc__)
    calibrate.add_argument("--refresh", action="store_true",
                           help="measure now and replace the stored figures (run it on a quiet machine)")


def run(args: argparse.Namespace) -> int:
    from harmony_fx import calibrate

    print(f"this machine: {calibrate.cache_key()}")
    print(f"cache file: {calibrate.cache_path()}")
    if args.refresh:
        print("measuring (a few seconds)...", flush=True)
        calibration = calibrate.recalibrate(merge=False)
        print("measured and stored:")
    else:
        with warnings.catch_warnings():  # a doubtful figure is said below, with all of its problems
            warnings.simplefilter("ignore")
            calibration, reasons = calibrate.checked()
        print(f"measured again ({'; '.join(reasons)}) and stored:" if reasons
              else "stored, plausible, and a quick re-measure agrees:")
    measured = datetime.datetime.fromtimestamp(calibration.measured_at).strftime("%Y-%m-%d %H:%M:%S")
    print(f"  measured {measured}; each figure from its fastest trials, with its spread (median trial over the "
          f"fastest) and the load average per core then")
    print(calibration.describe())
    problems = calibration.problems(calibrate.torch_built_at())
    if problems:
        print("doubtful: " + "; ".join(problems) + ". Predicted times may be off; run `harmony-fx calibrate "
              "--refresh` when the machine is quiet.", file=sys.stderr)
    return 0
