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
