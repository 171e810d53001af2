"""The ``pxn`` command line: ``pxn topo`` (topology and routes) and ``pxn bench`` (the main benchmark).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file
only dispatches. Exit codes: 0 success, 2 bad input / environment (one clear line on stderr, no traceback).
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "topo": ("transport.topo_cli", "show GPUs, NIC ports, distance classes and each GPU's rails"),
    "bench": ("transport.bench_cli", "run the main benchmark (default: sglang transfer shapes)"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="pxn", description="pxn: PXN relay for KV-cache transfer")
    sub = parser.add_subparsers(dest="command", required=True)
    # Only the chosen subcommand's module is imported: one broken or heavy subcommand never takes the
    # others down with it (``pxn topo`` must work on a machine where the engine cannot start).
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    module = None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
