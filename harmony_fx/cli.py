"""``harmony-fx``: the command line.

``harmony-fx demo``: train a GPT four times larger than a device's memory budget (``commands/demo.py``).
``harmony-fx plan MODEL``: plan a model on hardware that need not be at hand (``commands/plan.py``).
``harmony-fx calibrate``: this machine's measured figures, checked, or measured afresh (``commands/calibrate.py``).
"""
from __future__ import annotations

import argparse
import sys

from harmony_fx.commands import calibrate, demo, plan

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harmony-fx", description="harmony_fx: train models larger than GPU memory")
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(commands)
    plan.add_parser(commands)
    calibrate.add_parser(commands)
    args = parser.parse_args(argv)
    return {"demo": demo.run, "plan": plan.run, "calibrate": calibrate.run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
