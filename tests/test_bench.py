"""afd-ext bench: timing statistics, layout, report logic, and the gloo smoke runs.

CPU tier: the harness end to end over gloo (2 processes, tiny sizes) must
emit a valid JSON document, the bit-exact self-check must pass and must fail
when one side corrupts the data. GPU tier (``-m gpu``): the same
self-check over NCCL (on one GPU its processes share it, NCCL over sockets) and
a quick timed sweep (needs 2 distinct GPUs).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from afd_ext.tools.bench import main
from afd_ext.tools.bench import report
from afd_ext.tools.bench.plan import Case, Reps, RunConfig, make_layout
from afd_ext.tools.bench.timing import summarize, time_eager
from afd_ext.tools.bench.variants import pattern_bytes, rows_bytes
from afd_ext.errors import AFDConfigError
from afd_ext.tools.testing import find_free_port, run_workers


def _validate(doc):
    """The JSON document's structure (``afd_ext/tools/bench/report.py``'s schema; docs/benchmarks.md relies on it)."""
    assert isinstance(doc, dict) and doc["schema"] == report.SCHEMA
    for key, typ in (("meta", dict), ("records", list), ("skipped", list), ("targets", list)):
        assert isinstance(doc.get(key), typ), key
    for r in doc["records"]:
        for k in ("case", "case_key", "A", "F", "variant", "mode", "direction", "role", "role_rank",
                  "bytes_a2f", "bytes_f2a", "stats_us"):
            assert k in r, k
        for k in ("median", "p10", "p90", "mean", "min", "n"):
            v = r["stats_us"][k]
            assert isinstance(v, (int, float)) and np.isfinite(v), (k, v)
        assert r["direction"] == "round_trip" and r["mode"] in ("eager", "graph"), r

# ---------------------------------------------------------------------------
# Statistics and timing
# ---------------------------------------------------------------------------


def test_summarize_values():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.min, s.n) == (3.0, 1.0, 5)
    assert s.mean == pytest.approx(3.0)
    assert s.p10 == pytest.approx(1.4) and s.p90 == pytest.approx(4.6)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_summarize_rejects_bad_samples(bad):
    with pytest.raises(AFDConfigError):
        summarize(bad)


def test_time_eager_host_counts_iterations():
    calls = []
    samples = time_eager(lambda: calls.append(1), iters=7, warmup=2, cuda=False)
    assert len(calls) == 9 and len(samples) == 7 and all(s >= 0 for s in samples)
    with pytest.raises(AFDConfigError):
        time_eager(lambda: None, iters=0, warmup=0, cuda=False)


def test_reps_policy_is_bounded_and_monotonic():
    r = Reps(target_s=0.05, min_iters=20, max_iters=400, rounds=2, graph_iters=10)
    small, mid, big = r.iters(1000, True), r.iters(200_000_000, True), r.iters(2_000_000_000, True)
    assert small == 400 and 20 < mid < 400 and big == 20
    assert r.per_round(1000, True) == 200
    assert r.graph_k(1000) == 10 and r.graph_k(200_000_000) == 2
    assert r.graph_replays_per_round(200_000_000) >= 3


# ---------------------------------------------------------------------------
# Plan and layout
# ---------------------------------------------------------------------------


def test_case_bytes():
    c = Case(7168, 128, True)
    assert c.a2f_row_bytes() == 7168 * 2 + 256 * 4 + 4
    assert c.f2a_bytes() == 128 * 7168 * 2
    assert Case(7168, 1, False).a2f_bytes() == 14336
    with pytest.raises(AFDConfigError, match="tokens"):
        Case(7168, 0, True)


def test_layout_one_gpu_per_process(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    lay = make_layout(1, 1, 2)
    # AFD world order: FFN first. Attention on GPU 0, FFN on GPU 1.
    assert lay.gpus == ("1", "0") and not lay.shared
    assert lay.env() == [{"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "0"}]


def test_layout_detects_sharing(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    lay = make_layout(2, 1, 2)
    assert lay.shared and lay.gpus == ("5", "4", "4")  # FFN alone on the last GPU
    assert "shared" in lay.describe()
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        make_layout(2, 2, 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert not make_layout(2, 2, 4).shared
    assert make_layout(1, 1, 2, gpu_map=(0, 0)).shared
    with pytest.raises(ValueError, match="gpu-map"):
        make_layout(1, 1, 2, gpu_map=(0, 2))


def test_one_gpu_layout_shares_gpu0_with_a_hostid_per_process(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("AFD_TEST_SHARE_GPU", raising=False)
    lay = make_layout(2, 1, 1)
    assert lay.shared and lay.gpus == ("0", "0", "0")
    env = lay.env()
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["0", "0", "0"]
    assert len({e["NCCL_HOSTID"] for e in env}) == 3  # NCCL accepts ranks on one GPU only as different hosts
    assert "NCCL over sockets" in lay.describe()
    assert not make_layout(2, 1, 2).nccl_hostids  # every edge crosses GPUs: NVLink, no host ids


def test_timing_refused_on_one_gpu_but_check_is_not(monkeypatch, tmp_path, capsys):
    import afd_ext.tools.bench as bench

    monkeypatch.setattr(bench, "_gpu_count", lambda: 1)
    assert main(["--out", str(tmp_path / "x")]) == 2
    assert "NCCL over sockets" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    cfg = bench._config(bench.build_parser().parse_args(["--check"]))
    assert cfg.check and cfg.layout.shared and cfg.layout.nccl_hostids


def test_timing_refused_when_gpus_shared(monkeypatch, tmp_path, capsys):
    import afd_ext.tools.bench as bench

    monkeypatch.setattr(bench, "_gpu_count", lambda: 2)
    rc = main(["--attention-ranks", "2", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "share a GPU" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_bad_variant_name_is_usage_error(tmp_path, capsys):
    assert main(["--backend", "gloo", "--variants", "ours,nope", "--out", str(tmp_path)]) == 2
    assert "--variants" in capsys.readouterr().err


@pytest.mark.parametrize("argv, what", [
    (["--backend", "gloo", "--modes", "graph"], "graph mode needs CUDA"),  # was: an eager sweep, silently
    (["--backend", "gloo", "--modes", "eager,graph"], "graph mode needs CUDA"),  # the default's spelling
    (["--control-only", "--control-gaps", "0"], "--control-gaps"),  # was: ZeroDivisionError after start-up
    (["--control-only", "--control-gaps", "1,-5"], "--control-gaps"),
    (["--backend", "gloo", "--control-gaps", "2"], "applies to --control-only only"),  # was: ignored
])
def test_bad_mode_or_gap_is_usage_error_before_anything_runs(argv, what, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    assert what in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("option", ["--time-per-point", "--timeout", "--case-timeout"])
def test_a_time_that_is_not_positive_is_a_usage_error(option, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--backend", "gloo", option, "-1", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "must be > 0 seconds" in capsys.readouterr().err


@pytest.mark.parametrize("control", [False, True])
def test_an_out_path_that_cannot_be_written_is_refused_before_anything_runs(control, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    argv = ["--control-only"] if control else ["--backend", "gloo"]
    assert main([*argv, "--out", str(tmp_path / "file" / "out")]) == 2  # was: a traceback after the whole run
    assert "cannot write to" in capsys.readouterr().err


def test_gpu_map_takes_gpu_zero():
    from afd_ext.tools.bench.plan import parse_int_list

    assert parse_int_list("0,0,1", "--gpu-map", least=0) == (0, 0, 1)  # the help's own example (was refused)
    with pytest.raises(AFDConfigError, match="--gpu-map: expected integers >= 0"):
        parse_int_list("0,-1", "--gpu-map", least=0)
    with pytest.raises(AFDConfigError, match="--tokens: expected positive integers"):
        parse_int_list("0,8", "--tokens")


# ---------------------------------------------------------------------------
# Check patterns
# ---------------------------------------------------------------------------


def test_pattern_is_deterministic_and_salted():
    a = pattern_bytes(5, 33, seed=7, salt=1, device=torch.device("cpu"))
    assert a.dtype == torch.uint8 and tuple(a.shape) == (5, 33)
    assert torch.equal(a, pattern_bytes(5, 33, seed=7, salt=1, device=torch.device("cpu")))
    assert not torch.equal(a, pattern_bytes(5, 33, seed=7, salt=2, device=torch.device("cpu")))
    assert not torch.equal(a, pattern_bytes(5, 33, seed=8, salt=1, device=torch.device("cpu")))
    # every byte value shows up in a large pattern (not stuck bits)
    assert pattern_bytes(64, 64, 1, 0, torch.device("cpu")).unique().numel() == 256


def test_rows_bytes_views():
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert tuple(rows_bytes(t).shape) == (3, 8)
    ids = torch.zeros(3, dtype=torch.int32)
    assert tuple(rows_bytes(ids).shape) == (3, 4)
    rows_bytes(ids)[1].fill_(1)
    assert ids.tolist() == [0, 0x01010101, 0]


# ---------------------------------------------------------------------------
# Report logic on a synthetic document
# ---------------------------------------------------------------------------


def _rec(tokens, variant, mode, direction, median, extras=True, **kw):
    c = Case(7168, tokens, extras)
    r = {"case": dataclasses.asdict(c), "case_key": c.key(), "A": 1, "F": 1, "variant": variant, "mode": mode,
         "direction": direction, "role": "attention", "role_rank": 0, "peers": [0], "rows": tokens,
         "bytes_a2f": c.a2f_bytes(), "bytes_f2a": c.f2a_bytes(),
         "stats_us": {"median": median, "p10": median * 0.9, "p90": median * 1.1, "mean": median,
                      "min": median * 0.8, "n": 10}}
    r.update(kw)
    return r


def _synthetic_doc():
    recs = []
    for t, ref_g, ours_g, ref_e, ours_e in ((1, 50.0, 20.0, 150.0, 50.0), (128, 72.0, 45.0, 160.0, 70.0),
                                            (8192, 840.0, 703.0, 800.0, 760.0)):
        recs += [_rec(t, "reference", "graph", "round_trip", ref_g), _rec(t, "ours_per_tensor", "graph", "round_trip", ours_g),
                 _rec(t, "reference", "eager", "round_trip", ref_e), _rec(t, "ours_per_tensor", "eager", "round_trip", ours_e),
                 _rec(t, "raw", "graph", "round_trip", ours_g * 0.9)]
    return {"schema": report.SCHEMA, "meta": {"date": "d"}, "records": recs, "skipped": [], "notes": [],
            "targets": []}


def _target(targets, name):
    (t,) = [t for t in targets if t["target"] == name]
    return t


def test_targets_from_synthetic_results():
    doc = _synthetic_doc()
    _validate(doc)
    ts = report.evaluate_targets(doc)
    t = _target(ts, "vs reference pattern, graph, 1 tokens")
    assert t["ratio"] == pytest.approx(2.5) and t["met"] is True
    t = _target(ts, "vs reference pattern, graph, 128 tokens")
    assert t["ratio"] == pytest.approx(72 / 45) and t["met"] is False
    t = _target(ts, "vs reference pattern, eager, 1 tokens")
    assert t["ratio"] == pytest.approx(3.0) and t["met"] is True
    t = _target(ts, "vs reference pattern, graph, 8192 tokens")
    assert t["ratio"] == pytest.approx(840 / 703) and t["met"] is True


def test_markdown_and_plot(tmp_path):
    doc = _synthetic_doc()
    doc["targets"] = report.evaluate_targets(doc)
    md = report.render_markdown(doc)
    assert "## Round trip, 1A1F, hidden 7168 bf16, hidden + fp32 logits" in md
    assert "2.50×" in md  # graph, 1 token: 50 / 20
    assert "## Targets (docs/benchmarks.md" in md
    # No backend recorded: a GPU document; the raw column names the transport that was timed.
    assert "raw NCCL (1 msg)" in md and "transport timed: NCCL" in md and report.CPU_RUN_NOTE not in md
    assert "1.11×" in md  # graph, 1 token: x raw = 20 / 18
    paths = report.write_outputs(doc, str(tmp_path / "o"))
    assert os.path.getsize(paths["plot"]) > 1000
    with open(paths["plot"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# The gloo path end to end (2 processes)
# ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_quick_gloo_emits_valid_json(tmp_path, capfd):
    out = tmp_path / "quick"
    rc = main(["--quick", "--backend", "gloo", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capfd.readouterr()
    # No per-step worker lines: the bar is the progress display.
    assert "[bench +" not in printed.out + printed.err and "[bench parent]" not in printed.out
    doc = json.loads((out / "bench.json").read_text())
    _validate(doc)
    md = (out / "bench.md").read_text()
    assert md.startswith("# afd-ext bench results")
    # The timed transport is named, and the CPU run says what it can and cannot show.
    assert "raw gloo (1 msg)" in md and "NCCL (1 msg)" not in md
    assert report.CPU_RUN_NOTE in md and "transport timed: gloo" in md
    assert "logits [n, 16]" in md and "[n, 256]" not in md
    assert "they say nothing about the NCCL path" in printed.out
    assert (out / "bench.png").exists()
    assert doc["meta"]["backend"] == "gloo" and doc["meta"]["shared_gpu"] is False
    recs = report.attention_records(doc)
    case_keys = {r["case_key"] for r in recs}
    assert case_keys == {"h64-t1-extras", "h64-t5-extras", "h64-t1-hidden", "h64-t5-hidden"}
    for ck in case_keys:
        for v in ("ours_per_tensor", "connector", "reference", "raw"):
            r = report.lookup(doc, ck, v, "eager")
            assert r is not None, (ck, v)
            s = r["stats_us"]
            assert 0 < s["min"] <= s["p10"] <= s["median"] <= s["p90"] and s["n"] >= 4
            assert r["gbps"] > 0
    # peer and connector_peer are NCCL-only and reported as skipped
    assert {s["variant"] for s in doc["skipped"]} >= {"peer", "connector_peer"}
    assert "control_plane" not in doc and "Control plane" not in md  # its table: afd-ext bench --control-only
    ffn = [r for r in doc["records"] if r["role"] == "ffn"]
    assert ffn, "the FFN rank's own loop times are recorded too"


@pytest.mark.timeout(240)
def test_connector_variant_times_the_four_data_calls_beside_the_ops(tmp_path):
    out = tmp_path / "conn"
    rc = main(["--backend", "gloo", "--variants", "ours_per_tensor,connector,raw", "--hidden", "64", "--tokens", "1,128",
               "--extras", "on", "--rounds", "2", "--time-per-point", "0.01", "--no-progress", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "bench.json").read_text())
    _validate(doc)
    assert doc["meta"]["reps"]["rounds"] == 2
    calls = [c for cs in report.DATA_CALLS.values() for c in cs]
    assert calls == ["send_attn_output", "recv_ffn_output", "recv_attn_output", "send_ffn_output"]
    for t in (1, 128):
        for role, mine in report.DATA_CALLS.items():
            for v in ("connector", "ours_per_tensor"):  # the connector's calls and the transport calls they make
                r = report.lookup(doc, f"h64-t{t}-extras", v, "eager", role)
                assert set(r["calls_us"]) == set(mine), (t, role, v)
                for s in r["calls_us"].values():
                    assert 0 < s["min"] <= s["median"] and s["n"] >= 4
        assert "calls_us" not in report.lookup(doc, f"h64-t{t}-extras", "raw", "eager")
    over = doc["connector_overhead"]
    assert [(o["tokens"], o["call"]) for o in over] == [(t, c) for t in (1, 128) for c in (*calls, "round trip")]
    for o in over:
        assert (o["variant"], o["op_variant"]) == ("connector", "ours_per_tensor") and o["op_us"] > 0
        assert o["overhead_us"] == pytest.approx(o["us"] - o["op_us"]) and o["ratio"] == pytest.approx(o["us"] / o["op_us"])
    md = (out / "bench.md").read_text()
    assert "## Connector overhead per data call (eager, host µs per call" in md and "| connector |" in md
    assert "| h64-t128-extras | connector vs ours per-tensor | recv_attn_output |" in md


def _check_cfg(port: int, A: int = 1, F: int = 1, cases=None) -> RunConfig:
    return RunConfig(backend="gloo", layout=make_layout(A, F, 0), cases=cases or [Case(40, 3, True, logits_width=8)],
                     variants=("ours_per_tensor", "connector", "reference", "raw"),
                     modes=("eager",), reps=Reps(),
                     master_port=port, check=True, progress=False)


def _corrupting_worker(rank, nprocs, cfg, corrupt):
    import afd_ext.tools.bench.variants as v
    from afd_ext.tools.bench.runner import bench_worker

    if corrupt == "reply" and rank == 0:  # the FFN rank replies with the wrong transform
        v.XOR_BYTE = 0x33
    if corrupt == "payload" and rank == 1:  # the attention rank sends other bytes than the FFN expects
        orig = v.pattern_bytes
        v.pattern_bytes = lambda rows, cols, seed, salt, device: orig(rows, cols, seed + 1, salt, device)
    return bench_worker(rank, nprocs, cfg)


def _checks(results):
    return [c for r in results for c in r["checks"]]


@pytest.mark.timeout(180)
def test_check_passes_and_detects_corruption():
    ok = run_workers(_corrupting_worker, 2, (_check_cfg(find_free_port()), None), timeout_s=120)
    cs = _checks(ok)
    assert cs and all(c["ok"] for c in cs), [c for c in cs if not c["ok"]]
    every = {"ours_per_tensor", "connector", "reference", "raw"}
    assert {c["variant"] for c in cs} == every

    bad = _checks(run_workers(_corrupting_worker, 2, (_check_cfg(find_free_port()), "reply"), timeout_s=120))
    failed = {c["variant"] for c in bad if not c["ok"]}
    assert failed == every
    assert all(c["role"] == "attention" for c in bad if not c["ok"])  # the FFN rank received the right bytes

    bad = _checks(run_workers(_corrupting_worker, 2, (_check_cfg(find_free_port()), "payload"), timeout_s=120))
    failed = [c for c in bad if not c["ok"]]
    assert {c["variant"] for c in failed if c["role"] == "ffn"} == every
    assert any("differ" in e for c in failed for e in c["errors"])


def _fp8_worker(rank, nprocs, cfg, flip):
    import afd_ext.tools.bench.variants as v
    from afd_ext.tools.bench.runner import bench_worker

    if flip and rank == 0:  # the FFN rank expects the other scale format than the one on the wire
        v._Fp8Wire.ue8m0 = property(lambda self: self.ctx.fp8_scale_format != "ue8m0")
    return bench_worker(rank, nprocs, cfg)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_fp8_check_passes_per_scale_format_and_detects_the_other(fmt):
    """``--check`` of ``ours_fp8`` on gloo: the FFN rank gets the CPU rule's values and scales of the pattern
    (``--fp8-scale-format``), the attention rank the XOR of their bf16 form; expecting the other format fails."""
    from dataclasses import replace

    cfg = replace(_check_cfg(find_free_port(), cases=[Case(256, 3, True, logits_width=8), Case(128, 1, False)]),
                  variants=("ours_fp8",), fp8_scale_format=fmt)
    cs = _checks(run_workers(_fp8_worker, 2, (cfg, False), timeout_s=120))
    assert len(cs) == 4 and all(c["ok"] and c["variant"] == "ours_fp8" for c in cs), cs
    bad = _checks(run_workers(_fp8_worker, 2, (replace(cfg, master_port=find_free_port()), True), timeout_s=120))
    assert {(c["role"], c["ok"]) for c in bad} == {("ffn", False), ("attention", True)}, bad
    assert all("tensor 1 rows" in " ".join(c["errors"]) for c in bad if not c["ok"])  # the scales differ


def test_cpu_check_sizes_take_every_variant_gloo_runs():
    """The CPU ``--check`` sizes suit the FP8 variant too (hidden a multiple of fp8.GROUP): none is skipped."""
    from afd_ext.fp8 import GROUP
    from afd_ext.tools.bench.plan import check_cases

    assert all(c.hidden % GROUP == 0 for c in check_cases(cuda=False))


# ---------------------------------------------------------------------------
# GPU tier: a CUDA build of afd_ext; --check on one GPU shares it (NCCL over sockets), timings need 2
# ---------------------------------------------------------------------------


gpu = pytest.mark.gpu  # tests/conftest.py skips these without a CUDA GPU and a CUDA build


@gpu
@pytest.mark.timeout(300)
def test_gpu_check_1a1f(tmp_path):
    rc = main(["--check", "--out", str(tmp_path / "c"), "--timeout", "280"])
    doc = json.loads((tmp_path / "c" / "bench.json").read_text())
    bad = [c for c in doc["checks"] if not c["ok"]]
    assert rc == 0 and not bad, bad
    seen = {(c["variant"], c["mode"]) for c in doc["checks"]}
    for v in ("ours_per_tensor", "reference", "raw", "peer"):
        assert (v, "eager") in seen and (v, "graph") in seen, v


@gpu
@pytest.mark.timeout(300)
def test_gpu_check_2a1f_fan_in(tmp_path):
    rc = main(["--check", "--attention-ranks", "2", "--tokens", "1,127", "--out", str(tmp_path / "c"),
               "--timeout", "280"])
    doc = json.loads((tmp_path / "c" / "bench.json").read_text())
    bad = [c for c in doc["checks"] if not c["ok"]]
    assert rc == 0 and not bad, bad
    assert {c["role_rank"] for c in doc["checks"] if c["role"] == "attention"} == {0, 1}


@gpu
@pytest.mark.distinct_gpus(2, "a timed sweep: processes sharing a GPU are time-sliced, so bench refuses to time them")
@pytest.mark.timeout(420)
def test_gpu_quick_sweep(tmp_path):
    rc = main(["--tokens", "1,128", "--extras", "on", "--time-per-point", "0.01", "--out", str(tmp_path / "q"),
               "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "q" / "bench.json").read_text())
    _validate(doc)
    for mode in ("eager", "graph"):
        for v in ("ours_per_tensor", "reference", "raw"):
            r = report.lookup(doc, "h7168-t128-extras", v, mode)
            assert r is not None and r["stats_us"]["median"] > 0, (v, mode)
    # The connector's eager calls beside the ops they issue, over NCCL and over peer memory.
    pairs = {(o["variant"], o["tokens"], o["call"]) for o in doc["connector_overhead"]}
    for v in ("connector", "connector_peer"):
        assert {(v, t, c) for t in (1, 128) for c in ("send_attn_output", "recv_ffn_output", "recv_attn_output",
                                                       "send_ffn_output", "round trip")} <= pairs, v


@pytest.mark.timeout(180)
@pytest.mark.parametrize("A,F", [(2, 1), (1, 2)])
def test_check_fan_in_and_split_gloo(A, F):
    # 1A2F with 1 token: the second FFN rank gets zero rows (skipped on both sides).
    cases = [Case(40, 5, True, logits_width=8), Case(40, 1, False)]
    res = run_workers(_corrupting_worker, A + F, (_check_cfg(find_free_port(), A, F, cases), None), timeout_s=150)
    cs = _checks(res)
    assert cs and all(c["ok"] for c in cs), [c for c in cs if not c["ok"]]
    assert {(c["role"], c["role_rank"]) for c in cs} == (
        {("attention", a) for a in range(A)} | {("ffn", f) for f in range(F)})
    assert {"ours_per_tensor", "connector", "reference", "raw"} <= {c["variant"] for c in cs}


def test_gloo_document_names_its_transport_and_says_what_it_cannot_show(tmp_path):
    doc = _synthetic_doc()
    doc["meta"]["backend"] = "gloo"
    doc["targets"] = report.evaluate_targets(doc)
    md = report.render_markdown(doc)
    assert md.splitlines()[2] == report.CPU_RUN_NOTE  # first thing under the title
    assert "raw gloo (1 msg)" in md and "raw NCCL" not in md and "x raw` = ours-default / raw gloo" in md
    assert "NCCL runtime" not in md
    assert report.variant_label("raw", "nccl") == "raw NCCL (1 msg)"


def test_gloo_report_gives_no_target_verdicts():
    doc = _synthetic_doc()
    doc["meta"]["backend"] = "gloo"
    doc["targets"] = report.evaluate_targets(doc)
    md = report.render_markdown(doc)
    targets = md.split("## Targets")[1].split("\n\n")[1]
    assert "**no**" not in targets and "| yes |" not in targets
    assert targets.count("not applicable on gloo") == len(doc["targets"])
    doc["meta"]["backend"] = "nccl"  # the same data from an NCCL run gets verdicts
    md = report.render_markdown(doc)
    assert "not applicable on gloo" not in md and "**no**" in md and "| yes |" in md
