"""Per-layer exchange time, eager vs CUDA graph, measured in one run (1A1F, one process per GPU).

Usage (on the 2-GPU machine, after the CUDA build):

    python tests/gpu/time_graph_exchange.py --out time_graph.json [--tokens 1 8 64 128]

The FFN rank runs on GPU 1, the attention rank on GPU 0. One layer exchange is
the attention rank's split-back of its wire tensors (hidden states
``[T, 7168]`` bf16, fp32 router logits ``[T, 256]``, int32 token ids) to the FFN rank, the FFN rank's fan-in, its
split-back of the hidden states (no compute), and the attention rank's fan-in
of the reply. Eager: ``afd_ext.tools.bench.timing.time_eager`` over single layers.
Graph: ``GraphController`` captures ``--layers`` layers on both roles (after an
eager warm-up of both edges), ``time_graph`` divides each replay by the layer
count. Both are median (p10, p90) µs per layer over the same run, alternating
eager and graph per token count so drift hits both.

Shared-GPU timings are meaningless (time-sliced), so only 1A1F is offered.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from test_graphs_gpu import Setup, Step, _Ctx  # noqa: E402

logger = logging.getLogger("time_graph_exchange")


def _exchange_only(ctx: _Ctx, sched, bufs, layers: int):
    """Per layer and stage: the exchange alone (no compute on either side)."""
    for _ in range(layers):
        for s in sched.stages:
            b = bufs[s]
            if ctx.role == "attention":
                ctx.attention_exchange(b, sched.attention_plan(s, ctx.rr))
            else:
                plan = sched.ffn_plan(s, ctx.rr)
                ctx.ffn_fan_in(b, plan)
                ctx.ffn_split_back(b["hidden"], plan)


def _worker(rank: int, nprocs: int, args: dict, port: int) -> dict:
    from afd_ext.tools.bench.timing import summarize, time_eager, time_graph
    from afd_ext.graphs import StepMode

    setup = Setup(1, 1, hidden=args["hidden"], layers=args["layers"],
                  logits_width=args["logits_width"])
    ctx = _Ctx(rank, setup, port, nprocs)
    timed = ctx.role == "attention"
    rows = []
    try:
        # Warm both edges (NCCL connects on first use, never inside a capture).
        max_t = max(args["tokens"])
        payload, sched, key = ctx.schedule(Step(((max_t,),), "warmup", seed=1))
        bufs = ctx.buffers(ctx.ctl.new_arena(key), sched)
        _exchange_only(ctx, sched, bufs, 1)
        ctx.ctl.note_eager_step(ctx.ctl.decide(payload, key), sched, ctx.rr)
        for t in args["tokens"]:
            payload, sched, key = ctx.schedule(Step(((t,),), "capture"))
            assert ctx.ctl.decide(payload, key) is StepMode.CAPTURE
            arena = ctx.ctl.new_arena(key)
            bufs = ctx.buffers(arena, sched)
            if timed:
                for s in sched.stages:
                    bufs[s]["send"].normal_()
                    bufs[s]["hidden"].copy_(bufs[s]["send"])
            # Eager: one layer per sample, on the graph's own buffers.
            eager = time_eager(lambda: _exchange_only(ctx, sched, bufs, 1), args["iters"], args["warmup"],
                               cuda=True, timed=timed, what=f"eager exchange T={t}")
            entry = ctx.ctl.capture(key, arena, lambda: _exchange_only(ctx, sched, bufs, setup.layers))
            graph = time_graph(entry.graphs[0], args["replays"], args["warmup"], setup.layers, timed=timed,
                               what=f"graph exchange T={t}")
            torch.cuda.synchronize()
            if timed:
                e, g = summarize(eager), summarize(graph)
                rows.append({
                    "tokens": t,
                    "eager_us": dataclasses.asdict(e),
                    "graph_us": dataclasses.asdict(g),
                    "speedup_median": e.median / g.median if g.median else None,
                })
                logger.info("T=%d eager %.1f us graph %.1f us per layer", t, e.median, g.median)
            ctx.ctl.cache.evict(key)
    finally:
        ctx.close()
    return {"role": ctx.role, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--logits-width", type=int, default=256)
    p.add_argument("--layers", type=int, default=16, help="layers captured per graph")
    p.add_argument("--iters", type=int, default=400, help="timed eager layers")
    p.add_argument("--replays", type=int, default=50, help="timed graph replays")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from afd_ext import ops
    from afd_ext.tools.testing import find_free_port, place_processes, run_workers, visible_gpu_count

    if visible_gpu_count() < 1:
        p.error("needs a CUDA GPU")
    placement = place_processes(1, 1)
    if not placement.timings_meaningful:
        p.error(f"timings need 2 distinct GPUs (attention and FFN on their own GPU); here: {placement.describe()}")

    if not ops.is_cuda_built():
        p.error("afd_ext was built without CUDA")
    args = {"tokens": a.tokens, "hidden": a.hidden, "logits_width": a.logits_width, "layers": a.layers,
            "iters": a.iters, "replays": a.replays, "warmup": a.warmup}
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    reports = run_workers(_worker, 2, (args, find_free_port()), timeout_s=a.timeout, env=env,
                          per_rank_env=placement.env())
    rows = [r for rep in reports for r in rep["rows"]]
    result = {
        "what": "per-layer exchange time (attention send + FFN fan-in + FFN split-back + attention receive), "
                "1A1F, one process per GPU, no compute",
        "hidden": a.hidden, "dtype": "bfloat16", "router_logits": [a.logits_width, "float32"],
        "token_ids": "int32", "layers_per_graph": a.layers, "torch": torch.__version__,
        "nccl": ops.build_info().get("nccl_runtime"), "device": torch.cuda.get_device_name(0), "rows": rows,
    }
    print(f"{'tokens':>6} {'eager p50 (p10-p90) us':>26} {'graph p50 (p10-p90) us':>26} {'x':>5}")
    for r in rows:
        e, g = r["eager_us"], r["graph_us"]
        print(f"{r['tokens']:>6} "
              f"{e['median']:>9.1f} ({e['p10']:.1f}-{e['p90']:.1f}){'':>4} "
              f"{g['median']:>9.1f} ({g['p10']:.1f}-{g['p90']:.1f}){'':>4} {r['speedup_median']:>5.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
