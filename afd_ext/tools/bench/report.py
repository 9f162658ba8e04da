"""Benchmark results: the JSON document, the markdown tables, the PNG plot, targets.

JSON document (``schema: "afd-ext-bench/1"``)::

    {"schema", "meta": {...machine, versions, date, commit, layout, settings},
     "records": [{"case", "case_key", "A", "F", "variant", "mode", "direction",
                  "role", "role_rank", "peers", "rows", "bytes_a2f", "bytes_f2a",
                  "stats_us": {"median","p10","p90","mean","min","n"},
                  "gbps"?, "graph_iters"?, ...}],
     "skipped": [{"case_key", "variant", "reason"}],
     "targets": [{"target", "value", "goal", "ratio", "met", "detail"}],
     "connector_overhead": [{"case_key", "tokens", "variant", "op_variant", "role",
                             "call", "us", "op_us", "overhead_us", "ratio"}],
     "checks": [...]  (``--check`` runs only)}

Ratios: ``speed-up vs reference = reference median / variant median`` (above
1: faster than the reference pattern); ``x raw = variant median / raw
median`` (how far above the one-message floor). Connector overhead per data call
(eager records carry ``calls_us``: host µs per call, keyed by the connector's call
names): ``overhead_us = connector median - op median``, ``ratio = connector / op``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Sequence

from afd_ext.tools.bench.plan import ALL_VARIANTS, FP8_VARIANTS


SCHEMA = "afd-ext-bench/1"

LABELS = {
    "ours_per_tensor": "ours per-tensor",
    "ours_fp8": "ours FP8 hidden",
    "peer_fp8": "peer FP8 hidden",
    "reference": "reference pattern",
    "connector_peer": "connector (peer)",
}

#: Each connector variant and the op variant it is compared with (the calls its transport makes).
CONNECTOR_PAIRS = (("connector", "ours_per_tensor"), ("connector_peer", "peer"))
#: The connector's data calls per role, in call order.
DATA_CALLS = {"attention": ("send_attn_output", "recv_ffn_output"), "ffn": ("recv_attn_output", "send_ffn_output")}

#: What a CPU (gloo) run can and cannot show; heads its bench.md (the console output ends with a reminder).
CPU_RUN_NOTE = (
    "**CPU run over gloo: a check of the harness, not a measurement of this package's data path.** It shows that "
    "every variant runs end to end and the host-side Python cost on this machine, never the NCCL ops on CUDA "
    "tensors this package is for; its gloo transport bounds every wait, work that the bare `torch.distributed` "
    "calls of `reference` and `raw` do not do, so `vs ref` here says nothing about the NCCL path. GPU results and "
    "the long form of this note: `docs/benchmarks.md`."
)


def variant_label(variant: str, backend: str | None = "nccl") -> str:
    """Column and legend name of a variant, naming the transport that was timed (``raw gloo`` on CPU runs)."""
    if variant == "raw":
        return f"raw {'gloo' if backend == 'gloo' else 'NCCL'} (1 msg)"
    return LABELS.get(variant, variant)


# ---------------------------------------------------------------------------
# Lookups (a document holds one run: one layout)
# ---------------------------------------------------------------------------


def attention_records(doc: dict) -> list[dict]:
    """Records measured on attention ranks (the round trip is seen from there)."""
    return [r for r in doc["records"] if r["role"] == "attention"]


def lookup(doc: dict, case_key: str, variant: str, mode: str, role: str = "attention") -> dict | None:
    """Rank 0 of ``role``'s record for one measurement (the attention rank's: the round trip)."""
    for r in doc["records"]:
        if (r["case_key"], r["variant"], r["mode"], r["role"], r["role_rank"]) == (case_key, variant, mode, role, 0):
            return r
    return None


def _med(r: dict | None) -> float | None:
    return None if r is None else float(r["stats_us"]["median"])


def _cases(doc: dict) -> list[dict]:
    seen: dict[str, dict] = {}
    for r in doc["records"]:
        seen.setdefault(r["case_key"], dict(r["case"], A=r["A"], F=r["F"], key=r["case_key"]))
    return sorted(seen.values(), key=lambda c: (c["hidden"], not c["extras"], c["tokens"]))


# ---------------------------------------------------------------------------
# Targets (docs/benchmarks.md, "Targets")
# ---------------------------------------------------------------------------


def evaluate_targets(doc: dict) -> list[dict]:
    """Measured value, goal and verdict for every NCCL-path target (``docs/benchmarks.md``) the data covers.

    Uses 1A1F, hidden 7168, router logits + token ids, attention rank 0.
    ``met`` is None when the data for a target is missing.
    """
    out: list[dict] = []
    cases = [c for c in _cases(doc) if c["A"] == c["F"] == 1 and c["hidden"] == 7168 and c["extras"]
             and (c["tokens"] <= 128 or c["tokens"] == 8192)]
    for mode, small_goal in (("graph", 1.8), ("eager", 2.0)):
        for c in cases:
            t = c["tokens"]
            goal = small_goal if t <= 128 else 1.15
            ref = _med(lookup(doc, c["key"], "reference", mode))
            ours = _med(lookup(doc, c["key"], "ours_per_tensor", mode))
            ratio = ref / ours if ref and ours else None
            out.append({"target": f"vs reference pattern, {mode}, {t} tokens", "value": ours, "goal": f">= {goal}x",
                        "ratio": ratio, "met": None if ratio is None else ratio >= goal,
                        "detail": f"reference {ref and round(ref, 2)} µs / ours {ours and round(ours, 2)} µs"})
    return out


def connector_overhead(doc: dict) -> list[dict]:
    """Eager host µs of each connector data call against the op call it makes, rank 0 of each role, per case.

    One row per (case, connector variant, call) where both variants were timed (``CONNECTOR_PAIRS``),
    then one ``"round trip"`` row (the attention rank's round trip, both data calls of both roles).
    Medians of the run's alternated blocks; ``overhead_us`` = connector - op, ``ratio`` = connector / op.
    """
    out: list[dict] = []
    for c in _cases(doc):
        for conn, op in CONNECTOR_PAIRS:
            pairs = []
            for role, calls in DATA_CALLS.items():
                a, b = lookup(doc, c["key"], conn, "eager", role), lookup(doc, c["key"], op, "eager", role)
                for call in calls:
                    x, y = (r and r.get("calls_us", {}).get(call) for r in (a, b))
                    if x and y:
                        pairs.append((role, call, x["median"], y["median"]))
            a, b = lookup(doc, c["key"], conn, "eager"), lookup(doc, c["key"], op, "eager")
            if a and b:
                pairs.append(("attention", "round trip", _med(a), _med(b)))
            out += [{"case_key": c["key"], "tokens": c["tokens"], "variant": conn, "op_variant": op, "role": role,
                     "call": call, "us": x, "op_us": y, "overhead_us": x - y, "ratio": x / y if y else None}
                    for role, call, x, y in pairs]
    return out


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------


def _fmt_us(r: dict | None) -> str:
    if r is None:
        return "–"
    s = r["stats_us"]
    return f"{s['median']:.1f} ({s['p10']:.1f}–{s['p90']:.1f})"


def _fmt(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if v is None else f"{v:{spec}}{suffix}"


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table's lines (every ``afd-ext bench`` mode prints its tables with it)."""
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _section(title: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A titled table, or nothing without rows."""
    return [f"## {title}", "", *md_table(head, rows), ""] if rows else []


def render_markdown(doc: dict) -> str:
    """Markdown: round-trip tables per (hidden, payload, mode), fan-in, targets, skipped variants."""
    meta = doc.get("meta", {})
    backend = meta.get("backend") or "nccl"
    gloo = backend == "gloo"
    timed = (f"gloo, torch.distributed's gloo backend (TCP) on CPU tensors; torch {meta.get('torch', '?')}" if gloo
             else f"NCCL, this package's NCCL ops on CUDA tensors; torch {meta.get('torch', '?')}, NCCL runtime "
                  f"{meta.get('nccl_runtime', '?')}")
    lines = ["# afd-ext bench results", "", *([CPU_RUN_NOTE, ""] if gloo else []),
             f"- date: {meta.get('date', '?')}, commit: {meta.get('commit', '?')}",
             f"- machine: {meta.get('devices', '?')}; layout: {meta.get('layout', {}).get('description', '?')}",
             f"- transport timed: {timed}",
             "- times: median µs (p10–p90), per iteration; ratios from medians measured side by side; `vs ref` = "
             f"reference / ours-default (higher is better), `x raw` = ours-default / raw {'gloo' if gloo else 'NCCL'}.",
             ""]
    variants_present = [v for v in ALL_VARIANTS + FP8_VARIANTS if any(r["variant"] == v for r in doc["records"])]
    groups: dict[tuple, list[dict]] = {}
    for c in _cases(doc):
        groups.setdefault((c["A"], c["F"], c["hidden"], c["extras"]), []).append(c)
    for (A, F, hidden, extras), cs in groups.items():
        for mode in ("graph", "eager"):
            rows = []
            for c in cs:
                cells = {v: lookup(doc, c["key"], v, mode) for v in variants_present}
                if not any(cells.values()):
                    continue
                ours, ref, raw = cells.get("ours_per_tensor"), cells.get("reference"), cells.get("raw")
                rows.append([str(c["tokens"]), *(_fmt_us(cells[v]) for v in variants_present),
                             _fmt(_med(ref) / _med(ours) if ref and ours else None, ".2f", "×"),
                             _fmt(_med(ours) / _med(raw) if raw and ours else None, ".2f", "×"),
                             _fmt(ours and ours.get("gbps"), ".1f")])
            width = cs[0].get("logits_width", 256)
            payload = f"hidden + fp32 logits [n, {width}] + int32 ids" if extras else "hidden only"
            head = ["tokens", *(variant_label(v, backend) for v in variants_present), "vs ref", "x raw", "GB/s (rt)"]
            fp8 = [r for r in doc["records"] if "hidden_bytes_per_token" in r and r["variant"].endswith("_fp8")
                   and r["case"]["hidden"] == hidden]
            wire = (f" ({2 * hidden:,} B/token; FP8 variants {fp8[0]['hidden_bytes_per_token']:,} B/token)"
                    if fp8 else "")
            lines += _section(f"Round trip, {A}A{F}F, hidden {hidden} bf16{wire}, {payload}, {mode}", head, rows)
    over = doc.get("connector_overhead") or connector_overhead(doc)
    rows = [[o["case_key"], f"{variant_label(o['variant'])} vs {variant_label(o['op_variant'], backend)}",
             o["call"], f"{o['us']:.1f}", f"{o['op_us']:.1f}", f"{o['overhead_us']:+.1f}",
             _fmt(o["ratio"], ".2f", "×")] for o in sorted(over, key=lambda o: (o["tokens"], o["case_key"]))]
    note = "; on gloo a receive's time includes the wait for its peer" if gloo else ""
    lines += _section(f"Connector overhead per data call (eager, host µs per call, median{note})",
                      ["case", "variants", "call", "connector µs", "op µs", "overhead µs", "ratio"], rows)
    lines += _section("Fan-in (several attention ranks per FFN rank)",
                      ["layout", "case", "mode", "variant", "rt median per attention rank (µs)", "spread (µs)"],
                      _fan_in_rows(doc, backend))
    # The targets are for the NCCL data path: a gloo run's times cannot meet or miss them.
    verdict = {True: "yes", False: "**no**", None: "n/a"}
    rows = [[t["target"], _fmt(t["value"], ".2f"), t["goal"], _fmt(t["ratio"], ".2f", "×"),
             "not applicable on gloo" if gloo else verdict[t["met"]], t["detail"]] for t in doc.get("targets") or ()]
    lines += _section("Targets (docs/benchmarks.md, for the NCCL path on GPUs; `ratio` = reference or floor / "
                      "ours, higher is better)", ["target", "measured", "goal", "ratio", "met", "detail"], rows)
    if doc.get("skipped"):
        reasons = Counter((s["variant"], s["reason"]) for s in doc["skipped"])
        lines += ["## Skipped", "", *(f"- {v} ({n} cases): {why}" for (v, why), n in sorted(reasons.items()))]
    return "\n".join(lines).rstrip() + "\n"


def _fan_in_rows(doc: dict, backend: str) -> list[list[str]]:
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in attention_records(doc):
        if r["A"] > 1:
            groups.setdefault((r["A"], r["F"], r["case_key"], r["mode"], r["variant"]), []).append(r)
    for (A, F, ck, mode, v), rs in sorted(groups.items()):
        meds = [float(r["stats_us"]["median"]) for r in sorted(rs, key=lambda r: r["role_rank"])]
        out.append([f"{A}A{F}F", ck, mode, variant_label(v, backend), ", ".join(f"{m:.1f}" for m in meds),
                    f"{max(meds) - min(meds):.1f}"])
    return out


# ---------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------


def render_plot(doc: dict, path: str) -> str | None:
    """PNG: round-trip median latency vs tokens per variant and mode (hidden 7168 with extras; else the
    first hidden size and payload). Returns ``path``, or None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _cases(doc)
    if not cases:
        return None
    pick = [c for c in cases if c["hidden"] == 7168 and c["extras"]] or [
        c for c in cases if (c["hidden"], c["extras"]) == (cases[0]["hidden"], cases[0]["extras"])]
    c0 = pick[0]
    backend = doc.get("meta", {}).get("backend")
    fig, ax = plt.subplots(figsize=(8, 5))
    for mode, style in (("graph", "-"), ("eager", "--")):
        for v in ("ours_per_tensor", "connector", "reference", "raw", "peer"):
            pts = sorted((c["tokens"], _med(r)) for c in pick if (r := lookup(doc, c["key"], v, mode)))
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=f"{variant_label(v, backend)}, {mode}")
    ax.set(xscale="log", yscale="log", xlabel="tokens per attention rank", ylabel="round trip, µs (median)",
           title=f"{c0['A']}A{c0['F']}F round trip, hidden {c0['hidden']} bf16"
                 + (", logits + ids" if c0["extras"] else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    if backend == "gloo":
        fig.suptitle("CPU run over gloo: a harness check, not the GPU data path (see bench.md)", color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def write_outputs(doc: dict, out: str, plot: bool = True) -> dict[str, str]:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` (``out`` a directory, or a ``.json`` path).

    Returns:
        ``{"json": path, "markdown": path, "plot": path}`` (plot absent when not drawn).
    """
    base = out[:-5] if out.endswith(".json") else os.path.join(out, "bench")
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    paths = {"json": base + ".json", "markdown": base + ".md"}
    with open(paths["json"], "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
        fh.write("\n")
    with open(paths["markdown"], "w") as fh:
        fh.write(render_markdown(doc))
    if plot and doc["records"]:
        p = render_plot(doc, base + ".png")
        if p:
            paths["plot"] = p
    return paths
