"""Benchmark results: the JSON document, the markdown tables, the PNG plot, targets, merge.

JSON document (``schema: "afd-ext-bench/1"``)::

    {"schema", "meta": {...machine, versions, date, commit, layout, settings},
     "records": [{"case", "case_key", "A", "F", "variant", "mode", "direction",
                  "role", "role_rank", "peers", "rows", "bytes_a2f", "bytes_f2a",
                  "stats_us": {"median","p10","p90","mean","min","n"},
                  "one_way_us"?: {...}, "one_way_unmeasured"?: str, "gbps"?, "graph_iters"?, ...}],
     "skipped": [{"case_key", "variant", "reason"}], "notes": [...],
     "control_plane": {"reference": {...µs} | null, "ours": {...µs} | null},
     "targets": [{"target", "value", "goal", "ratio", "met", "detail"}],
     "checks": [...]  (``--check`` runs only)}

Ratios: ``speed-up vs reference = reference median / variant median`` (above
1: faster than the reference pattern); ``x raw = variant median / raw
median`` (how far above the one-message floor).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Sequence

from afd_ext.errors import AFDConfigError

__all__ = [
    "SCHEMA",
    "validate_document",
    "merge_documents",
    "attention_records",
    "lookup",
    "evaluate_targets",
    "render_markdown",
    "render_plot",
    "write_outputs",
    "headline",
    "transport_name",
    "variant_label",
    "CPU_RUN_NOTE",
]

SCHEMA = "afd-ext-bench/1"
RECORD_KEYS = ("case", "case_key", "A", "F", "variant", "mode", "direction", "role", "role_rank",
               "bytes_a2f", "bytes_f2a", "stats_us")
STATS_KEYS = ("median", "p10", "p90", "mean", "min", "n")

LABELS = {
    "ours_default": "ours (default)",
    "ours_per_tensor": "ours per-tensor",
    "reference": "reference pattern",
    "bare": "bare NCCL (ctypes)",
}

#: How labels and notes name the transport a backend times.
TRANSPORTS = {"nccl": "NCCL", "gloo": "gloo"}

#: What a CPU (gloo) run can and cannot show; heads its bench.md (the console output ends with a reminder).
CPU_RUN_NOTE = (
    "**CPU run over gloo: a check of the harness, not a measurement of this package's data path.** "
    "It shows that every variant runs end to end (`--check` verifies their bytes) and what the host-side "
    "Python costs on this machine. It cannot show GPU performance: the path this package is for is its NCCL "
    "ops on CUDA tensors (eager and in CUDA graphs), which a CPU run never touches. Its gloo transport is the "
    "CPU correctness path of CI and tests: it bounds every wait (a waiter thread polled in slices, so a dead "
    "peer becomes an error), work per message that the bare `torch.distributed` calls of the `reference` and "
    "`raw` columns do not do; so `vs ref` here, above or below 1×, says nothing about the NCCL path. GPU "
    "results: `docs/benchmarks.md`."
)


def transport_name(backend: str | None) -> str:
    """``"nccl"`` -> ``"NCCL"``, ``"gloo"`` -> ``"gloo"``; a merge of both (``"gloo+nccl"``) -> ``"gloo + NCCL"``."""
    return " + ".join(TRANSPORTS.get(b, b) for b in str(backend or "nccl").split("+"))


def variant_label(variant: str, backend: str | None = "nccl") -> str:
    """Column and legend name of a variant, naming the transport that was timed (``raw gloo`` on CPU runs)."""
    if variant == "raw":
        return f"raw {transport_name(backend)} (1 msg)"
    return LABELS.get(variant, variant)


# ---------------------------------------------------------------------------
# Validation and merge
# ---------------------------------------------------------------------------


def validate_document(doc: Any) -> None:
    """Check a benchmark JSON document's structure.

    Raises:
        AFDConfigError: naming the first missing or malformed field.
    """
    if not isinstance(doc, dict):
        raise AFDConfigError(f"benchmark document must be a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA:
        raise AFDConfigError(f"benchmark document schema must be {SCHEMA!r}, got {doc.get('schema')!r}")
    for key, typ in (("meta", dict), ("records", list), ("skipped", list), ("control_plane", dict),
                     ("targets", list)):
        if not isinstance(doc.get(key), typ):
            raise AFDConfigError(f"benchmark document field {key!r} must be a {typ.__name__}")
    for i, r in enumerate(doc["records"]):
        for k in RECORD_KEYS:
            if k not in r:
                raise AFDConfigError(f"records[{i}] lacks {k!r}")
        for k in STATS_KEYS:
            v = r["stats_us"].get(k)
            if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
                raise AFDConfigError(f"records[{i}].stats_us.{k} must be a finite number, got {v!r}")
        if r["direction"] not in ("round_trip", "a2f", "f2a", "flag"):
            raise AFDConfigError(f"records[{i}].direction {r['direction']!r} is not round_trip, a2f, f2a or flag")
        if r["mode"] not in ("eager", "graph"):
            raise AFDConfigError(f"records[{i}].mode {r['mode']!r} is not eager or graph")


def _rkey(r: dict) -> tuple:
    return (r["case_key"], r["A"], r["F"], r["variant"], r["mode"], r["direction"], r["role"], r["role_rank"])


def merge_documents(docs: Sequence[dict]) -> dict:
    """Merge several runs into one document (later documents win on identical measurements).

    Raises:
        AFDConfigError: no documents, or one fails :func:`validate_document`.
    """
    if not docs:
        raise AFDConfigError("nothing to merge")
    for i, d in enumerate(docs):
        try:
            validate_document(d)
        except ValueError as e:
            raise AFDConfigError(f"document {i}: {e}") from None
    recs: dict[tuple, dict] = {}
    skipped: dict[tuple, dict] = {}
    notes: list[str] = []
    control: dict[str, Any] = {"reference": None, "ours": None}
    for d in docs:
        for r in d["records"]:
            recs[_rkey(r)] = r
        for s in d["skipped"]:
            skipped[(s.get("case_key"), s.get("variant"))] = s
        notes += [n for n in d.get("notes", []) if n not in notes]
        for k in ("reference", "ours"):
            if d["control_plane"].get(k):
                control[k] = d["control_plane"][k]
    meta = dict(docs[-1]["meta"])
    meta["merged_from"] = [d["meta"].get("date") for d in docs]
    # Labels name the transport; a merge of CPU and GPU runs must not call gloo times NCCL.
    meta["backend"] = "+".join(sorted({str(d["meta"].get("backend") or "nccl") for d in docs}))
    out = {"schema": SCHEMA, "meta": meta, "records": list(recs.values()), "skipped": list(skipped.values()),
           "notes": notes, "control_plane": control, "targets": []}
    out["targets"] = evaluate_targets(out)
    return out


# ---------------------------------------------------------------------------
# Lookups
# ---------------------------------------------------------------------------


def attention_records(doc: dict) -> list[dict]:
    """Records measured on attention ranks (the round trip is seen from there)."""
    return [r for r in doc["records"] if r["role"] == "attention"]


def lookup(doc: dict, case_key: str, variant: str, mode: str, direction: str,
           role_rank: int = 0, A: int | None = None, F: int | None = None) -> dict | None:
    """The attention-rank record for one measurement (``ours_default`` is ``ours_per_tensor``, the one wire format)."""
    if variant == "ours_default":
        variant = "ours_per_tensor"
    for r in doc["records"]:
        if (r["role"] == "attention" and r["case_key"] == case_key and r["variant"] == variant
                and r["mode"] == mode and r["direction"] == direction and r["role_rank"] == role_rank
                and (A is None or r["A"] == A) and (F is None or r["F"] == F)):
            return r
    return None


def _one_way(r: dict | None) -> dict | None:
    """A record's one-way statistics, or None where they could not be measured (none, or p10 not positive)."""
    ow = (r or {}).get("one_way_us")
    return ow if ow and float(ow["p10"]) > 0 else None


def _med(r: dict | None, one_way: bool = False) -> float | None:
    if r is None:
        return None
    if one_way:
        ow = _one_way(r)
        return None if ow is None else float(ow["median"])
    return float(r["stats_us"]["median"])


def _cases(doc: dict) -> list[dict]:
    seen: dict[str, dict] = {}
    for r in doc["records"]:
        seen.setdefault(r["case_key"], dict(r["case"], A=r["A"], F=r["F"]))
    return sorted(seen.values(), key=lambda c: (c["A"], c["F"], c["hidden"], not c["extras"], c["tokens"]))


# ---------------------------------------------------------------------------
# Targets (docs/benchmarks.md, "Targets")
# ---------------------------------------------------------------------------


def _target(name: str, value: float | None, goal: str, ok: bool | None, detail: str,
            ratio: float | None = None) -> dict:
    return {"target": name, "value": value, "goal": goal, "ratio": ratio, "met": ok, "detail": detail}


def evaluate_targets(doc: dict) -> list[dict]:
    """Measured value, goal and verdict for every NCCL-path target (``docs/benchmarks.md``) the data covers.

    Uses 1A1F, hidden 7168, router logits + token ids, attention rank 0.
    ``met`` is None when the data for a target is missing.
    """
    out: list[dict] = []
    one_a_one_f = [c for c in _cases(doc) if c["A"] == 1 and c["F"] == 1 and c["hidden"] == 7168 and c["extras"]]
    toks = sorted(c["tokens"] for c in one_a_one_f)

    def key(t: int) -> str:
        return f"h7168-t{t}-extras"

    for mode, goal in (("graph", 1.8), ("eager", 2.0)):
        for t in [t for t in toks if t <= 128]:
            ref = _med(lookup(doc, key(t), "reference", mode, "round_trip", A=1, F=1))
            ours = _med(lookup(doc, key(t), "ours_default", mode, "round_trip", A=1, F=1))
            ratio = ref / ours if ref and ours else None
            out.append(_target(f"vs reference pattern, {mode}, {t} tokens", ours, f">= {goal}x",
                               None if ratio is None else ratio >= goal,
                               f"reference {ref and round(ref, 2)} µs / ours {ours and round(ours, 2)} µs", ratio))
    for mode in ("graph", "eager"):
        if 8192 in toks:
            ref = _med(lookup(doc, key(8192), "reference", mode, "round_trip", A=1, F=1))
            ours = _med(lookup(doc, key(8192), "ours_default", mode, "round_trip", A=1, F=1))
            ratio = ref / ours if ref and ours else None
            out.append(_target(f"vs reference pattern, {mode}, 8192 tokens", ours, ">= 1.15x",
                               None if ratio is None else ratio >= 1.15,
                               f"reference {ref and round(ref, 2)} µs / ours {ours and round(ours, 2)} µs", ratio))
    for mode in ("graph", "eager"):
        for t in toks:
            ours = _med(lookup(doc, key(t), "ours_per_tensor", mode, "round_trip", A=1, F=1))
            bare = _med(lookup(doc, key(t), "bare", mode, "round_trip", A=1, F=1))
            if ours is None or bare is None:
                continue
            over = ours - bare
            if t < 128:
                ok, goal = over <= 1.0, "<= 1 µs"
            else:
                ok, goal = over <= 0.02 * bare, "<= 2 %"
            out.append(_target(f"overhead over bare NCCL, {mode}, {t} tokens", over, goal, ok,
                               f"ours per-tensor {ours:.2f} µs - bare {bare:.2f} µs ({100 * over / bare:+.1f} %)"))
    if 8192 in toks:
        for d in ("a2f", "f2a"):
            r = lookup(doc, key(8192), "ours_default", "graph", d, A=1, F=1) or \
                lookup(doc, key(8192), "ours_default", "eager", d, A=1, F=1)
            g = r.get("gbps") if r else None
            raw = lookup(doc, key(8192), "raw", r["mode"] if r else "graph", d, A=1, F=1)
            rg = raw.get("gbps") if raw else None
            out.append(_target(f"one-way bandwidth {d}, 8192 tokens ({r['mode'] if r else '-'})", g, ">= 335 GB/s",
                               None if g is None else g >= 335.0,
                               f"raw NCCL floor {rg:.1f} GB/s" if rg else "", None))
    cp = doc.get("control_plane", {})
    ours_cp = (cp.get("ours") or {}).get("median")
    ref_cp = (cp.get("reference") or {}).get("median")
    out.append(_target("control plane per step (median)", ours_cp, "<= 10 µs",
                       None if ours_cp is None else ours_cp <= 10.0,
                       f"reference pattern {ref_cp:.1f} µs" if ref_cp else "reference pattern not measured",
                       (ref_cp / ours_cp) if ref_cp and ours_cp else None))
    return out


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------


def _fmt_us(r: dict | None, one_way: bool = False) -> str:
    if r is None:
        return "–"
    s = _one_way(r) if one_way else r["stats_us"]
    if s is None:
        return "not measurable"
    return f"{s['median']:.1f} ({s['p10']:.1f}–{s['p90']:.1f})"


def _fmt(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if v is None else f"{v:{spec}}{suffix}"


def render_markdown(doc: dict) -> str:
    """Markdown: round-trip tables per (layout, hidden, payload, mode), one-way table, control plane, targets."""
    meta = doc.get("meta", {})
    backend = meta.get("backend")
    tname = transport_name(backend)
    lines = ["# afd-ext bench results", ""]
    if "gloo" in str(backend):
        lines += [CPU_RUN_NOTE, ""]
    lines.append(f"- date: {meta.get('date', '?')}, commit: {meta.get('commit', '?')}")
    lines.append(f"- machine: {meta.get('devices', '?')}; layout: {meta.get('layout', {}).get('description', '?')}")
    timed = {"nccl": "this package's NCCL ops on CUDA tensors",
             "gloo": "torch.distributed's gloo backend (TCP) on CPU tensors"}.get(str(backend), "merged runs")
    lines.append(f"- transport timed: {tname}, {timed}; torch {meta.get('torch', '?')}"
                 + (f", NCCL runtime {meta.get('nccl_runtime', '?')}" if "nccl" in str(backend or "nccl") else ""))
    if meta.get("shared_gpu"):
        lines.append("- **WARNING: processes share a GPU; the driver time-slices them, so these times are "
                     "not meaningful (correctness only).**")
    fails = doc.get("failures") or meta.get("failures") or []
    if fails or meta.get("complete") is False:
        lines.append(f"- **INCOMPLETE: {len(fails)} failure(s) in {meta.get('attempts', '?')} attempt(s); the tables "
                     "hold only what finished:**")
        for f in fails:
            lines.append(f"  - attempt {f.get('attempt', '?')}: {f.get('message', '?')}")
    lines.append("- times: median µs (p10–p90), per iteration; ratios from medians measured side by side; "
                 f"`vs ref` = reference / ours-default (higher is better), `x raw` = ours-default / raw {tname}.")
    lines.append("")
    variants_present = []
    for v in ("ours_per_tensor", "reference", "raw", "bare"):
        if any(r["variant"] == v for r in doc["records"]):
            variants_present.append(v)
    cases = _cases(doc)
    groups: dict[tuple, list[dict]] = {}
    for c in cases:
        groups.setdefault((c["A"], c["F"], c["hidden"], c["extras"]), []).append(c)
    for (A, F, hidden, extras), cs in groups.items():
        for mode in ("graph", "eager"):
            rows = []
            for c in cs:
                ck = f"h{c['hidden']}-t{c['tokens']}-{'extras' if c['extras'] else 'hidden'}"
                cells = {v: lookup(doc, ck, v, mode, "round_trip", A=A, F=F) for v in variants_present}
                if not any(cells.values()):
                    continue
                ours = lookup(doc, ck, "ours_default", mode, "round_trip", A=A, F=F)
                ref, raw = cells.get("reference"), cells.get("raw")
                vs_ref = _med(ref) / _med(ours) if ref and ours else None
                x_raw = _med(ours) / _med(raw) if raw and ours else None
                gbps = ours.get("gbps") if ours else None
                row = [str(c["tokens"])] + [_fmt_us(cells[v]) for v in variants_present]
                row += [_fmt(vs_ref, ".2f", "×"), _fmt(x_raw, ".2f", "×"), _fmt(gbps, ".1f")]
                rows.append(row)
            if not rows:
                continue
            width = cs[0].get("logits_width", 256)
            payload = f"hidden + fp32 logits [n, {width}] + int32 ids" if extras else "hidden only"
            lines.append(f"## Round trip, {A}A{F}F, hidden {hidden} bf16, {payload}, {mode}")
            lines.append("")
            head = (["tokens"] + [variant_label(v, backend) for v in variants_present]
                    + ["vs ref", "x raw", "GB/s (rt)"])
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "|".join(["---"] * len(head)) + "|")
            lines += ["| " + " | ".join(r) + " |" for r in rows]
            lines.append("")
    # One-way
    ow_rows = []
    for c in cases:
        ck = f"h{c['hidden']}-t{c['tokens']}-{'extras' if c['extras'] else 'hidden'}"
        for mode in ("graph", "eager"):
            for v in ["ours_default", "reference", "raw"]:
                a = lookup(doc, ck, v, mode, "a2f", A=c["A"], F=c["F"])
                f = lookup(doc, ck, v, mode, "f2a", A=c["A"], F=c["F"])
                if a is None and f is None:
                    continue
                ow_rows.append([f"{c['A']}A{c['F']}F", ck, mode, variant_label(v, backend), _fmt_us(a, True),
                                _fmt(a.get("gbps") if _one_way(a) else None, ".1f"), _fmt_us(f, True),
                                _fmt(f.get("gbps") if _one_way(f) else None, ".1f")])
    if ow_rows:
        lines.append("## One way (ping-pong with a 16-byte flag back, minus half the flag ping-pong)")
        lines.append("")
        if any("not measurable" in cell for r in ow_rows for cell in r):
            lines += ["`not measurable`: the ping-pong's p10 was not above half the flag ping-pong's median (its "
                      "noise exceeds this direction's time), so no one-way figure can be derived.", ""]
        head = ["layout", "case", "mode", "variant", "a2f µs", "a2f GB/s", "f2a µs", "f2a GB/s"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---"] * len(head)) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in ow_rows]
        lines.append("")
    # Fan-in summary (several attention ranks)
    fan = _fan_in_rows(doc, backend)
    if fan:
        lines.append("## Fan-in (several attention ranks per FFN rank)")
        lines.append("")
        head = ["layout", "case", "mode", "variant", "rt median per attention rank (µs)", "spread (µs)",
                "FFN ingress GB/s"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---"] * len(head)) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in fan]
        lines.append("")
    cp = doc.get("control_plane", {})
    if cp.get("reference") or cp.get("ours"):
        lines.append("## Control plane per step (attention call start -> FFN receive returns)")
        lines.append("")
        lines.append("| pattern | median µs | p90 µs | n |")
        lines.append("|---|---|---|---|")
        for k, label in (("ours", "this package (host channel, no device sync)"),
                         ("reference", "reference (2 NCCL messages + .item())")):
            s = cp.get(k) or {}
            if "error" in s:
                lines.append(f"| {label} | error: {s['error']} | | |")
            elif s:
                lines.append(f"| {label} | {_fmt(s.get('median'), '.1f')} | {_fmt(s.get('p90'), '.1f')} | "
                             f"{s.get('n', '–')} |")
        lines.append("")
    head = headline(doc)
    if head:
        lines.append(f"## Headline: ours (default) vs the reference pattern and raw {tname}, 1A1F, hidden 7168, "
                     "logits + ids, round trip")
        lines.append("")
        lines.append("| tokens | graph µs | graph vs ref | graph x raw | eager µs | eager vs ref | eager x raw |")
        lines.append("|---|---|---|---|---|---|---|")
        for h in head:
            lines.append(f"| {h['tokens']} | {_fmt(h['graph_us'], '.1f')} | {_fmt(h['graph_vs_ref'], '.2f', '×')} | "
                         f"{_fmt(h['graph_x_raw'], '.2f', '×')} | {_fmt(h['eager_us'], '.1f')} | "
                         f"{_fmt(h['eager_vs_ref'], '.2f', '×')} | {_fmt(h['eager_x_raw'], '.2f', '×')} |")
        lines.append("")
    if doc.get("targets"):
        lines.append("## Targets (docs/benchmarks.md, for the NCCL path on GPUs; `ratio` = reference or floor / ours, "
                     "higher is better)")
        lines.append("")
        lines.append("| target | measured | goal | ratio | met | detail |")
        lines.append("|---|---|---|---|---|---|")
        # The targets are for the NCCL data path: a gloo-only run's times cannot meet or miss them.
        gloo_only = "gloo" in str(backend) and "nccl" not in str(backend)
        for t in doc["targets"]:
            met = "not applicable on gloo" if gloo_only else {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
            lines.append(f"| {t['target']} | {_fmt(t['value'], '.2f')} | {t['goal']} | "
                         f"{_fmt(t['ratio'], '.2f', '×')} | {met} | {t['detail']} |")
        lines.append("")
    if doc.get("skipped"):
        reasons: dict[tuple[str, str], int] = {}
        for s in doc["skipped"]:
            reasons[(s["variant"], s["reason"])] = reasons.get((s["variant"], s["reason"]), 0) + 1
        lines.append("## Skipped")
        lines.append("")
        for (v, why), n in sorted(reasons.items()):
            lines.append(f"- {v} ({n} cases): {why}")
        lines.append("")
    for n in doc.get("notes", []):
        lines.append(f"- note: {n}")
    return "\n".join(lines).rstrip() + "\n"


def headline(doc: dict, tokens: Sequence[int] = (1, 128, 8192)) -> list[dict]:
    """Ours-default vs reference and raw at the headline sizes (1A1F, hidden 7168, extras, round trip)."""
    out = []
    for t in tokens:
        ck = f"h7168-t{t}-extras"
        row: dict[str, Any] = {"tokens": t}
        any_data = False
        for mode in ("graph", "eager"):
            ours = _med(lookup(doc, ck, "ours_default", mode, "round_trip", A=1, F=1))
            ref = _med(lookup(doc, ck, "reference", mode, "round_trip", A=1, F=1))
            raw = _med(lookup(doc, ck, "raw", mode, "round_trip", A=1, F=1))
            row[f"{mode}_us"] = ours
            row[f"{mode}_vs_ref"] = ref / ours if ref and ours else None
            row[f"{mode}_x_raw"] = ours / raw if raw and ours else None
            any_data = any_data or ours is not None
        if any_data:
            out.append(row)
    return out


def _fan_in_rows(doc: dict, backend: str | None = "nccl") -> list[list[str]]:
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in attention_records(doc):
        if r["A"] > 1 and r["direction"] in ("round_trip", "a2f"):
            groups.setdefault((r["A"], r["F"], r["case_key"], r["mode"], r["variant"], r["direction"]), []).append(r)
    for (A, F, ck, mode, v, d), rs in sorted(groups.items()):
        if d != "round_trip":
            continue
        meds = [float(r["stats_us"]["median"]) for r in sorted(rs, key=lambda r: r["role_rank"])]
        a2f = groups.get((A, F, ck, mode, v, "a2f"), [])
        ingress = None
        if a2f:
            worst = max((_med(r, one_way=True) or 0.0 for r in a2f), default=0.0)
            per_ffn = sum(r["bytes_a2f"] for r in a2f) / F
            ingress = per_ffn / (worst * 1e3) if worst > 0 else None
        out.append([f"{A}A{F}F", ck, mode, variant_label(v, backend), ", ".join(f"{m:.1f}" for m in meds),
                    f"{max(meds) - min(meds):.1f}", _fmt(ingress, ".1f")])
    return out


# ---------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------


def render_plot(doc: dict, path: str) -> str | None:
    """PNG: round-trip latency and one-way bandwidth vs tokens (hidden 7168, extras, 1A1F; else the first group).

    Returns:
        ``path``, or None when there is nothing to plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _cases(doc)
    if not cases:
        return None
    pick = [c for c in cases if c["A"] == 1 and c["F"] == 1 and c["hidden"] == 7168 and c["extras"]]
    if not pick:
        c0 = cases[0]
        pick = [c for c in cases if (c["A"], c["F"], c["hidden"], c["extras"]) == (c0["A"], c0["F"], c0["hidden"],
                                                                                    c0["extras"])]
    A, F, hidden, extras = pick[0]["A"], pick[0]["F"], pick[0]["hidden"], pick[0]["extras"]
    toks = sorted(c["tokens"] for c in pick)

    def ck(t: int) -> str:
        return f"h{hidden}-t{t}-{'extras' if extras else 'hidden'}"

    backend = doc.get("meta", {}).get("backend")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    variants = ["ours_default", "reference", "raw", "bare"]
    colors = dict(zip(variants, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    for mode, style in (("graph", "-"), ("eager", "--")):
        for v in variants:
            xs, ys, lo, hi = [], [], [], []
            for t in toks:
                r = lookup(doc, ck(t), v, mode, "round_trip", A=A, F=F)
                if r:
                    xs.append(t)
                    ys.append(r["stats_us"]["median"])
                    lo.append(r["stats_us"]["p10"])
                    hi.append(r["stats_us"]["p90"])
            if xs:
                ax1.plot(xs, ys, style, marker="o", ms=3, color=colors[v],
                         label=f"{variant_label(v, backend)}, {mode}")
                ax1.fill_between(xs, lo, hi, color=colors[v], alpha=0.12)
            xs, ys = [], []
            for t in toks:
                r = lookup(doc, ck(t), v, mode, "a2f", A=A, F=F)
                if r and r.get("gbps"):
                    xs.append(t)
                    ys.append(r["gbps"])
            if xs:
                ax2.plot(xs, ys, style, marker="o", ms=3, color=colors[v], label=f"{variant_label(v, backend)}, {mode}")
    payload = "hidden+logits+ids" if extras else "hidden"
    ax1.set(xscale="log", yscale="log", xlabel="tokens per attention rank", ylabel="round trip, µs (median, p10–p90)",
            title=f"{A}A{F}F round trip, hidden {hidden} bf16, {payload}")
    ax2.set(xscale="log", xlabel="tokens per attention rank", ylabel="one-way attention→FFN, GB/s",
            title="one-way bandwidth (attention → FFN)")
    if "gloo" not in str(backend):
        ax2.axhline(335, color="gray", lw=0.8, ls=":")  # the NCCL-path bandwidth target
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if doc.get("meta", {}).get("shared_gpu"):
        fig.suptitle("WARNING: processes share a GPU (times not meaningful)", color="red")
    elif "gloo" in str(backend):
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
    if out.endswith(".json"):
        base = out[:-5]
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    else:
        os.makedirs(out, exist_ok=True)
        base = os.path.join(out, "bench")
    paths = {"json": base + ".json", "markdown": base + ".md"}
    with open(paths["json"], "w") as fh:
        json.dump(doc, fh, indent=1, default=_json_default)
        fh.write("\n")
    with open(paths["markdown"], "w") as fh:
        fh.write(render_markdown(doc))
    if plot and doc["records"]:
        p = render_plot(doc, base + ".png")
        if p:
            paths["plot"] = p
    return paths


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def load_documents(paths: Iterable[str]) -> list[dict]:
    """Read benchmark JSON files.

    Raises:
        AFDConfigError: a file is not a valid benchmark document (names the file).
    """
    docs = []
    for p in paths:
        with open(p) as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError as e:
                raise AFDConfigError(f"{p}: not JSON: {e}") from None
        try:
            validate_document(d)
        except ValueError as e:
            raise AFDConfigError(f"{p}: {e}") from None
        docs.append(d)
    return docs
