"""GPU tier: ``afd-ext demo`` over NCCL.

Run on the GPU machine from the repository root, after the CUDA build:

    pytest -m gpu tests/gpu/test_demo_gpu.py -v -s

``-s`` shows the summaries (paste them into the issue's closing note). The demo
places its processes with :func:`afd_ext.tools.testing.place_processes`: on two GPUs
attention on GPU 0 and FFN on GPU 1 (2A1F puts both attention ranks on GPU 0);
on one GPU every process on GPU 0, NCCL over sockets. Wherever processes share
a GPU the summary must say its latencies are not meaningful.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

TIMEOUT = 900


def _demo(tmp_path, *args: str) -> dict:
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "afd_ext", "demo", "--backend", "nccl", "--no-progress", "--json", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=os.getcwd())
    print(" ".join(cmd[1:]))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    s = json.loads(out.read_text())
    assert s["backend"] == "nccl" and s["device"] == "cuda"
    assert s["self_check"]["ok"], s["self_check"]["failures"]
    assert s["generated_tokens"] > 0 and s["exchange_latency_us"]["count"] > 0
    from afd_ext.tools.testing import place_processes

    placement = place_processes(s["num_attention_ranks"], s["num_ffn_ranks"])
    assert s["placement"] == placement.describe()
    assert s["latencies_meaningful"] == placement.timings_meaningful
    assert ("latencies are not meaningful" in proc.stdout) == placement.shared
    return s


@pytest.mark.timeout(TIMEOUT + 60)
def test_demo_gpu_1a1f_deepseek_v2_lite_dims(tmp_path):
    s = _demo(tmp_path, "--topology", "1A1F", "--dims", "deepseek-v2-lite")
    assert s["model"]["hidden_size"] == 2048 and s["model"]["num_experts"] == 64
    assert s["model"]["dtype"] == "bfloat16"
    # bf16 hidden states of 2048: 4 KiB per row each way per layer.
    rows = sum(c[0] for c in s["step_counts"])
    assert s["bytes"]["ffn_to_attention"] == rows * s["model"]["layers"] * 2048 * 2


@pytest.mark.timeout(TIMEOUT + 60)
def test_demo_gpu_2a1f(tmp_path):
    s = _demo(tmp_path, "--topology", "2A1F")
    assert s["steps_with_zero_token_rank"] > 0


@pytest.mark.timeout(TIMEOUT + 60)
def test_demo_gpu_2a1f_two_stages_gate_on_attention(tmp_path):
    _demo(tmp_path, "--topology", "2A1F", "--stages", "2", "--gate-on-attention")
