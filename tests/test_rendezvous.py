"""Rendezvous store, unique-id exchange, handshake, barrier and the step-abort signal."""

from __future__ import annotations

import os
import time

import pytest

from afd_ext import rendezvous as rdzv
from afd_ext.tools.testing import find_free_port, run_workers

HOST = "127.0.0.1"


def _fields(rank: int, bad_field: str | None, bad_rank: int) -> dict:
    fields = {"format_version": 2, "num_attention_ranks": 2, "num_ffn_ranks": 1,
              "hidden_size": 64, "hidden_dtype": "torch.bfloat16", "max_stages": 2}
    if bad_field is not None and rank == bad_rank:
        fields[bad_field] = fields[bad_field] * 2 if isinstance(fields[bad_field], int) else "torch.float16"
    return fields


def _rendezvous_worker(rank, nprocs, port, bad_field, bad_rank):
    store = rdzv.connect(HOST, port, rank, nprocs, 30.0, num_ffn_ranks=1)
    # FFN rank 0 creates the id of each (edge, direction); attention ranks read it.
    uids = {}
    for a in range(nprocs - 1):
        for direction in ("a2f", "f2a"):
            key = f"{direction}/{a}/0"
            if rank in (0, 1 + a):
                uids[key] = rdzv.exchange_unique_id(
                    store, key, rank == 0, lambda k=key: f"uid:{k}".encode() + bytes(120), 30.0,
                    creator_rank=0)
    try:
        everyone = rdzv.handshake(store, rank, nprocs, _fields(rank, bad_field, bad_rank), 30.0)
    except ValueError as e:
        return {"uids": uids, "error": str(e), "field": getattr(e, "field", None)}
    rdzv.barrier(store, rank, nprocs, "after-handshake", 30.0)
    rdzv.barrier(store, rank, nprocs, "after-handshake", 30.0)  # same name, matched by order
    return {"uids": uids, "peers": sorted(everyone), "generation": store.generation}


@pytest.mark.timeout(90)
def test_rendezvous_uid_exchange_and_handshake_2a1f():
    port = find_free_port(HOST)
    res = run_workers(_rendezvous_worker, 3, (port, None, -1), timeout_s=60)
    for rank, r in enumerate(res):
        assert "error" not in r, r
        assert r["peers"] == [0, 1, 2]
        assert r["generation"] == 1
    # Both ends of every communicator got the creator's bytes.
    for a in range(2):
        for d in ("a2f", "f2a"):
            key = f"{d}/{a}/0"
            want = f"uid:{key}".encode() + bytes(120)
            assert res[0]["uids"][key] == want
            assert res[1 + a]["uids"][key] == want
    assert "a2f/1/0" not in res[1]["uids"]


@pytest.mark.timeout(90)
def test_handshake_mismatch_names_field_values_and_ranks():
    port = find_free_port(HOST)
    # attention rank 1 (world rank 2) is started with hidden_size 128 instead of 64.
    res = run_workers(_rendezvous_worker, 3, (port, "hidden_size", 2), timeout_s=60)
    for rank, r in enumerate(res):
        assert r["field"] == "hidden_size", r
        msg = r["error"]
        assert "'hidden_size'" in msg and "64" in msg and "128" in msg
        assert "attention rank 1 (world rank 2)" in msg
    # The odd rank names itself and a peer holding the other value.
    assert "FFN rank 0 (world rank 0) has 64" in res[0]["error"]
    assert "attention rank 1 (world rank 2) has 128" in res[2]["error"]


@pytest.mark.timeout(90)
def test_handshake_version_mismatch_is_reported_first():
    port = find_free_port(HOST)
    res = run_workers(_rendezvous_worker, 2, (port, "format_version", 1), timeout_s=60)
    assert res[0]["field"] == "format_version"
    assert "has 2" in res[0]["error"] and "has 4" in res[0]["error"]


def _timeout_worker(rank, nprocs, port):
    store = rdzv.connect(HOST, port, rank, 3, 30.0, num_ffn_ranks=1)  # world of 3, only 2 started
    t0 = time.monotonic()
    try:
        rdzv.handshake(store, rank, 3, {"x": 1}, 1.5)
    except rdzv.RendezvousTimeoutError as e:
        out = {"msg": str(e), "missing": e.missing, "elapsed": time.monotonic() - t0}
    else:
        out = {"msg": None}
    rdzv.barrier(store, rank, 3, "done", 30.0, ranks=[0, 1])  # rank 0 hosts the store: leave last
    return out


@pytest.mark.timeout(60)
def test_wait_deadline_names_missing_rank():
    port = find_free_port(HOST)
    res = run_workers(_timeout_worker, 2, (port,), timeout_s=40)
    for r in res:
        assert r["msg"] is not None
        assert r["missing"] == (2,)
        assert "attention rank 1 (world rank 2)" in r["msg"]
        assert "the AFD handshake" in r["msg"]
        assert 1.4 <= r["elapsed"] < 10


def _abort_worker(rank, nprocs, port):
    store = rdzv.connect(HOST, port, rank, nprocs, 30.0, num_ffn_ranks=1)
    rdzv.barrier(store, rank, nprocs, "start", 30.0)
    if rank == 1:
        time.sleep(0.3)
        assert rdzv.check_abort(store) is None
        posted = rdzv.post_abort(store, "send_attn_output layer 3 stage 0 failed", by=store.label())
        second = rdzv.post_abort(store, "a later failure")
        out = {"posted": posted, "second": second, "seen": rdzv.check_abort(store)}
        return out
    t0 = time.monotonic()
    try:
        # Rank 1 never arrives at this barrier: only the abort can end the wait early.
        rdzv.barrier(store, rank, nprocs, "never", 60.0)
    except rdzv.StepAbortedError as e:
        return {"msg": str(e), "by": e.by, "reason": e.reason, "elapsed": time.monotonic() - t0}
    return {"msg": None}


@pytest.mark.timeout(60)
def test_abort_signal_wakes_a_waiter():
    port = find_free_port(HOST)
    res = run_workers(_abort_worker, 2, (port,), timeout_s=40)
    assert res[1]["posted"] is True and res[1]["second"] is False
    assert "layer 3 stage 0" in res[1]["seen"]
    assert res[0]["msg"] is not None
    assert res[0]["by"] == "attention rank 0 (world rank 1)"
    assert "layer 3 stage 0" in res[0]["reason"]
    assert "re-initialised" in res[0]["msg"]
    assert res[0]["elapsed"] < 5


def _generation_worker(rank, nprocs, port):
    out = []
    for _ in range(2):
        store = rdzv.connect(HOST, port, rank, nprocs, 30.0, num_ffn_ranks=1)
        rdzv.barrier(store, rank, nprocs, "joined", 30.0)
        out.append((store.generation, rdzv.check_abort(store)))
        rdzv.barrier(store, rank, nprocs, "checked", 30.0)
        if store.generation == 1:
            # Generation 1 is aborted mid-step; every rank sees it.
            if rank == 0:
                rdzv.post_abort(store, "boom")
            t0 = time.monotonic()
            while rdzv.check_abort(store) is None and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            out.append(rdzv.check_abort(store))
            try:  # every unfinished wait of an aborted generation raises at once
                rdzv.wait_for_keys(store, {"never-set": 0}, 30.0, "a key nobody sets")
                out.append("no error")
            except rdzv.StepAbortedError as e:
                out.append(e.reason)
            continue
        uid = rdzv.exchange_unique_id(store, "x", rank == 0, lambda g=store.generation: f"g{g}".encode(), 30.0)
        out.append(uid)
        rdzv.barrier(store, rank, nprocs, "done", 30.0)
    return out


@pytest.mark.timeout(60)
def test_reinitialising_opens_a_fresh_generation():
    port = find_free_port(HOST)
    res = run_workers(_generation_worker, 2, (port,), timeout_s=40)
    for r in res:
        assert r[0] == (1, None)
        assert r[1].startswith("boom (by FFN rank 0")
        assert r[2] == "boom"
        assert r[3] == (2, None)  # the abort of generation 1 is not visible in generation 2
        assert r[4] == b"g2"


def test_connect_validates_arguments():
    with pytest.raises(rdzv.AFDConfigError, match="world_rank"):
        rdzv.connect(HOST, 1234, 5, 2)
    with pytest.raises(rdzv.AFDConfigError, match="port"):
        rdzv.connect(HOST, 0, 0, 2)
    with pytest.raises(rdzv.AFDConfigError, match="host"):
        rdzv.connect("", 1234, 0, 2)


def _non_local_address() -> str | None:
    import socket

    for addr in ("203.0.113.77", "198.51.100.77", "192.0.2.177"):  # documentation ranges
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, 0))
            except OSError:
                return addr
    return None


def test_rank0_refuses_a_host_that_is_not_local():
    addr = _non_local_address()
    if addr is None:
        pytest.skip("every candidate documentation address is local here")
    with pytest.raises(rdzv.RendezvousError, match="not an address of this machine"):
        rdzv.connect(addr, find_free_port(HOST), 0, 2, 5.0)


def _routable_local_address() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent; picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def _non_loopback_worker(rank, nprocs, host, port):
    import socket

    from afd_ext import control as cp
    from afd_ext.topology import Topology

    store = rdzv.connect(host, port, rank, 2, 30.0, num_ffn_ranks=1)
    loopback_refused = None
    if rank == 1:
        # The store is bound to `host` only: the same port on loopback is closed.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            loopback_refused = s.connect_ex(("127.0.0.1", port)) != 0
    chans = cp.open_control_channels(store, Topology(1, 1), "ffn" if rank == 0 else "attention", 0, "tcp", 30.0)
    ch = chans[0]
    local_addr = ch._sock.getsockname()[0]
    if rank == 1:
        ch.send(b"over the routable address")
        out = None
    else:
        out = ch.recv(30.0)
    rdzv.barrier(store, rank, 2, "done", 30.0)
    ch.close()
    return {"loopback_refused": loopback_refused, "local_addr": local_addr, "got": out}


@pytest.mark.timeout(90)
def test_nothing_binds_to_loopback_when_host_is_routable():
    addr = _routable_local_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    res = run_workers(_non_loopback_worker, 2, (addr, find_free_port(addr)), timeout_s=60)
    assert res[1]["loopback_refused"] is True
    assert res[0]["local_addr"] == addr and res[1]["local_addr"] == addr  # control channel too
    assert res[0]["got"] == b"over the routable address"


@pytest.mark.timeout(30)
def test_client_times_out_naming_ffn_rank0():
    port = find_free_port(HOST)
    t0 = time.monotonic()
    with pytest.raises(rdzv.RendezvousTimeoutError, match="FFN rank 0") as e:
        rdzv.connect(HOST, port, 1, 2, 1.0)
    assert ".." not in str(e.value)  # the store's own message may end in a period
    assert time.monotonic() - t0 < 15


def test_rank_label():
    assert rdzv.rank_label(0, 2) == "FFN rank 0 (world rank 0)"
    assert rdzv.rank_label(3, 2) == "attention rank 1 (world rank 3)"
    assert rdzv.rank_label(3) == "world rank 3"



def test_ranks_run_as_threads_of_one_process_share_one_claim_token(monkeypatch):
    # Ranks as threads (the CPU tests) each claim their world rank with this process's token; two
    # threads building it at once gave two nonces, and a rank then refused its own claim as "held by
    # another running process" (its own pid): DuplicateRankError, ~40 % of runs of the NCCL fake tests.
    import threading

    from afd_ext.rendezvous import store

    monkeypatch.setattr(store, "_TOKEN", {})
    slow = store.start_time

    def start_time(pid):
        time.sleep(0.05)  # widen the window between "no token yet" and the token built
        return slow(pid)

    monkeypatch.setattr(store, "start_time", start_time)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(dict(store._process_token()))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(seen) == 4 and all(s == seen[0] for s in seen), seen


def test_a_killed_rank_not_yet_reaped_holds_its_claim_no_more():
    # a supervisor that restarts a rank before it reaps the killed process: the zombie's claim is free
    import signal
    import subprocess

    from afd_ext.rendezvous import host_identity
    from afd_ext.rendezvous.join import _holder_alive
    from afd_ext.health.process import start_time

    child = subprocess.Popen(["sleep", "30"])
    try:
        claim = {"host": host_identity(), "pid": child.pid, "start": start_time(child.pid)}
        assert claim["start"] is not None and _holder_alive(claim) is True
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _holder_alive(claim) and time.monotonic() < deadline:  # not reaped: the child stays a zombie
            time.sleep(0.01)
        assert _holder_alive(claim) is False
        with open(f"/proc/{child.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"  # what the claim check saw
    finally:
        child.kill()
        child.wait()


# ---------------------------------------------------------------- issue 34 item 6: no silent wait
def _wait_lines(caplog, t0: float) -> list[tuple[float, str, str]]:
    return [(r.created - t0, r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "afd_ext.rendezvous" and ("waits for" in r.getMessage())]


@pytest.mark.timeout(60)
def test_a_rank_waiting_at_init_for_missing_peers_says_who_what_and_the_time_left(caplog):
    """A line when the wait starts, then one every wait_log_interval_s (1 s for a 3.5 s deadline), each naming
    the missing ranks, what is awaited and the time left; then the error names them (not generations)."""
    import re

    caplog.set_level("INFO", logger="afd_ext")
    deadline = 3.5
    st = rdzv.connect(HOST, find_free_port(HOST), 0, 3, 30.0, num_ffn_ranks=1)  # FFN rank 0; A = 2 never come
    try:
        t0 = time.time()
        with pytest.raises(rdzv.RendezvousTimeoutError) as e:
            rdzv.handshake(st, 0, 3, {"x": 1}, deadline)
        took = time.time() - t0
    finally:
        rdzv.forget_cached_stores()
    lines = _wait_lines(caplog, t0)
    assert len(lines) >= 3, lines  # the start and one per second
    first = lines[0]
    assert first[0] < 0.5 and first[1] == "INFO", lines
    for at, level, msg in lines:
        assert "FFN rank 0 (world rank 0)" in msg and "the AFD handshake" in msg, msg
        assert "attention rank 0 (world rank 1), attention rank 1 (world rank 2)" in msg, msg
        left = float(re.search(r"gives up in (\d+) s", msg).group(1))
        assert abs(left - (deadline - at)) < 1.0, (at, msg)
    assert all(level == "WARNING" for _, level, _ in lines[1:]), lines
    gaps = [b[0] - a[0] for a, b in zip(lines, lines[1:])]
    assert all(0.8 < g < 1.6 for g in gaps), gaps
    msg = str(e.value)
    assert e.value.missing == (1, 2) and "attention rank 1 (world rank 2)" in msg, msg
    assert "generation" not in msg and "did not arrive" in msg, msg  # never joined: no second-job story
    assert deadline - 0.05 < took < deadline + 1.0, took
    assert rdzv.wait_log_interval_s(600.0) == 30.0 and rdzv.wait_log_interval_s(deadline) == 1.0


@pytest.mark.timeout(60)
def test_a_rank_waiting_for_the_store_host_says_so_until_its_deadline(caplog):
    caplog.set_level("INFO", logger="afd_ext")
    port = find_free_port(HOST)
    t0 = time.time()
    with pytest.raises(rdzv.RendezvousTimeoutError, match="FFN rank 0"):
        rdzv.connect(HOST, port, 1, 2, 2.5, num_ffn_ranks=1)
    lines = _wait_lines(caplog, t0)
    assert len(lines) >= 2 and lines[0][0] < 0.5 and lines[0][1] == "INFO", lines
    for _, _, msg in lines:
        assert msg.startswith("attention rank 0 (world rank 1) ") and f"store at {HOST}:{port}" in msg, msg
        assert "from FFN rank 0 (world rank 0)" in msg and "gives up in" in msg, msg


# ---------------------------------------------------------------- issue 45: one generation in the store
_HANDSHAKE_CHILD = """
import sys
from afd_ext import rendezvous as rdzv
st = rdzv.connect("127.0.0.1", int(sys.argv[1]), 2, 3, 20.0, num_ffn_ranks=1)
rdzv.handshake(st, 2, 3, {"x": 1}, 20.0)
print(st.generation, flush=True)
"""


def _child(port: int):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.Popen([sys.executable, "-c", _HANDSHAKE_CHILD, str(port)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


@pytest.mark.timeout(90)
def test_a_retried_and_a_restarted_rank_meet_their_peers_in_one_generation():
    """A rank whose init timed out and is retried joins the same, still open generation; a restarted process
    (a child here, world rank 2) joins the generation its surviving peers re-initialise into; a rank missing
    from a new generation is named with the generation it last joined."""
    import concurrent.futures as cf

    port = find_free_port(HOST)
    pool = cf.ThreadPoolExecutor(2)
    try:
        st0 = rdzv.connect(HOST, port, 0, 3, 20.0, num_ffn_ranks=1)
        st1 = rdzv.connect(HOST, port, 1, 3, 20.0, num_ffn_ranks=1)
        with pytest.raises(rdzv.RendezvousTimeoutError):  # world rank 2 not started yet
            rdzv.handshake(st1, 1, 3, {"x": 1}, 0.5)
        st1 = rdzv.connect(HOST, port, 1, 3, 20.0, num_ffn_ranks=1)  # the retry
        assert (st0.generation, st1.generation) == (1, 1)
        for attempt in (1, 2):  # world rank 2 started, then restarted
            child = _child(port)
            if attempt == 2:  # the survivors re-initialise (after the restarted one arrived, here)
                st0 = rdzv.connect(HOST, port, 0, 3, 20.0, num_ffn_ranks=1)
                st1 = rdzv.connect(HOST, port, 1, 3, 20.0, num_ffn_ranks=1)
            done = [pool.submit(rdzv.handshake, st, r, 3, {"x": 1}, 20.0) for r, st in ((0, st0), (1, st1))]
            [f.result(30) for f in done]
            assert int(child.communicate(timeout=30)[0]) == attempt == st0.generation == st1.generation
        # world rank 2 does not come back: named with the generation it last joined
        st0 = rdzv.connect(HOST, port, 0, 3, 20.0, num_ffn_ranks=1)
        st1 = rdzv.connect(HOST, port, 1, 3, 20.0, num_ffn_ranks=1)
        late = pool.submit(rdzv.handshake, st1, 1, 3, {"x": 1}, 1.0)
        with pytest.raises(rdzv.RendezvousTimeoutError) as e:
            rdzv.handshake(st0, 0, 3, {"x": 1}, 1.0)
        with pytest.raises(rdzv.RendezvousTimeoutError):
            late.result(10)
        assert st0.generation == 3 and e.value.missing == (2,), e.value
        assert "attention rank 1 (world rank 2) last joined generation 2" in str(e.value), e.value
        assert "this rank is at 3" in str(e.value) and "restart it" in str(e.value), e.value
    finally:
        pool.shutdown()
        rdzv.forget_cached_stores()


def test_a_close_ends_a_wait_for_a_restarting_store_host_at_once():
    """A survivor reconnecting while FFN rank 0 restarts waits for its port; the connector's close() (the
    ``stop`` event) ends that wait within one poll, not at init_timeout_s."""
    import threading

    from afd_ext.errors import AFDClosedError

    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(AFDClosedError, match="its connector was closed"):
        rdzv.connect(HOST, find_free_port(HOST), 1, 2, 30.0, num_ffn_ranks=1, stop=stop)
    assert time.monotonic() - t0 < 1.5
