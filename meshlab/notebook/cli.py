"""The ``meshlab`` console command: ``meshlab export`` and ``meshlab plan``."""

from __future__ import annotations

import argparse

from meshlab.notebook.export import notebook
from meshlab.plan import cli as plan_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshlab", description="meshlab outside a notebook.")
    commands = parser.add_subparsers(dest="command", required=True)
    notebook.add_command(commands)
    plan_cli.add_command(commands)
    args = parser.parse_args(argv)
    return int(args.run(args, parser))


if __name__ == "__main__":
    raise SystemExit(main())
