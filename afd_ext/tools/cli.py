"""The ``afd-ext`` command line.

Subcommands (each forwards the rest of the command line to its module's
``main(argv)``, imported only when chosen):

* ``demo``   -> :func:`afd_ext.tools.demo.main`: a transformers MoE decoder served
  AFD-style across processes, checked against the whole model;
* ``bench``  -> :func:`afd_ext.tools.bench.main`: the benchmarks;
* ``launch`` -> :func:`afd_ext.tools.launch.main`: start AFD processes;
* ``info``   -> what was built (:func:`afd_ext.ops.build_info`: CUDA kernels and
  NCCL ops or CPU only, NCCL, torch, arch list), what this machine shows
  (visible GPUs) and so which transports can run here.

``python -m afd_ext ...`` is the same command.

Every subcommand fails the same way: an error is one line on stderr,
``afd-ext <command>: <ErrorClass>: <message>``, exit code 1 (``-v`` or
``--verbose`` adds the traceback; a failed worker process is named with its
own error class); Ctrl-C is one line, exit code 130. Bad arguments exit 2
(argparse). A missing extra (``demo``, ``bench``) is a one-line hint before any
work starts.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import traceback
from typing import Any, Callable, Sequence

#: subcommand -> (module, function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("afd_ext.tools.demo", "main",
             "serve a transformers MoE model AFD-style and check it against the whole model"),
    "bench": ("afd_ext.tools.bench", "main", "run the transport benchmarks"),
    "launch": ("afd_ext.tools.launch", "main", "start attention and FFN processes"),
    "info": ("afd_ext.tools.cli", "_info",
             "print what was built (CUDA/NCCL or CPU only), the GPUs visible here, and the transports that can run"),
}


#: subcommand -> (extra, import names it needs): pyproject's [project.optional-dependencies]
#: (tests/test_cli.py keeps the two equal).
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "demo": ("demo", ("transformers", "tqdm")),
    "bench": ("bench", ("matplotlib", "tqdm")),
}


#: (subcommand, module) -> options with which the subcommand never imports that module.
_UNNEEDED_WITH: dict[tuple[str, str], tuple[str, ...]] = {
    ("demo", "tqdm"): ("--no-progress",),
    ("bench", "tqdm"): ("--no-progress",),
    ("bench", "matplotlib"): ("--no-plot", "--check", "--control-only"),
}


def missing_extra(command: str, argv: Sequence[str] = ()) -> str | None:
    """The one-line hint for a subcommand (run with ``argv``) whose extra is not installed, or None."""
    if command not in EXTRAS:
        return None
    extra, modules = EXTRAS[command]
    missing = [m for m in modules if importlib.util.find_spec(m) is None
               and not set(_UNNEEDED_WITH.get((command, m), ())) & set(argv)]
    if not missing:
        return None
    return (f"afd-ext {command} needs {', '.join(missing)} (the '{extra}' extra): "
            f"pip install 'afd_ext[{extra}]'")


def error_line(command: str, e: BaseException) -> str:
    """The one line ``afd-ext <command>`` prints for an error: its class and the first line of its message; a
    worker's failure (:class:`afd_ext.tools.testing.WorkerError`) as ``"<Class> in <worker>: <first line>"``."""
    from afd_ext.tools.testing import WorkerError

    line = e.exception_line() if isinstance(e, WorkerError) else None
    cls, msg = line or (type(e).__name__, (str(e).strip().splitlines() or [""])[0])
    if line is not None:
        cls += f" in {getattr(e, 'label', None) or f'worker rank {e.rank}'}"
    return f"afd-ext {command}: {cls}: {msg}" if msg else f"afd-ext {command}: {cls}"


def ranged(cast: Callable[[str], Any], low: float, high: float | None = None, *, above: bool = False):
    """An argparse ``type``: ``cast(text)`` refused below ``low`` (at ``low`` too with ``above``) or above ``high``.

    The subcommands' numeric options use it, so a bad value is argparse's usage error (exit 2) before any
    process starts, naming the option.
    """
    def parse(text: str) -> Any:
        v = cast(text)
        if not ((v > low if above else v >= low) and (high is None or v <= high)):  # NaN too
            bound = f"in {low}..{high}" if high is not None else f"{'>' if above else '>='} {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return v

    parse.__name__ = cast.__name__  # argparse's "invalid int value: 'x'"
    return parse


def _nccl_str(code: int | None) -> str:
    """``22809`` -> ``"2.28.9"`` (NCCL_VERSION_CODE is major*10000 + minor*100 + patch)."""
    return "-" if code is None else f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def info_report() -> dict:
    """What was built and what this machine shows, as one dict (``afd-ext info --json``).

    Returns:
        :func:`afd_ext.ops.build_info` plus ``afd_ext`` (version),
        ``gpus_visible`` (``torch.cuda.device_count()``), ``gpu_names``,
        ``transports`` (the data planes that can run here, from
        :func:`afd_ext.transport.transport_availability`: NCCL needs a CUDA
        build and a visible GPU, gloo always runs), ``unavailable`` (the
        others, with the reason) and ``default_transport`` /
        ``default_transport_why``: what a connector configured with
        ``transport: "auto"`` and no ``device`` uses here
        (:func:`afd_ext.transport.select_transport`), and ``vllm``: the vLLM and
        afd-plugin versions and which class afd-plugin's connector factory
        resolves each connector name to
        (:func:`afd_ext.integrations.afd_plugin.factory_report`).
    """
    import torch

    from afd_ext import __version__
    from afd_ext.ops import build_info
    from afd_ext.transport import select_transport, transport_availability

    built = build_info()
    n = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    avail = transport_availability()
    choice = select_transport("auto")
    # vLLM logs to stdout from its first import (the integration imports afd-plugin, which imports
    # vLLM); its level variable is read then: quiet it (info --json prints JSON).
    from afd_ext.tools.testing import patched_env

    with patched_env({"VLLM_LOGGING_LEVEL": "ERROR"}):
        from afd_ext.integrations.afd_plugin import factory_report

        vllm = factory_report()
    return {"afd_ext": __version__, **built, "gpus_visible": n, "gpu_names": names, "vllm": vllm,
            "transports": [t for t, why in avail.items() if why is None],
            "unavailable": {t: why for t, why in avail.items() if why is not None},
            "default_transport": choice.name, "default_transport_why": choice.why}


def _info_lines(info: dict) -> list[tuple[str, str]]:
    torch_line = info["torch"] + (f" (CUDA {info['torch_cuda']})" if info["torch_cuda"] else " (CPU build)")
    if info["cuda_built"]:
        built = (f"CUDA kernels and NCCL ops (arch {info['arch_list'] or '-'}; NCCL {_nccl_str(info['nccl_compiled'])}"
                 f" compiled, {_nccl_str(info['nccl_runtime'])} loaded)")
    else:
        built = "CPU only (NCCL ops raise 'built without CUDA')"
    gpus = str(info["gpus_visible"]) + (f" ({', '.join(info['gpu_names'])})" if info["gpu_names"] else "")
    run = ", ".join(info["transports"]) + "".join(
        f"; not {t}: {why}" for t, why in info["unavailable"].items())
    default = f"{info['default_transport']} (connector_extra_config.transport \"auto\" without device=)"
    vr = info["vllm"]
    vllm = [("vLLM", f"{vr['vllm'] or 'not installed'} (tested: {', '.join(vr['tested_vllm'])}); "
                     f"afd-plugin {vr['afd_plugin'] or 'not installed'}")]
    for name, cls in (vr["factory"] or {}).items():
        who = "afd_ext" if cls.startswith("afd_ext.") else "NOT afd_ext"
        vllm.append((f"afd-plugin {name}", f"{who} ({cls})"))
    return [("afd_ext", info["afd_ext"]), ("torch", torch_line), ("built with", built),
            ("GPUs visible", gpus), ("transports", run), ("default", default)] + vllm


def _info(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="afd-ext info", description=SUBCOMMANDS["info"][2])
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(list(argv))
    info = info_report()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
    else:
        lines = _info_lines(info)
        width = max(len(k) for k, _ in lines)
        for k, v in lines:
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
    command, rest = argv[0], argv[1:]
    own = rest[:rest.index("--")] if "--" in rest else rest  # after '--': launch's command
    verbose = any(a in ("-v", "--verbose") for a in own)
    wants_help = any(a in ("-h", "--help") for a in own)
    hint = None if wants_help else missing_extra(command, own)
    if hint is not None:
        print(hint, file=sys.stderr)
        return 1
    try:
        rc = _resolve(command)(rest)
    except KeyboardInterrupt:
        # On a terminal the ^C (and a progress bar) end the line the cursor is on.
        print(f"{chr(10) if sys.stderr.isatty() else ''}afd-ext {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line (the traceback with -v)
        if verbose:
            traceback.print_exc()  # a worker's failure carries the worker's traceback in its message
        print(error_line(command, e), file=sys.stderr)
        return 1
    return int(rc or 0)

