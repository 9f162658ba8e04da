"""``afd-ext bench``: the layer exchange against the reference call pattern and raw NCCL.

Entry point :func:`main` (``python -m afd_ext bench ...`` dispatches here;
``python -m afd_ext.tools.bench ...`` works too). See ``docs/benchmarks.md`` for
the method and the published numbers.

Typical runs on the two-GPU machine::

    python -m afd_ext bench --check --out out/check          # bit-exact self-check, every variant
    python -m afd_ext bench --out out/bench                  # default sweep, ~1 min on 2x H200
    python -m afd_ext bench --quick --out out/quick          # 1, 128, 8192 tokens
    python -m afd_ext bench --control-only --out out/control # the control plane at real step gaps
    python -m afd_ext bench --peer-structure --out out/ps    # the peer-memory plane vs minimal kernels

Without GPUs (CI) the same commands run the gloo path at tiny sizes.
"""


from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Sequence

from afd_ext.errors import AFDConfigError
from afd_ext.tools.bench.plan import (ALL_VARIANTS, FP8_VARIANTS, MODES, Case, Reps, RunConfig, check_cases,
                                      default_cases, gloo_cases, make_layout, parse_int_list, parse_names,
                                      quick_cases)

__all__ = ["main", "build_parser"]

logger = logging.getLogger("afd_ext.tools.bench")


def _seconds(text: str) -> float:
    """An argparse type: seconds > 0 (argparse turns the error into a usage error, exit 2)."""
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return v


def _check_out(out: str) -> None:
    """Refuse an output path that cannot be written before anything runs.

    Raises:
        AFDConfigError: the directory (``out``, or a ``.json`` path's folder) cannot be made or written.
    """
    folder = (os.path.dirname(out) or ".") if out.endswith(".json") else out
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise AFDConfigError(f"--out {out}: cannot write to {folder} ({e.strerror or e})") from None


def build_parser(prog: str = "afd-ext bench") -> argparse.ArgumentParser:
    """The ``afd-ext bench`` argument parser."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark the AFD layer exchange (this package's ops and its connector's data calls vs the "
                    "reference connector's call pattern and raw NCCL, or gloo on CPU); JSON + markdown + PNG.",
    )
    add = p.add_argument
    add("--out", default="bench-out", metavar="PATH", help="output directory or a .json path (default: bench-out)")
    add("--quick", action="store_true", help="small sweep (GPU: 1, 128, 8192 tokens, hidden 7168, logits+ids)")
    add("--check", action="store_true", help="verify every variant's data bit-exactly at a few sizes (no timing)")
    add("--backend", choices=("auto", "nccl", "gloo"), default="auto",
        help="nccl: CUDA tensors over this package's NCCL ops; gloo: CPU tensors (smoke test)")
    add("--attention-ranks", type=int, default=1, metavar="A", help="attention processes (default: 1)")
    add("--ffn-ranks", type=int, default=1, metavar="F", help="FFN processes (default: 1)")
    add("--gpu-map", metavar="LIST", help="GPU per process, attention ranks first (e.g. 0,0,1 for 2A1F)")
    add("--hidden", metavar="LIST", help="hidden sizes, e.g. 2048,7168 (overrides the sweep)")
    add("--tokens", metavar="LIST", help="tokens per attention rank, e.g. 1,128,8192 (overrides the sweep)")
    add("--extras", choices=("both", "on", "off"), default="both",
        help="with --hidden/--tokens: fp32 router logits [n, 256] + int32 ids on, off or both")
    add("--variants", default=",".join(ALL_VARIANTS), metavar="LIST",
        help=f"comma list of {', '.join(ALL_VARIANTS + FP8_VARIANTS)} (default: all but the FP8 ones)")
    add("--fp8-scale-format", choices=("fp32", "ue8m0"), default="fp32", help="the FP8 variants' scales (docs/fp8.md)")
    add("--modes", metavar="LIST", help="eager and/or graph (default: both; graph needs CUDA)")
    add("--time-per-point", type=_seconds, metavar="S",
        help="timed seconds per (case, variant, mode); default 0.05 (0.02 with --quick, 0.005 on gloo)")
    add("--rounds", type=int, metavar="N",
        help="blocks per measurement, variants alternated block by block (default 2 on GPUs, 1 on gloo)")
    add("--peer-structure", action="store_true",
        help="only the peer-memory plane against minimal kernels (own options: --peer-structure --help)")
    add("--control-only", action="store_true", help="only the control-plane table at --control-gaps (about 1 min)")
    add("--control-gaps", metavar="MS", help="step gaps of the control-plane table, ms (default: 1,5,20,50)")
    add("--timeout", type=_seconds, metavar="S",
        help="deadline for the whole run, s (default 420; 240 with --check): past it the workers are ended")
    add("--case-timeout", type=_seconds, metavar="S",
        help="deadline of every wait on the GPU or a peer, s (default 60 on GPUs, 20 on gloo)")
    add("--no-plot", action="store_true", help="skip the PNG")
    add("--no-progress", action="store_true", help="no progress bar")
    add("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _gpu_count() -> int:
    """GPUs the NCCL path can use here: 0 when the connector's rule says NCCL cannot run (gloo path)."""
    try:
        import torch

        from afd_ext.transport import transport_availability

        why = transport_availability()["nccl"]  # the connector's own check (CUDA build, visible GPU)
        if why is not None and torch.cuda.device_count() > 0:  # unusable GPUs deserve a word; none is the CPU case
            logger.warning("not timing NCCL: %s; using the gloo path", why)
        return 0 if why is not None else torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001 - no usable GPU path
        logger.warning("no usable GPU path (%s: %s); using the gloo path", type(e).__name__, e)
        return 0


def _git_commit() -> str:
    """The checkout's commit, ``-dirty`` when tracked files changed (tags excluded: always the hash)."""
    try:
        r = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"],
                           cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def _meta(cfg: RunConfig, argv: Sequence[str]) -> dict:
    import torch

    try:
        from afd_ext import ops

        info = ops.build_info()
    except Exception as e:  # noqa: BLE001 - informative only
        info = {"error": f"{type(e).__name__}: {e}"}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(), "host": socket.gethostname(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "backend": cfg.backend,
        "layout": dict(dataclasses.asdict(cfg.layout), description=cfg.layout.describe()),
        "shared_gpu": cfg.layout.shared, "reps": dataclasses.asdict(cfg.reps), "modes": list(cfg.modes),
        "variants": list(cfg.variants), "fp8_scale_format": cfg.fp8_scale_format, "argv": list(argv),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "AFD_", "TORCH_NCCL", "CUDA_VISIBLE", "TORCH_SYMM"))},
        "build_info": info, "nccl_runtime": info.get("nccl_runtime"), "nccl_compiled": info.get("nccl_compiled"),
    }


def _config(args: argparse.Namespace) -> RunConfig:
    """The run ``args`` ask for.

    Raises:
        AFDConfigError: a bad option, or a timing run whose processes would share a GPU.
    """
    from afd_ext.tools.testing import find_free_port

    ngpu = 0 if args.backend == "gloo" else _gpu_count()
    if args.backend == "nccl" and ngpu == 0:
        raise AFDConfigError("--backend nccl needs a visible GPU and a CUDA build of afd_ext")
    cuda = ngpu > 0
    gpu_map = parse_int_list(args.gpu_map, "--gpu-map", least=0) if args.gpu_map else None
    layout = make_layout(args.attention_ranks, args.ffn_ranks, ngpu, gpu_map)
    if args.hidden or args.tokens:
        extras = {"both": (True, False), "on": (True,), "off": (False,)}[args.extras]
        hiddens = parse_int_list(args.hidden or "7168", "--hidden")
        tokens = parse_int_list(args.tokens or "1,128,8192", "--tokens")
        cases = [Case(h, t, e, logits_width=256 if cuda else 16) for h in hiddens for t in tokens for e in extras]
    elif args.check:
        cases = check_cases(cuda)
    else:
        cases = (quick_cases() if args.quick else default_cases()) if cuda else gloo_cases()
    variants = parse_names(args.variants, ALL_VARIANTS + FP8_VARIANTS, "--variants")
    modes = parse_names(args.modes or ",".join(MODES), MODES, "--modes")
    if args.rounds is not None and args.rounds < 1:
        raise AFDConfigError(f"--rounds must be >= 1, got {args.rounds}")
    if cuda:
        reps = Reps(target_s=args.time_per_point or (0.02 if args.quick else 0.05), rounds=args.rounds or 2)
    elif "graph" in modes and args.modes is not None:
        raise AFDConfigError(f"--modes {args.modes}: graph mode needs CUDA (the NCCL backend); on CPU "
                             "(gloo) the bench runs eager only")
    else:  # CPU tensors: eager only, few short blocks unless asked for more
        modes = ("eager",)
        reps = Reps(target_s=args.time_per_point or 0.005, min_iters=4,
                    max_iters=20 if args.time_per_point is None else 400, warmup=1, rounds=args.rounds or 1)
    case_timeout = args.case_timeout or (60.0 if cuda else 20.0)
    if layout.shared and not args.check:
        raise AFDConfigError(f"refusing to time: processes share a GPU ({layout.describe()}), so the driver "
                             "time-slices them; give every process its own GPU, or use --check")
    return RunConfig(backend="nccl" if cuda else "gloo", layout=layout, cases=cases, variants=variants, modes=modes,
                     reps=reps, master_port=find_free_port(), check=bool(args.check), progress=not args.no_progress,
                     case_timeout_s=case_timeout, fp8_scale_format=args.fp8_scale_format)


def _control_gaps(text: str | None) -> tuple[float, ...]:
    """``--control-gaps``: ms between steps, each > 0.

    Raises:
        AFDConfigError: not a comma list of positive numbers.
    """
    from afd_ext.tools.bench.control import DEFAULT_GAPS_MS

    try:
        gaps = DEFAULT_GAPS_MS if text is None else tuple(float(g) for g in text.split(","))
    except ValueError:
        gaps = ()
    if not gaps or min(gaps) <= 0:
        raise AFDConfigError(f"--control-gaps: expected comma-separated ms > 0, got {text!r}")
    return gaps


def _assemble(meta: dict, cfg: RunConfig, results: list[dict]) -> dict:
    from afd_ext.tools.bench.report import SCHEMA, connector_overhead, evaluate_targets

    meta["devices"] = "; ".join(f"{r['role']}{r['role_rank']}: {r['device']} (GPU {r.get('cuda_visible_devices')})"
                                for r in results if r.get("device")) or "CPU"
    # Every rank reports the same skipped variants (agreed in runner._setup_variants).
    doc = {"schema": SCHEMA, "meta": meta, "records": [x for r in results for x in r["records"]],
           "skipped": results[0]["skipped"], "targets": []}
    if cfg.check:
        doc["checks"] = [c for r in results for c in r["checks"]]
    else:
        doc["targets"], doc["connector_overhead"] = evaluate_targets(doc), connector_overhead(doc)
    return doc


def _print_checks(checks: list[dict]) -> int:
    bad = [c for c in checks if not c["ok"]]
    failed = Counter((c["variant"], c["mode"]) for c in bad)
    print(f"{'variant':<16} {'mode':<6} {'checks':>6}  result")
    for (v, m), n in sorted(Counter((c["variant"], c["mode"]) for c in checks).items()):
        print(f"{v:<16} {m:<6} {n:>6}  {f'FAILED ({failed[v, m]})' if failed[v, m] else 'OK'}")
    for c in bad[:20]:
        print(f"FAIL {c['case_key']} {c['variant']}/{c['mode']} at {c['role']} "
              f"{c['role_rank']}: {'; '.join(c['errors'])}")
    print(f"check: {len(checks) - len(bad)} of {len(checks)} passed" if checks else "check: no check ran (see skipped)")
    return len(bad)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``afd-ext bench``; returns the process exit code (0 ok, 1 failed check/run, 2 bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--peer-structure" in argv:  # the plane against minimal kernels: its own options
        from afd_ext.tools.bench.peer_structure import main as peer_structure_main

        argv.remove("--peer-structure")
        return peer_structure_main(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        if args.control_only:
            gaps = _control_gaps(args.control_gaps)
        elif args.control_gaps is not None:
            raise AFDConfigError("--control-gaps applies to --control-only only")
        else:
            cfg = _config(args)
        _check_out(args.out)  # last: a refused option leaves no folder behind
    except ValueError as e:
        print(f"afd-ext bench: {e}", file=sys.stderr)
        return 2
    if args.control_only:
        from afd_ext.tools.bench.control import control_main

        return control_main(gaps, out=args.out)
    from afd_ext.tools.bench import report
    from afd_ext.tools.bench.runner import bench_worker
    from afd_ext.tools.testing import run_workers

    what = "check" if cfg.check else "sweep"
    timed = "NCCL on CUDA tensors" if cfg.backend == "nccl" else "gloo on CPU tensors ({}{})".format(
        "--backend gloo" if args.backend == "gloo" else "no usable GPU here",
        "" if cfg.check else "; timings check the harness, not the GPU data path")
    logger.info("afd-ext bench %s over %s: %s, %d cases, variants %s, modes %s", what, timed,
                cfg.layout.describe(), len(cfg.cases), ",".join(cfg.variants), ",".join(cfg.modes))
    meta, t0, lay = _meta(cfg, argv), time.monotonic(), cfg.layout
    timeout = args.timeout or (240.0 if cfg.check else 420.0)
    try:  # the workers' deadline leaves 5 s of --timeout to end them
        results = run_workers(bench_worker, lay.num_attention_ranks + lay.num_ffn_ranks, (cfg,),
                              timeout_s=max(40.0, timeout - 5.0), per_rank_env=lay.env() or None)
    except Exception as e:  # noqa: BLE001 - one clear line, then the worker's traceback
        print(f"afd-ext bench: the {what} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    doc = _assemble(meta, cfg, results)
    paths = report.write_outputs(doc, args.out, plot=not args.no_plot and not cfg.check)
    if cfg.check:
        nbad = _print_checks(doc["checks"])
        for s in doc["skipped"]:
            print(f"skipped {s['case_key']} {s['variant']}: {s['reason']}")
    else:
        print(report.render_markdown(doc))
    print("wrote " + ", ".join(paths.values()))
    if cfg.check:
        return 1 if nbad or not doc["checks"] else 0
    if cfg.backend == "gloo":
        print("note: these are gloo times on CPU tensors: they check the harness; they say nothing about the "
              "NCCL path on GPUs (see the note at the top of bench.md and docs/benchmarks.md)")
    return 0
