"""afd-ext bench --peer-structure: argument parsing, the plan, the bench-only CUDA source, the no-GPU refusal.

The timed run itself needs a GPU (``bash scripts/gpu_tier.sh build peer-structure``); here: the
options become the plan the GPU run executes, bad options are refused with a
clear message (exit 2), the CUDA source compiles for sm_90 where nvcc exists,
and a machine without a GPU gets a clean refusal, not a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from afd_ext.tools.bench import main as bench_main
from afd_ext.tools.bench import peer_structure as ps
from afd_ext.errors import AFDConfigError


def _plan(*argv):
    return ps.parse_plan(ps.build_parser().parse_args(list(argv)))


def test_default_plan_is_the_issue_sweep():
    p = _plan()
    assert p.structures == ("floor", "min", "fused", "plane", "plane_nopdl")
    assert p.tokens == (1, 8, 128, 1024, 8192)
    assert (p.hidden, p.logits, p.rounds, p.replays) == (7168, 256, 100, 8)
    cases = p.cases()
    # the floor runs at 1 token only; every other structure at every size, sizes outermost
    assert ("floor", 1) in cases and not any(s == "floor" and t != 1 for s, t in cases)
    assert len(cases) == 1 + 4 * 5
    assert cases[:5] == [("floor", 1), ("min", 1), ("fused", 1), ("plane", 1), ("plane_nopdl", 1)]
    # bytes per round trip: 7168 bf16 + 256 fp32 + one int32 to the FFN, 7168 bf16 back
    assert p.fan_in_bytes(1) == 14336 + 1024 + 4 and p.reply_bytes(8192) == 8192 * 14336
    # the minimal kernels' launch shape defaults to the plane's rule (64 KiB per block, puts <= 2 per SM)
    assert p.blocks(1, 264) == 1 and p.blocks(64 << 10, 264) == 1 and p.blocks((64 << 10) + 1, 264) == 2
    assert p.blocks(p.fan_in_bytes(8192), 2 * 132) == 264 and p.blocks(p.reply_bytes(8192), 132) == 132


def test_the_table_gives_each_plane_structure_its_ratio_to_min():
    p = _plan("--structures", "min,plane,plane_nopdl", "--tokens", "1,128")
    recs = [{"structure": s, "tokens": t, "best_us": us, "valid": True}
            for s, t, us in (("min", 1, 8.0), ("plane", 1, 8.4), ("plane_nopdl", 1, 6.0),
                             ("min", 128, 12.0), ("plane", 128, 13.2))]
    lines = ps._table(recs, p).splitlines()
    assert "| plane/min | 1.05x | 1.10x |" in lines
    assert "| plane_nopdl/min | 0.75x |  |" in lines
    assert "| plane_nopdl | 6.00 |  |" in lines


@pytest.mark.parametrize("argv, match", [
    (["--structures", "min,bogus"], "bogus"),
    (["--structures", ""], "empty"),
    (["--tokens", "1,x"], "integers"),
    (["--tokens", "0"], "positive"),
    (["--structures", "floor", "--tokens", "8"], "1 token only"),
])
def test_bad_options_are_refused(argv, match, capsys):
    with pytest.raises(AFDConfigError, match=match):
        _plan(*argv)
    assert bench_main(["--peer-structure", *argv]) == 2
    assert "afd-ext bench --peer-structure:" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_no_gpu_is_a_clean_refusal(capsys, tmp_path):
    assert bench_main(["--peer-structure", "--tokens", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err
    assert not os.listdir(tmp_path)  # nothing written, nothing half-run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_listed_in_bench_help_and_taken_anywhere_in_the_command(capsys, tmp_path):
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    assert "--peer-structure" in capsys.readouterr().out
    # After another option too (it once had to come first: "unrecognized arguments" otherwise).
    assert bench_main(["--out", str(tmp_path), "--peer-structure", "--tokens", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="needs nvcc")
def test_the_bench_kernels_compile_for_hopper(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    so = ps.build_library()
    assert os.path.getsize(so) > 0
    report = open(so + ".ptxas.txt").read()
    for kernel in ("min_put", "min_wait", "min_fused", "floor_attn", "floor_ffn"):
        assert kernel in report
    assert "spill stores" in report and " 0 bytes spill stores" in report
    # every exported launcher is there (ctypes binds them by name)
    syms = subprocess.run(["nm", "-D", so], capture_output=True, text=True).stdout
    for fn in ("ps_put", "ps_wait", "ps_fused", "ps_floor_attn", "ps_floor_ffn", "ps_enable_peer"):
        assert fn in syms
    assert ps.build_library() == so  # cached by source hash
