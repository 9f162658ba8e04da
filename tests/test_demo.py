"""``afd-ext demo`` end to end on CPU (gloo): several processes, the real connector, the self-check.

Each case runs the attention and FFN processes with the tiny config and
asserts the self-check passed against the whole model, plus what the case is
about (zero-token steps, two stages, gate on attention).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from afd_ext.tools import demo  # noqa: E402
from afd_ext.errors import AFDTimeoutError  # noqa: E402

TIMEOUT = 240


def _run(args: list[str]) -> dict:
    pytest.importorskip("afd_ext.connector", reason="the connector has not landed yet")
    plan = demo.build_plan(demo.parse_args(["--dims", "tiny", "--backend", "gloo", "--no-progress", *args]))
    return demo.run_demo(plan, timeout_s=TIMEOUT)


def _assert_passed(s: dict) -> None:
    ck = s["self_check"]
    assert ck["ok"], "\n".join(ck["failures"])
    assert ck["max_abs_diff"] <= demo.LOGIT_ATOL_FP32
    # Every fed token of every request was compared.
    assert ck["positions"] > 0
    assert s["generated_tokens"] > 0 and s["steps"] > 1


@pytest.mark.timeout(TIMEOUT + 60)
def test_demo_2a1f_with_a_rank_running_out_of_requests():
    # Rank 1's single request generates max(1, 4 - 3) = 1 token: it carries
    # tokens only in the prefill step and zero tokens in steps 1..3.
    s = _run(["--topology", "2A1F", "--requests-per-rank", "1", "--max-new-tokens", "4"])
    _assert_passed(s)
    assert s["steps"] == 4
    assert [c[1] for c in s["step_counts"][1:]] == [0, 0, 0]
    assert all(c[0] == 1 for c in s["step_counts"][1:])
    assert s["steps_with_zero_token_rank"] == 3
    layers = s["model"]["layers"]
    assert s["ffn_rows_served"] == [layers * sum(sum(c) for c in s["step_counts"])]


@pytest.mark.timeout(TIMEOUT + 60)
def test_demo_2a1f_two_stages_gate_on_attention():
    s = _run(["--topology", "2A1F", "--requests-per-rank", "2", "--max-new-tokens", "5", "--stages", "2",
              "--gate-on-attention"])
    _assert_passed(s)
    assert s["stages"] == 2 and s["gate"] == "attention"
    # Router logits travel attention -> FFN: more bytes that way than back.
    assert s["bytes"]["attention_to_ffn"] > s["bytes"]["ffn_to_attention"]


@pytest.mark.timeout(TIMEOUT + 60)
def test_demo_cli_1a1f_writes_json(tmp_path):
    """``python -m afd_ext demo`` at 1A1F, as a user runs it; the JSON holds the summary."""
    pytest.importorskip("afd_ext.connector", reason="the connector has not landed yet")
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "afd_ext", "demo", "--dims", "tiny", "--backend", "gloo", "--topology", "1A1F",
         "--requests-per-rank", "2", "--max-new-tokens", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "self-check      PASS" in proc.stdout
    # A normal run prints nothing else: no warning (leaked semaphore, deprecations), no bar frames in a log.
    assert proc.stderr == "", proc.stderr
    s = json.loads(out.read_text())
    _assert_passed(s)
    assert s["topology"] == "1A1F" and s["backend"] == "gloo"
    for key in ("tokens_per_s", "exchange_latency_us", "bytes", "steps", "generated_tokens"):
        assert key in s
    assert s["steps"] == 5
    # The FFN rank served exactly the rows the attention rank sent: per layer, every step's rows.
    layers = s["model"]["layers"]
    assert s["ffn_rows_served"] == [layers * sum(c[0] for c in s["step_counts"])]
    # Step 1 (lazy set-up) is reported apart: its slowest exchange, not in p50/p99.
    assert s["exchange_latency_us"]["count"] == layers * (s["steps"] - 1)
    assert s["exchange_latency_us"]["first_step_max"] > 0
    assert s["bytes"]["attention_to_ffn"] == s["bytes"]["ffn_to_attention"] > 0


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--topology", "0A1F"])
    with pytest.raises(SystemExit):
        demo.parse_args(["--stages", "0"])
    assert demo.main(["--dims", "no-such-model", "--backend", "gloo"]) == 2
    assert "unknown model dims" in capsys.readouterr().err


@pytest.mark.parametrize("argv, what", [
    # Each was found only inside a worker after ~10 s of start-up, or raised raw (OSError,
    # FileNotFoundError, a socket timeout after 0 ms, libgomp warnings).
    (["--step-timeout", "0"], "--step-timeout"),
    (["--threads", "0"], "--threads"),
    (["--host", "192.0.2.1"], "not an address of this machine"),
    (["--connector", "nosuch"], "unsupported AFD connector type: 'nosuch'"),
    (["--connector", "no_such_module_xyz:Cls"], "--connector no_such_module_xyz:Cls"),
    (["--fp8", "--dims", "tiny"], "multiple of 128"),
    (["--prompts", "/nonexistent/prompts.txt"], "--prompts /nonexistent/prompts.txt: cannot read it"),
    (["--port", "99999"], "argument --port: must be in 0..65535, got 99999"),  # was: a worker's AFDConfigError
    (["--port", "-1"], "argument --port: must be in 0..65535, got -1"),
    (["--timeout", "nan"], "argument --timeout: must be > 0, got nan"),  # was: a ValueError after start-up
    (["--step-timeout", "nan"], "argument --step-timeout: must be > 0, got nan"),
])
def test_demo_bad_input_is_a_usage_error_before_any_process_starts(argv, what, capsys, monkeypatch):
    from afd_ext.tools import testing

    started = []
    monkeypatch.setattr(testing, "run_workers", lambda *a, **k: started.append(a) or [])
    try:
        rc = demo.main([*argv, "--backend", "gloo", "--no-progress"])
    except SystemExit as e:  # argparse's usage error
        rc = e.code
    assert rc == 2 and not started
    assert what in capsys.readouterr().err


def test_demo_timeout_names_the_roles_still_running(monkeypatch):
    from afd_ext.tools import testing

    def late(*a, **k):
        err = TimeoutError("workers [0, 2] of 3 still running after 3 s")
        err.ranks = [0, 2]
        raise err

    monkeypatch.setattr(testing, "run_workers", late)
    plan = demo.build_plan(demo.parse_args(["--topology", "2A1F", "--backend", "gloo", "--no-progress"]))
    with pytest.raises(AFDTimeoutError, match=r"--timeout 3 s; still running: FFN rank 0 \(world rank 0\), "
                                           r"attention rank 1 \(world rank 2\)"):
        demo.run_demo(plan, timeout_s=3)


def test_shipped_configs_meet_the_brief():
    for name in demo.available_dims():
        cfg = demo.load_model_config(name)
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        assert cfg["num_hidden_layers"] >= 4 and experts >= 8 and cfg["num_experts_per_tok"] >= 2, name
        assert cfg["vocab_size"] > 256 and max(demo.PAD_ID, demo.BOS_ID, demo.EOS_ID) < cfg["vocab_size"]
    ds = demo.load_model_config("deepseek-v2-lite")
    assert (ds["hidden_size"], ds["num_experts"], ds["num_experts_per_tok"], ds["moe_intermediate_size"]) == (
        2048, 64, 6, 1408)


def test_requests_leave_the_batch_at_different_steps():
    reqs = demo.make_requests(2, 3, 10, prompts=demo.load_prompts())
    new = {a: [r.max_new_tokens for r in rs] for a, rs in reqs.items()}
    assert new == {0: [10, 8, 6], 1: [7, 5, 3]}
    lens = {len(r.prompt_ids) for rs in reqs.values() for r in rs}
    assert len(lens) > 1  # different prompt lengths
    assert all(r.prompt_ids[0] == demo.BOS_ID for rs in reqs.values() for r in rs)


@pytest.mark.parametrize("fp8", [None, "fp32", "ue8m0"])
def test_text_summary_says_when_fp8_is_on_the_wire(fp8):
    plan = demo.build_plan(demo.parse_args(["--dims", "small", "--backend", "gloo", "--no-progress",
                                            *(["--fp8", fp8] if fp8 else [])]))
    res = demo.RankResult(rank=0, requests=[], step_counts=[[3, 0]], wall_s=0.1, latency_ns={0: [1000, 900]},
                          bytes_sent=10, bytes_received=10, steps=2)
    ck = demo.CheckResult(ok=True, tolerance=0.5, max_abs_diff=0.1, positions=3, worst="-")
    s = demo.summarize(plan, [res], [{"rank": 0, "rows": 3}], ck, 1.0)
    backend = next(ln for ln in demo.format_summary(s).splitlines() if ln.strip().startswith("backend"))
    if fp8:
        assert backend.endswith(f"gloo (cpu); FP8 hidden states attention->FFN ({fp8} scales)"), backend
        assert s["fp8"] == fp8 and s["model"]["dtype"] == "bfloat16"
    else:
        assert backend.endswith("gloo (cpu)") and "FP8" not in backend, backend


def test_a_failed_self_check_exits_non_zero_and_says_where(monkeypatch, capsys):
    def fake_run_demo(plan, timeout_s):
        res = demo.RankResult(rank=0, requests=[], step_counts=[[3, 0]], wall_s=0.1, latency_ns={0: [1000]},
                              bytes_sent=10, bytes_received=10, steps=1)
        ck = demo.CheckResult(ok=False, tolerance=1e-4, max_abs_diff=0.5, positions=3,
                              worst="attention rank 1, request a1r0, position 2",
                              failures=["attention rank 1, request a1r0, position 2: max |logit diff| 0.5 > 1e-4"])
        return demo.summarize(plan, [res], [{"rank": 0, "rows": 3}], ck, 1.0)

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    rc = demo.main(["--dims", "tiny", "--backend", "gloo", "--no-progress"])
    out = capsys.readouterr()
    assert rc == 1
    assert "self-check      FAIL" in out.out
    assert "attention rank 1, request a1r0, position 2" in out.out
    assert "FAILED" in out.err


def test_cli_dispatch(capsys):
    from afd_ext.tools import cli

    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"afd_ext", "cuda_built", "gpus_visible", "default_transport", "torch"} <= set(info)
    assert cli.main([]) == 2  # no command: help, usage error
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])  # forwarded to the demo's own parser
    assert e.value.code == 0
    assert "--gate-on-attention" in capsys.readouterr().out
