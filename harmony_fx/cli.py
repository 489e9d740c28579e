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


def parser(**options) -> argparse.ArgumentParser:
    """The command line's parser (``options``: ``argparse.ArgumentParser``'s, such as ``exit_on_error``)."""
    made = argparse.ArgumentParser(prog="harmony-fx", description="harmony_fx: train models larger than GPU memory",
                                   **options)
    commands = made.add_subparsers(dest="command", required=True)
    for command in (demo, plan, calibrate):
        command.add_parser(commands)
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return {"demo": demo.run, "plan": plan.run, "calibrate": calibrate.run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
