"""Benchmark results: the JSON document, the markdown tables, the PNG plot, targets, merge.

JSON document (``schema: "afd-ext-bench/1"``)::

    {"schema", "meta": {...machine, versions, date, commit, layout, settings},
     "records": [{"case", "case_key", "A", "F", "variant", "mode", "direction",
                  "role", "role_rank", "peers", "rows", "bytes_a2f", "bytes_f2a",
                  "stats_us": {"median","p10","p90","mean","min","n"},
                  "gbps"?, "graph_iters"?, ...}],
     "skipped": [{"case_key", "variant", "reason"}], "notes": [...],
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

from afd_ext.bench.plan import Case
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
    "transport_name",
    "variant_label",
    "CPU_RUN_NOTE",
]

SCHEMA = "afd-ext-bench/1"
RECORD_KEYS = ("case", "case_key", "A", "F", "variant", "mode", "direction", "role", "role_rank",
               "bytes_a2f", "bytes_f2a", "stats_us")
STATS_KEYS = ("median", "p10", "p90", "mean", "min", "n")

LABELS = {
    "ours_per_tensor": "ours per-tensor",
    "ours_fp8": "ours FP8 hidden",
    "peer_fp8": "peer FP8 hidden",
    "reference": "reference pattern",
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
    for key, typ in (("meta", dict), ("records", list), ("skipped", list), ("targets", list)):
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
    for d in docs:
        for r in d["records"]:
            recs[_rkey(r)] = r
        for s in d["skipped"]:
            skipped[(s.get("case_key"), s.get("variant"))] = s
        notes += [n for n in d.get("notes", []) if n not in notes]
    meta = dict(docs[-1]["meta"])
    meta["merged_from"] = [d["meta"].get("date") for d in docs]
    # Labels name the transport; a merge of CPU and GPU runs must not call gloo times NCCL.
    meta["backend"] = "+".join(sorted({str(d["meta"].get("backend") or "nccl") for d in docs}))
    out = {"schema": SCHEMA, "meta": meta, "records": list(recs.values()), "skipped": list(skipped.values()),
           "notes": notes, "targets": []}
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
    """The attention-rank record for one measurement."""
    for r in doc["records"]:
        if (r["role"] == "attention" and r["case_key"] == case_key and r["variant"] == variant
                and r["mode"] == mode and r["direction"] == direction and r["role_rank"] == role_rank
                and (A is None or r["A"] == A) and (F is None or r["F"] == F)):
            return r
    return None


def _med(r: dict | None) -> float | None:
    return None if r is None else float(r["stats_us"]["median"])


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

    for mode, small_goal in (("graph", 1.8), ("eager", 2.0)):
        for t in [t for t in toks if t <= 128 or t == 8192]:
            goal = small_goal if t <= 128 else 1.15
            ref = _med(lookup(doc, key(t), "reference", mode, "round_trip", A=1, F=1))
            ours = _med(lookup(doc, key(t), "ours_per_tensor", mode, "round_trip", A=1, F=1))
            ratio = ref / ours if ref and ours else None
            out.append(_target(f"vs reference pattern, {mode}, {t} tokens", ours, f">= {goal}x",
                               None if ratio is None else ratio >= goal,
                               f"reference {ref and round(ref, 2)} µs / ours {ours and round(ours, 2)} µs", ratio))
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


def _table(title: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown section: ``## title``, the table, a blank line."""
    return [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def render_markdown(doc: dict) -> str:
    """Markdown: round-trip tables per (layout, hidden, payload, mode), one-way table, targets."""
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
    lines.append("- times: median µs (p10–p90), per iteration; ratios from medians measured side by side; "
                 f"`vs ref` = reference / ours-default (higher is better), `x raw` = ours-default / raw {tname}.")
    lines.append("")
    variants_present = [v for v in ("ours_per_tensor", "reference", "raw", "peer", "ours_fp8", "peer_fp8")
                        if any(r["variant"] == v for r in doc["records"])]
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
                ours = cells.get("ours_per_tensor")
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
            head = ["tokens", *(variant_label(v, backend) for v in variants_present), "vs ref", "x raw", "GB/s (rt)"]
            fp8 = [r for r in doc["records"] if "hidden_bytes_per_token" in r and r["variant"].endswith("_fp8")
                   and r["case"]["hidden"] == hidden]
            wire = (f" ({2 * hidden:,} B/token; FP8 variants {fp8[0]['hidden_bytes_per_token']:,} B/token)"
                    if fp8 else "")
            lines += _table(f"Round trip, {A}A{F}F, hidden {hidden} bf16{wire}, {payload}, {mode}", head, rows)
    # Fan-in summary (several attention ranks)
    fan = _fan_in_rows(doc, backend)
    if fan:
        lines += _table("Fan-in (several attention ranks per FFN rank)",
                        ["layout", "case", "mode", "variant", "rt median per attention rank (µs)", "spread (µs)"],
                        fan)
    if doc.get("targets"):
        # The targets are for the NCCL data path: a gloo-only run's times cannot meet or miss them.
        gloo_only = "gloo" in str(backend) and "nccl" not in str(backend)
        rows = [[t["target"], _fmt(t["value"], ".2f"), t["goal"], _fmt(t["ratio"], ".2f", "×"),
                 "not applicable on gloo" if gloo_only else {True: "yes", False: "**no**", None: "n/a"}[t["met"]],
                 t["detail"]] for t in doc["targets"]]
        lines += _table("Targets (docs/benchmarks.md, for the NCCL path on GPUs; `ratio` = reference or floor / ours, "
                        "higher is better)", ["target", "measured", "goal", "ratio", "met", "detail"], rows)
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


def _fan_in_rows(doc: dict, backend: str | None = "nccl") -> list[list[str]]:
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in attention_records(doc):
        if r["A"] > 1 and r["direction"] == "round_trip":
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
    """PNG: round-trip median latency vs tokens per variant and mode (hidden 7168, extras, 1A1F; else the
    first group). Returns ``path``, or None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _cases(doc)
    if not cases:
        return None
    pick = [c for c in cases if c["A"] == 1 and c["F"] == 1 and c["hidden"] == 7168 and c["extras"]] or [
        c for c in cases if (c["A"], c["F"], c["hidden"], c["extras"]) == tuple(cases[0][k] for k in
                                                                              ("A", "F", "hidden", "extras"))]
    c0 = pick[0]
    backend = doc.get("meta", {}).get("backend")
    fig, ax = plt.subplots(figsize=(8, 5))
    for mode, style in (("graph", "-"), ("eager", "--")):
        for v in ("ours_per_tensor", "reference", "raw", "peer"):
            pts = [(c["tokens"], lookup(doc, Case(c["hidden"], c["tokens"], c["extras"]).key(), v, mode,
                                        "round_trip", A=c0["A"], F=c0["F"])) for c in pick]
            pts = sorted((t, r["stats_us"]["median"]) for t, r in pts if r)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=f"{variant_label(v, backend)}, {mode}")
    ax.set(xscale="log", yscale="log", xlabel="tokens per attention rank", ylabel="round trip, µs (median)",
           title=f"{c0['A']}A{c0['F']}F round trip, hidden {c0['hidden']} bf16"
                 + (", logits + ids" if c0["extras"] else ""))
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
