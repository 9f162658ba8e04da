"""``afd-ext launch``: environment per rank, prefixed output, failure and Ctrl-C propagation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from afd_ext import launch

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHOW_ENV = (
    "import json, os; keys = ['AFD_ROLE', 'AFD_ROLE_RANK', 'AFD_NUM_ATTENTION_RANKS', 'AFD_NUM_FFN_RANKS', "
    "'AFD_HOST', 'AFD_PORT', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', "
    "'CUDA_VISIBLE_DEVICES', 'AFD_DEVICE', 'AFD_CONNECTOR_EXTRA_CONFIG']; "
    "print('ENV ' + json.dumps({k: os.environ.get(k) for k in keys}))"
)


def _launch(args: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([PY, "-m", "afd_ext.launch", *args], capture_output=True, timeout=timeout,
                          env=env, cwd=REPO, **kw)


@pytest.mark.timeout(90)
def test_launch_2a1f_sets_environment_and_prefixes_output():
    r = _launch(["--num-attention-ranks", "2", "--num-ffn-ranks", "1", "--port", "29651",
                 "--attention-gpus", "0,2", "--ffn-gpus", "1", "--extra-config", '{"transport": "gloo"}',
                 "--", PY, "-c", SHOW_ENV])
    assert r.returncode == 0, r.stderr.decode()
    envs = {}
    for line in r.stdout.decode().splitlines():
        prefix, _, rest = line.partition("] ENV ")
        if rest:
            envs[prefix.lstrip("[")] = json.loads(rest)
    assert sorted(envs) == ["attn 0", "attn 1", "ffn 0"]
    f0, a0, a1 = envs["ffn 0"], envs["attn 0"], envs["attn 1"]
    # World order FFN first.
    assert (f0["AFD_ROLE"], f0["AFD_ROLE_RANK"], f0["RANK"]) == ("ffn", "0", "0")
    assert (a0["AFD_ROLE"], a0["AFD_ROLE_RANK"], a0["RANK"]) == ("attention", "0", "1")
    assert (a1["AFD_ROLE"], a1["AFD_ROLE_RANK"], a1["RANK"]) == ("attention", "1", "2")
    for e in envs.values():
        assert e["WORLD_SIZE"] == "3" and e["LOCAL_RANK"] == e["RANK"]
        assert e["AFD_NUM_ATTENTION_RANKS"] == "2" and e["AFD_NUM_FFN_RANKS"] == "1"
        assert e["AFD_HOST"] == "127.0.0.1" and e["AFD_PORT"] == "29651"
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"] not in (None, "29651")
        assert e["AFD_DEVICE"] == "0"
        assert json.loads(e["AFD_CONNECTOR_EXTRA_CONFIG"]) == {"transport": "gloo"}
    assert (f0["CUDA_VISIBLE_DEVICES"], a0["CUDA_VISIBLE_DEVICES"], a1["CUDA_VISIBLE_DEVICES"]) == ("1", "0", "2")


@pytest.mark.timeout(90)
def test_failing_rank_stops_the_others_and_its_code_is_returned():
    script = ("import os, time, sys\n"
              "if os.environ['AFD_ROLE'] == 'attention' and os.environ['AFD_ROLE_RANK'] == '1':\n"
              "    time.sleep(0.5); print('failing now', flush=True); sys.exit(7)\n"
              "time.sleep(60)\n")
    t0 = time.monotonic()
    r = _launch(["-A", "2", "-F", "1", "--grace-s", "2", "--", PY, "-c", script])
    assert r.returncode == 7, (r.stdout, r.stderr)
    assert time.monotonic() - t0 < 30  # the sleeping ranks were terminated, not waited for
    assert b"[attn 1] failing now" in r.stdout
    assert b"attn 1 exited with code 7" in r.stderr


@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_rank_and_returns_130():
    env = dict(os.environ, PYTHONPATH=REPO)
    script = "import time; print('up', flush=True); time.sleep(60)"
    p = subprocess.Popen([PY, "-m", "afd_ext.launch", "-A", "1", "-F", "1", "--", PY, "-c", script],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    seen = b""
    deadline = time.monotonic() + 30
    while seen.count(b"up") < 2 and time.monotonic() < deadline:
        seen += p.stdout.readline()
    assert seen.count(b"up") == 2, seen
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert b"interrupted" in err


def test_bad_arguments_are_reported():
    with pytest.raises(SystemExit) as e:
        launch.main(["-A", "2", "-F", "1", "--attention-gpus", "0,1,2", "--", "true"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        launch.main(["-A", "1", "-F", "1"])  # no command
    with pytest.raises(SystemExit):
        launch.main(["-A", "0", "-F", "1", "--", "true"])


def test_process_env_world_order():
    e = launch.process_env("attention", 1, 3, 2, "10.0.0.5", 1239, 1240, gpu="3", base={})
    assert e["RANK"] == "3" and e["WORLD_SIZE"] == "5" and e["AFD_HOST"] == "10.0.0.5"
    assert e["CUDA_VISIBLE_DEVICES"] == "3" and e["MASTER_PORT"] == "1240"
    e = launch.process_env("ffn", 1, 3, 2, "h", 1, 2, base={})
    assert e["RANK"] == "1" and "CUDA_VISIBLE_DEVICES" not in e


def test_config_from_env(monkeypatch):
    env = launch.process_env("ffn", 1, 4, 2, "10.1.2.3", 4321, 4322, extra_config='{"transport": "gloo"}', base={})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    role, role_rank, cfg = launch.config_from_env(connector_extra_config={"strict": True})
    assert (role, role_rank) == ("ffn", 1)
    assert (cfg.role, cfg.host, cfg.port, cfg.num_attention_ranks, cfg.num_ffn_ranks) == ("ffn", "10.1.2.3", 4321, 4, 2)
    assert cfg.connector_extra_config == {"transport": "gloo", "strict": True}
    monkeypatch.setenv("AFD_ROLE_RANK", "2")
    with pytest.raises(ValueError, match="AFD_ROLE_RANK=2"):
        launch.config_from_env()
    monkeypatch.delenv("AFD_HOST")
    with pytest.raises(RuntimeError, match="AFD_HOST is not set"):
        launch.config_from_env()


@pytest.mark.timeout(120)
def test_launched_ranks_meet_through_the_rendezvous():
    script = (
        "from afd_ext.launch import config_from_env\n"
        "from afd_ext import rendezvous as rdzv\n"
        "from afd_ext.topology import Topology\n"
        "role, rr, cfg = config_from_env()\n"
        "topo = Topology(cfg.num_attention_ranks, cfg.num_ffn_ranks)\n"
        "me = topo.world_rank(role, rr)\n"
        "store = rdzv.connect(cfg.host, cfg.port, me, topo.world_size, 60.0, num_ffn_ranks=topo.F)\n"
        "peers = rdzv.handshake(store, me, topo.world_size, {'A': topo.A, 'F': topo.F}, 60.0)\n"
        "rdzv.barrier(store, me, topo.world_size, 'bye', 60.0)\n"
        "print('met', sorted(peers), flush=True)\n"
    )
    r = _launch(["-A", "2", "-F", "1", "--", PY, "-c", script], timeout=100)
    assert r.returncode == 0, (r.stdout.decode(), r.stderr.decode())
    for name in ("ffn 0", "attn 0", "attn 1"):
        assert f"[{name}] met [0, 1, 2]".encode() in r.stdout
