"""``afd-ext launch`` over torchrun, and ``config_from_env``: who each rank is, failures, signals."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from afd_ext.tools import launch
from afd_ext.errors import AFDConfigError

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
EXAMPLE_LINE = re.compile(r"\[rank (\d+)\] multinode example: (\w+ rank \d+) on \S+: 4 steps, (\d+) rows exact")

SHOW = (
    "import json, os; from afd_ext.tools.launch import config_from_env, local_device; "
    "r = config_from_env(); c = r.config; "
    "print('SHOW ' + json.dumps({'role': r.role, 'rr': r.role_rank, 'host': c.host, 'port': c.port, "
    "'A': c.num_attention_ranks, 'F': c.num_ffn_ranks, 'extra': c.connector_extra_config, "
    "'device': local_device(), 'rank': os.environ['RANK']}), flush=True)"
)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFD_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def _launch(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "afd_ext", "launch", *args], capture_output=True, timeout=timeout,
                          env=_env(), cwd=REPO, text=True)


def _shown(stdout: str) -> dict[str, dict]:
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("SHOW ")
        if rest:
            out[prefix.strip()] = json.loads(rest)
    return out


@pytest.mark.timeout(90)
def test_launch_2a1f_gives_each_rank_its_role_and_prefixes_output():
    r = _launch(["-A", "2", "-F", "1", "--port", "29651", "--attention-gpus", "0,2", "--ffn-gpus", "1",
                 "--extra-config", '{"transport": "gloo"}', "--", PY, "-c", SHOW])
    assert r.returncode == 0, r.stderr
    shown = _shown(r.stdout)
    assert sorted(shown) == ["[rank 0]", "[rank 1]", "[rank 2]"], r.stdout
    # torchrun's RANK in the AFD world order, FFN ranks first; the GPU of each role rank.
    assert [(s["role"], s["rr"], s["device"]) for _, s in sorted(shown.items())] == [
        ("ffn", 0, 1), ("attention", 0, 0), ("attention", 1, 2)]
    for s in shown.values():
        assert (s["host"], s["port"], s["A"], s["F"]) == ("127.0.0.1", 29651, 2, 1)
        assert s["extra"] == {"transport": "gloo"}
    assert "rank 0 = FFN 0, ranks 1-2 = attention 0-1" in r.stderr


@pytest.mark.timeout(90)
def test_failing_rank_stops_the_others_and_its_code_is_returned():
    script = ("import os, time, sys\n"
              "if os.environ['RANK'] == '2':\n"
              "    time.sleep(0.5); print('failing now', flush=True); sys.exit(7)\n"
              "time.sleep(60)\n")
    t0 = time.monotonic()
    r = _launch(["-A", "2", "-F", "1", "--", PY, "-c", script])
    assert r.returncode == 7, (r.stdout, r.stderr)
    assert time.monotonic() - t0 < 40  # the sleeping ranks were terminated, not waited for
    assert "[rank 2] failing now" in r.stdout
    assert "afd-ext launch: rank 2 (attention rank 1) exited with code 7" in r.stderr
    assert "Traceback" not in r.stderr


def _start_sleepers(A: int, F: int) -> tuple[subprocess.Popen, list[int], list[str]]:
    """Launch ranks that each start a child and sleep; return the launcher, every rank's and child's pid, and
    the launcher's stderr lines so far (read by a thread: an unread pipe would block the launcher)."""
    script = ("import os, subprocess, time\n"
              "c = subprocess.Popen(['sleep', '120'])\n"
              # one write: the ranks share the pipe, and an unbuffered print() writes piece by piece
              "os.write(1, f'PIDS {os.getpid()} {c.pid}\\n'.encode())\n"
              "time.sleep(120)\n")
    p = subprocess.Popen([PY, "-m", "afd_ext", "launch", "-A", str(A), "-F", str(F), "--no-prefix", "--",
                          PY, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(), cwd=REPO)
    lines: queue.Queue[str] = queue.Queue()
    err: list[str] = []
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    threading.Thread(target=lambda: [err.append(x) for x in p.stderr], daemon=True).start()
    pids: list[int] = []
    deadline = time.monotonic() + 60
    while len(pids) < 2 * (A + F) and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line.startswith("PIDS"):
            pids += [int(x) for x in line.split()[1:]]
    if len(pids) != 2 * (A + F):
        p.kill()
        pytest.fail(f"ranks did not start within 60 s: pids {pids}, launcher rc {p.poll()}, stderr:\n{''.join(err)}")
    return p, pids, err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_launcher_stops_every_rank_and_its_children(sig, code):
    p, pids, err = _start_sleepers(1, 1)
    try:
        p.send_signal(sig)
        p.wait(timeout=60)
        said = f"got {sig.name}; every rank was stopped"
        deadline = time.monotonic() + 5  # the reader thread drains what the launcher wrote last
        while said not in "".join(err) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.returncode == code, "".join(err)
        assert said in "".join(err)
        deadline = time.monotonic() + 10
        while any(_alive(x) for x in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [x for x in pids if _alive(x)], "ranks or their children outlived the launcher"
    finally:
        for x in pids + [p.pid]:
            if _alive(x):
                os.kill(x, signal.SIGKILL)


def test_missing_command_is_one_line(capsys):
    assert launch.main(["-A", "1", "-F", "1", "--", "nonexistent_cmd_afd"]) == 127
    err = capsys.readouterr().err
    assert err.strip() == "afd-ext launch: command not found or not executable: 'nonexistent_cmd_afd'"


def test_bad_arguments_are_reported(capsys):
    bad = [
        ["-A", "2", "-F", "1", "--attention-gpus", "0,1,2", "--", "true"],
        ["-A", "1", "-F", "1"],  # no command
        ["-A", "0", "-F", "1", "--", "true"],
        ["-A", "1", "-F", "1", "--extra-config", "[1]", "--", "true"],
        ["-A", "1", "-F", "1", "--nproc-per-node", "3", "--", "true"],  # one node: must be A + F
        ["-A", "1", "-F", "1", "--no-such-torchrun-option", "--", "true"],
        ["-A", "1", "-F", "1", "--port", "99999", "--", "true"],
        ["-A", "1", "-F", "1", "--extra-config", '{"transprot": "gloo"}', "--", "true"],  # was: refused by each rank
    ]
    for argv in bad:
        with pytest.raises(SystemExit) as e:
            launch.main(argv)
        assert e.value.code == 2, argv
    err = capsys.readouterr().err
    assert "--attention-gpus has 3 entries" in err and "after '--'" in err and "must be A + F = 2" in err
    assert "argument --port: must be in 1..65535, got 99999" in err
    assert "argument --extra-config: unknown connector_extra_config field(s) ['transprot']; known fields: [" in err


def test_a_typo_in_extra_config_is_refused_before_torchrun_starts():
    t0 = time.monotonic()
    r = _launch(["-A", "1", "-F", "1", "--extra-config", '{"transprot": "gloo"}', "--", PY, "-c", "print('RAN')"])
    assert r.returncode == 2 and "RAN" not in r.stdout, (r.stdout, r.stderr)
    assert "unknown connector_extra_config field(s) ['transprot']" in r.stderr
    assert "[rank" not in r.stderr and time.monotonic() - t0 < 5.0  # no rank started (torch is never imported)


# ---------------------------------------------------------------------------
# config_from_env / local_device: the rules of the module doc
# ---------------------------------------------------------------------------


@pytest.fixture
def env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("AFD_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k)

    def set_(**kw):
        for k, v in kw.items():
            monkeypatch.setenv(k, str(v))
    return set_


def test_torchrun_rank_in_the_afd_world_order(env):
    env(WORLD_SIZE=5, MASTER_ADDR="10.1.2.3", MASTER_PORT=29500, AFD_NUM_FFN_RANKS=2)
    got = []
    for rank in range(5):
        env(RANK=rank)
        role, rr, cfg = launch.config_from_env()
        got.append((role, rr))
        # A derived from WORLD_SIZE; host from MASTER_ADDR; the AFD store's own port, not MASTER_PORT.
        assert (cfg.num_attention_ranks, cfg.num_ffn_ranks, cfg.host, cfg.port) == (3, 2, "10.1.2.3", 1239)
        assert cfg.role == role
    assert got == [("ffn", 0), ("ffn", 1), ("attention", 0), ("attention", 1), ("attention", 2)]


def test_explicit_mapping_and_explicit_role(env):
    env(WORLD_SIZE=4, RANK=2, AFD_NUM_ATTENTION_RANKS=2, AFD_NUM_FFN_RANKS=2, AFD_ROLES="f,a,ffn,attention",
        AFD_HOST="h0", AFD_PORT=4321, AFD_CONNECTOR_EXTRA_CONFIG='{"transport": "gloo"}')
    role, rr, cfg = launch.config_from_env(connector_extra_config={"strict": True})
    assert (role, rr, cfg.host, cfg.port) == ("ffn", 1, "h0", 4321)
    assert cfg.connector_extra_config == {"transport": "gloo", "strict": True}
    env(AFD_ROLE="attention", AFD_ROLE_RANK=1)  # per process: wins over RANK and the mapping
    assert launch.config_from_env()[:2] == ("attention", 1)
    assert launch.config_from_env(host="other").config.host == "other"  # an override wins over AFD_HOST


def test_config_from_env_errors_name_the_variable(env):
    with pytest.raises(AFDConfigError, match="AFD_NUM_ATTENTION_RANKS and AFD_NUM_FFN_RANKS are not set"):
        launch.config_from_env()
    env(AFD_NUM_ATTENTION_RANKS=2, AFD_NUM_FFN_RANKS=1)
    with pytest.raises(AFDConfigError, match="no role for this process"):
        launch.config_from_env()
    env(RANK=0, WORLD_SIZE=4, MASTER_ADDR="m")
    with pytest.raises(AFDConfigError, match=r"WORLD_SIZE=4 but A \+ F = 2 \+ 1 = 3"):
        launch.config_from_env()
    env(WORLD_SIZE=3, AFD_ROLES="a,f,a")
    # FFN rank 0 is not launcher rank 0, so MASTER_ADDR is not its host.
    with pytest.raises(AFDConfigError, match="set AFD_HOST"):
        launch.config_from_env()
    env(AFD_ROLES="a,f")
    with pytest.raises(AFDConfigError, match="AFD_ROLES='a,f' lists 2 ranks"):
        launch.config_from_env()
    env(AFD_ROLES="a,x,f")
    with pytest.raises(AFDConfigError, match="AFD_ROLES='a,x,f'"):
        launch.config_from_env()
    env(AFD_ROLES="f,a,a", AFD_PORT="port")
    with pytest.raises(AFDConfigError, match="AFD_PORT='port'"):
        launch.config_from_env()
    env(AFD_PORT=1240, AFD_ROLE="ffn", AFD_ROLE_RANK=1)
    with pytest.raises(AFDConfigError, match="AFD_ROLE_RANK=1 is out of range for 1 ffn ranks"):
        launch.config_from_env()


def test_local_device(env):
    assert launch.local_device() is None
    env(LOCAL_RANK=3)
    assert launch.local_device() == 3
    env(AFD_NUM_ATTENTION_RANKS=2, AFD_NUM_FFN_RANKS=1, WORLD_SIZE=3, RANK=2, AFD_ATTENTION_GPUS="4,5",
        AFD_FFN_GPUS="6")
    assert launch.local_device() == 5  # attention rank 1
    env(RANK=0)
    assert launch.local_device() == 6
    env(AFD_DEVICE=7)
    assert launch.local_device() == 7


@pytest.mark.timeout(120)
def test_example_runs_under_afd_ext_launch():
    r = _launch(["-A", "2", "-F", "1", "--", PY, "examples/multinode.py"], timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {m[0]: (m[1], int(m[2])) for m in EXAMPLE_LINE.findall(r.stdout)}
    assert rows.keys() == {"0", "1", "2"}, r.stdout
    assert rows["0"][0] == "ffn rank 0" and rows["2"][0] == "attention rank 1", rows
    # Every row the attention ranks checked went through the FFN rank (10 + 9 over the 4 steps).
    assert (rows["1"][1], rows["2"][1], rows["0"][1]) == (10, 9, 19), rows
