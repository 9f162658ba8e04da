"""Time one layer exchange of the compiled core on two GPUs (1A1F), eager and in a CUDA graph.

Run on the 2-GPU machine after the CUDA build (the FFN rank on GPU 1, the attention
rank on GPU 0, one process each, one NCCL communicator for the edge):

    python tests/gpu/time_exchange.py --out time_exchange.json [--iters 50] [--warmup 10]

Part 1 (hidden 7168 bf16 at 128 and 8192 rows): the round trip seen by the
attention rank (send its rows, the FFN rank receives them with ``fan_in`` and
returns them with ``split_back``, the attention rank receives the reply), with
the attention side as

* ``exchange``            one ``exchange`` op (send + receive in one NCCL group);
* ``exchange+logits+ids`` the same with fp32 router logits [n, 256] and int32 ids;
* ``split_back+fan_in``   two ops (one group each);
* ``raw send/recv``       bare ``ncclSend``/``ncclRecv`` of the same bytes (the ``send``/``recv``
                          ops: one NCCL call each, no group), on both sides;

Part 2 (1..8192 tokens): the wire format. ``per_tensor`` sends hidden + fp32
logits [n, 256] + int32 ids as three messages in one group; ``packed`` packs
them with ``pack_rows`` into one wire row per token, sends one message and the
FFN rank unpacks; the reply (hidden) is the same in both.

Times come from CUDA events on the attention rank's stream, one round trip per
sample, after a warm-up, and are reported in µs as median / p10 / p90. Each
case runs eagerly and as a replayed CUDA graph (captured after the eager
warm-up), in the same run, so ratios are side by side. Prints a table and
writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch

HIDDEN = 7168
EXPERTS = 256
PART1_ROWS = (128, 8192)
PART1_VARIANTS = ("exchange", "exchange+logits+ids", "split_back+fan_in", "raw send/recv")
PART2_ROWS = tuple(2**i for i in range(14))  # 1 .. 8192
PART2_VARIANTS = ("per_tensor", "packed")
MODES = ("eager", "graph")
STORE_TIMEOUT = timedelta(seconds=120)


def plan():
    cases = [(1, v, n, m) for n in PART1_ROWS for v in PART1_VARIANTS for m in MODES]
    cases += [(2, v, n, m) for n in PART2_ROWS for v in PART2_VARIANTS for m in MODES]
    return cases


def _barrier(store, name: str, nprocs: int = 2, timeout_s: float = STORE_TIMEOUT.total_seconds()) -> None:
    store.add(name, 1)
    end = time.monotonic() + timeout_s
    while int(store.add(name, 0)) < nprocs:
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {name}: the other rank did not arrive")
        time.sleep(0.001)


def _buffers(variant: str, n: int, ops):
    dev = "cuda"
    b = {
        "h": torch.randn(n, HIDDEN, device=dev).to(torch.bfloat16),
        "reply": torch.zeros(n, HIDDEN, dtype=torch.bfloat16, device=dev),
    }
    if variant in ("exchange+logits+ids", "per_tensor", "packed"):
        b["lg"] = torch.randn(n, EXPERTS, device=dev)
        b["ids"] = torch.arange(n, dtype=torch.int32, device=dev)
    if variant == "packed":
        width = ops.wire_row_bytes(HIDDEN, torch.bfloat16, EXPERTS, torch.float32, True)
        b["wire"] = torch.zeros(n, width, dtype=torch.uint8, device=dev)
    return b


def _attention_step(variant, b, comms, ops):
    """The attention rank's half: peer (FFN) is rank 0 of the edge communicator."""
    n = b["h"].shape[0]
    ca, cf = comms  # a2f and f2a communicators (the same one with --comms one)
    if variant == "exchange":
        return lambda: ops.exchange(b["h"], None, None, b["reply"], [ca], [cf], [0], [n])
    if variant == "exchange+logits+ids":
        return lambda: ops.exchange(b["h"], b["lg"], b["ids"], b["reply"], [ca], [cf], [0], [n])
    if variant == "split_back+fan_in":
        def step():
            ops.split_back(b["h"], None, None, [ca], [0], [n])
            ops.fan_in(b["reply"], None, None, [cf], [0], [n])
        return step
    if variant == "raw send/recv":
        def step():
            ops.send(b["h"], ca, 0)
            ops.recv(b["reply"], cf, 0)
        return step
    if variant == "per_tensor":
        def step():
            ops.split_back(b["h"], b["lg"], b["ids"], [ca], [0], [n])
            ops.fan_in(b["reply"], None, None, [cf], [0], [n])
        return step
    if variant == "packed":
        def step():
            ops.pack_rows(b["h"], b["lg"], b["ids"], b["wire"])
            ops.split_back(b["wire"], None, None, [ca], [0], [n])
            ops.fan_in(b["reply"], None, None, [cf], [0], [n])
        return step
    raise ValueError(variant)


def _ffn_step(variant, b, comms, ops):
    """The FFN rank's half (no compute): receive the rows, send them back; attention is rank 1."""
    n = b["h"].shape[0]
    ca, cf = comms  # a2f and f2a communicators (the same one with --comms one)
    if variant in ("exchange", "split_back+fan_in"):
        def step():
            ops.fan_in(b["h"], None, None, [ca], [1], [n])
            ops.split_back(b["h"], None, None, [cf], [1], [n])
        return step
    if variant in ("exchange+logits+ids", "per_tensor"):
        def step():
            ops.fan_in(b["h"], b["lg"], b["ids"], [ca], [1], [n])
            ops.split_back(b["h"], None, None, [cf], [1], [n])
        return step
    if variant == "raw send/recv":
        def step():
            ops.recv(b["h"], ca, 1)
            ops.send(b["h"], cf, 1)
        return step
    if variant == "packed":
        def step():
            ops.fan_in(b["wire"], None, None, [ca], [1], [n])
            ops.unpack_rows(b["wire"], b["h"], b["lg"], b["ids"])
            ops.split_back(b["h"], None, None, [cf], [1], [n])
        return step
    raise ValueError(variant)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def worker(rank, nprocs, port, iters, warmup):
    """rank 0: FFN (GPU 1 via CUDA_VISIBLE_DEVICES); rank 1: attention (GPU 0)."""
    from torch.distributed import TCPStore

    from afd_ext import ops

    torch.cuda.set_device(0)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    if rank == 0:
        uid = ops.nccl_unique_id()
        store.set("uid", bytes(uid.tolist()))
    else:
        uid = torch.tensor(list(store.get("uid")), dtype=torch.uint8)
    c = ops.comm_create(uid, 2, 0 if rank == 0 else 1, 0)
    results = []
    stream = torch.cuda.Stream()
    try:
        for i, (part, variant, n, mode) in enumerate(plan()):
            torch.manual_seed(i)
            b = _buffers(variant, n, ops)
            step = (_ffn_step if rank == 0 else _attention_step)(variant, b, c, ops)
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    step()
            stream.synchronize()
            graph = None
            if mode == "graph":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    step()
                torch.cuda.synchronize()
                run = graph.replay
            else:
                run = step
            _barrier(store, f"start/{i}")
            samples = []
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    run()
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
                for start, end in events:
                    start.record()
                    run()
                    end.record()
            stream.synchronize()
            samples = [s.elapsed_time(e) * 1000.0 for s, e in events]  # ms -> µs
            _barrier(store, f"end/{i}")
            if graph is not None:
                del graph
            if rank == 1:
                wire_bytes = sum(t.numel() * t.element_size() for k, t in b.items() if k in ("h", "lg", "ids"))
                results.append({
                    "part": part, "variant": variant, "rows": n, "mode": mode,
                    "median_us": statistics.median(samples), "p10_us": _pct(samples, 0.1), "p90_us": _pct(samples, 0.9),
                    "samples": len(samples), "a2f_bytes": wire_bytes, "f2a_bytes": b["reply"].numel() * 2,
                })
    finally:
        torch.cuda.synchronize()
        ops.comm_destroy(c)
    return results


def _table(rows) -> str:
    lines = [f"{'part':>4} {'variant':<22} {'rows':>6} {'mode':<6} {'median µs':>10} {'p10':>9} {'p90':>9} {'A->F MB':>8}"]
    for r in rows:
        lines.append(
            f"{r['part']:>4} {r['variant']:<22} {r['rows']:>6} {r['mode']:<6} {r['median_us']:>10.1f} "
            f"{r['p10_us']:>9.1f} {r['p90_us']:>9.1f} {r['a2f_bytes'] / 1e6:>8.2f}"
        )
    return "\n".join(lines)


def _format_choice(rows) -> list[dict]:
    """Per (rows, mode): which wire format was faster, and by how much."""
    by = {}
    for r in rows:
        if r["part"] == 2:
            by.setdefault((r["rows"], r["mode"]), {})[r["variant"]] = r["median_us"]
    out = []
    for (n, mode), v in sorted(by.items()):
        if len(v) == 2:
            best = min(v, key=v.get)
            out.append({"rows": n, "mode": mode, "faster": best, "per_tensor_us": v["per_tensor"], "packed_us": v["packed"],
                        "ratio_per_tensor_over_packed": v["per_tensor"] / v["packed"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path (written even when a case fails)")
    p.add_argument("--iters", type=int, default=50, help="timed round trips per case (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed round trips before timing (default 10)")
    p.add_argument("--timeout", type=float, default=540.0,
                   help="deadline for the whole run, restarts included, s; keep an outer `timeout` above it")
    p.add_argument("--case-timeout", type=float, default=45.0,
                   help="deadline of every phase of a case (set-up, warm-up, capture, timed loop, barrier), s; "
                        "past it (+15 s) faulthandler prints every thread's stack and ends the worker")
    p.add_argument("--variants", default=",".join(PART1_VARIANTS + PART2_VARIANTS),
                   help="comma list of " + ", ".join(PART1_VARIANTS + PART2_VARIANTS))
    p.add_argument("--rows", default=None, help="comma list of row counts to keep (default: all of the plan)")
    p.add_argument("--modes", default=",".join(MODES), help="eager and/or graph")
    p.add_argument("--comms", choices=("one", "two"), default="one",
                   help="one NCCL communicator for both directions of the edge, or one per direction")
    p.add_argument("--no-retry", action="store_true",
                   help="stop at the first hung/crashed case instead of restarting without its variant")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in PART1_VARIANTS + PART2_VARIANTS]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad or not variants or not modes or any(m not in MODES for m in modes):
        print(f"--variants/--modes: unknown {bad or modes}; expected {PART1_VARIANTS + PART2_VARIANTS} / {MODES}",
              file=sys.stderr)
        return 2
    rows_keep = {int(x) for x in args.rows.split(",")} if args.rows else None
    if torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    import tempfile

    from torch.distributed import TCPStore

    from afd_ext import ops
    from afd_ext.bench.guard import diagnose, read_parts, read_phases
    from afd_ext.testing import find_free_port, run_workers

    cases = [c for c in plan() if c[1] in variants and c[3] in modes and (rows_keep is None or c[2] in rows_keep)]
    if not cases:
        print("no case left after --variants/--rows/--modes", file=sys.stderr)
        return 2
    grace = 15.0
    root = tempfile.mkdtemp(prefix="afd-time-exchange-")
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    rows, failures, skipped = [], [], []
    attempt = 0
    while cases:
        left = deadline - time.monotonic()
        if left < 10:
            print(f"[time_exchange] no time left for {len(cases)} cases", flush=True)
            break
        parts_dir = os.path.join(root, f"attempt{attempt}")
        print(f"[time_exchange] attempt {attempt}: {len(cases)} cases, {left:.0f} s left, "
              f"phase deadline {args.case_timeout:.0f} s (+{grace:.0f} s)", flush=True)
        port = find_free_port()
        store = TCPStore("127.0.0.1", port, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        try:
            res = run_workers(worker, 2, (port, args.iters, args.warmup, cases, args.case_timeout, grace, parts_dir,
                                          args.comms == "two"),
                              timeout_s=left, per_rank_env=[{"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "0"}])
            rows += res[1]
            cases = []
        except Exception as e:  # noqa: BLE001 - named from the phase files, partial results kept
            diag = diagnose(e, read_phases(parts_dir, 2))
            diag["attempt"] = attempt
            failures.append(diag)
            print(f"[time_exchange] FAILED: {diag['message']}", flush=True)
            parts = read_parts(parts_dir, 2)
            done_ffn = {p["index"] for p in parts[0]}
            done = [p for p in parts[1] if p["index"] in done_ffn]
            rows += [p["row"] for p in done]
            ndone = max((p["index"] + 1 for p in done), default=0)
            cases = cases[ndone:]
            failed = diag.get("variant")
            if args.no_retry or not failed:
                skipped += [{"part": c[0], "variant": c[1], "rows": c[2], "mode": c[3], "reason": diag["message"]}
                            for c in cases]
                break
            drop = [c for c in cases if c[1] == failed]
            skipped += [{"part": c[0], "variant": c[1], "rows": c[2], "mode": c[3], "reason": diag["message"]}
                        for c in drop]
            cases = [c for c in cases if c[1] != failed]
            attempt += 1
        finally:
            del store
    choice = _format_choice(rows)
    report = {
        "what": "1A1F round trip seen by the attention rank (CUDA events), µs",
        "hidden": HIDDEN, "router_logits": [EXPERTS, "float32"], "token_ids": "int32",
        "iters": args.iters, "warmup": args.warmup, "wall_s": time.monotonic() - t0,
        "comms": args.comms, "complete": not failures and not skipped,
        "failures": failures, "skipped": skipped,
        "build_info": ops.build_info(), "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(2)],
        "results": rows, "wire_format_choice": choice,
    }
    print(_table(rows))
    print("\nwire format (part 2): faster per (rows, mode)")
    for c in choice:
        print(f"  {c['rows']:>6} {c['mode']:<6} {c['faster']:<10} per_tensor/packed = {c['ratio_per_tensor_over_packed']:.2f}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for fl in failures:
        print(f"FAILURE (attempt {fl['attempt']}): {fl['message']}")
    if failures:
        print(f"worker phase/parts files kept in {root}")
    print(f"\nwrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
