"""The ``meshlab`` console command: ``meshlab export``, ``meshlab plan``, ``meshlab
lab-settings`` and ``meshlab compare-losses``."""

from __future__ import annotations

import argparse
import os
import sys

from meshlab.notebook import lab_settings
from meshlab.notebook.export import notebook
from meshlab.plan import cli as plan_cli
from meshlab.verify import losses_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshlab", description="meshlab outside a notebook.")
    commands = parser.add_subparsers(dest="command", required=True)
    notebook.add_command(commands)
    plan_cli.add_command(commands)
    lab_settings.add_command(commands)
    losses_cli.add_command(commands)
    args = parser.parse_args(argv)
    try:
        code = int(args.run(args, parser))
        sys.stdout.flush()  # a closed pipe raises here, not at exit where nothing can catch it
    except BrokenPipeError:
        # `meshlab plan ... | head -1`: the reader left; end quietly, as the signal module's
        # "Note on SIGPIPE" shows (stdout to devnull so the exit flush cannot raise again)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    raise SystemExit(main())
