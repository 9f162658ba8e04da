"""The ``afd-ext`` command line.

Subcommands (each forwards the rest of the command line to its module's
``main(argv)``, imported only when chosen):

* ``demo``   -> :func:`afd_ext.demo.main`: a transformers MoE decoder served
  AFD-style across processes, checked against the whole model;
* ``bench``  -> :func:`afd_ext.bench.main`: the benchmarks;
* ``launch`` -> :func:`afd_ext.launch.main`: start AFD processes;
* ``info``   -> prints :func:`afd_ext.ops.build_info` (CUDA, NCCL, torch, arch list).

``python -m afd_ext ...`` is the same command.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable, Sequence

__all__ = ["main", "SUBCOMMANDS"]

#: subcommand -> (module, function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("afd_ext.demo", "main", "serve a transformers MoE model AFD-style and check it against the whole model"),
    "bench": ("afd_ext.bench", "main", "run the transport benchmarks"),
    "launch": ("afd_ext.launch", "main", "start attention and FFN processes"),
    "info": ("afd_ext.cli", "_info", "print the build: CUDA, NCCL (compiled / run time), torch, arch list"),
}


def _info(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="afd-ext info", description=SUBCOMMANDS["info"][2])
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(list(argv))
    from afd_ext import __version__
    from afd_ext.ops import build_info

    info = {"afd_ext": __version__, **build_info()}
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0


def _resolve(name: str) -> Callable[[Sequence[str]], int | None]:
    module, func, _ = SUBCOMMANDS[name]
    return getattr(importlib.import_module(module), func)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``afd-ext``; returns the exit code.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="afd-ext",
        description="afd_ext: the transport for Attention-FFN Disaggregation (AFD) of LLM inference.",
        epilog="Run 'afd-ext <command> --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (_, _, help_) in SUBCOMMANDS.items():
        # add_help=False: '--help' after the command goes to the command's own parser.
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from afd_ext import __version__

        print(f"afd-ext {__version__}")
        return 0
    if argv[0] not in SUBCOMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose one of {', '.join(SUBCOMMANDS)}")
    try:
        fn = _resolve(argv[0])
    except ImportError as e:
        print(f"afd-ext {argv[0]}: not available in this installation ({e})", file=sys.stderr)
        return 2
    rc = fn(argv[1:])
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
