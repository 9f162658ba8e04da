"""afd_ext.envs is the one place that declares AFD_* variables: nothing reads one it does not know."""

from __future__ import annotations

import pathlib
import re

import pytest

from afd_ext import envs
from afd_ext.errors import AFDConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A direct read of the environment by name: os.environ.get("AFD_X"), os.environ["AFD_X"], getenv("AFD_X").
READ = re.compile(r'(?:environ\.get\(|environ\[|getenv\()\s*"(AFD_[A-Z0-9_]+)"')


def test_every_variable_read_by_name_is_declared():
    declared = {v["name"] for v in envs.describe()}
    reads = {}
    for path in [*(ROOT / "afd_ext").rglob("*.py"), *(ROOT / "csrc").rglob("*.c*")]:
        for name in READ.findall(path.read_text()):
            reads.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert reads, "the pattern found no read at all: it no longer matches how the code reads variables"
    assert {n: p for n, p in reads.items() if n not in declared} == {}
    # Python reads them through envs.get (which parses and names the variable); C++ reads by getenv.
    python_reads = {n: p for n, p in reads.items() if any(f.endswith(".py") and f != "afd_ext/envs.py" for f in p)}
    assert python_reads == {}


def test_flags_parse_as_booleans_and_refuse_other_values(monkeypatch):
    monkeypatch.setenv("AFD_TEST_SHARE_GPU", "yes")
    assert envs.get("AFD_TEST_SHARE_GPU") is True
    monkeypatch.setenv("AFD_PEER_STRUCTURE_ONE_GPU", "2")
    with pytest.raises(AFDConfigError, match="AFD_PEER_STRUCTURE_ONE_GPU='2'"):
        envs.get("AFD_PEER_STRUCTURE_ONE_GPU")
