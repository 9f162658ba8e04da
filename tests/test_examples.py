"""The examples the README and docs point at run as written and check their own replies."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script,says", [
    ("quickstart.py", "every attention rank got back exactly its rows"),
    # 2 stages, router logits + token ids, zero-token ranks: the replies depend on all three.
    ("two_stages.py", "2 stages, router logits [n, 4] + token ids, 4 steps with zero-token ranks; "
                      "every attention rank got back exactly its rows"),
])
def test_example_runs_and_checks_its_replies(script, says):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert says in proc.stdout


def test_quickstart_runs_under_the_launcher():
    """`afd-ext launch -A 2 -F 1 -- python examples/quickstart.py`: each process is one rank of the job."""
    cmd = [sys.executable, "-m", "afd_ext", "launch", "-A", "2", "-F", "1", "--",
           sys.executable, str(ROOT / "examples" / "quickstart.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ffn 0] quickstart: ffn rank 0 done, 3 steps" in proc.stdout
    for a in (0, 1):
        assert f"[attn {a}] quickstart: attention rank {a} done, 3 steps, got back exactly its rows" in proc.stdout


def test_quickstart_under_the_launcher_refuses_another_layout():
    cmd = [sys.executable, "-m", "afd_ext", "launch", "-A", "1", "-F", "1", "--",
           sys.executable, str(ROOT / "examples" / "quickstart.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "run it with `afd-ext launch -A 2 -F 1`" in proc.stdout + proc.stderr
