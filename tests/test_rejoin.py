"""Issue 45: restart one role without restarting the other (plain connector API, gloo, real processes).

Each scenario kills a rank (SIGKILL mid-step) or lets it close in order and exit, then starts a fresh process
for that role rank. The survivors get a named error (or the goodbye), ``close()`` and ``init_afd_connector()``
again, and every reply of every step after the rejoin is checked exactly against ``ffn_fn`` of the attention
rank's own rows (``connector_scenarios``). The restarted process's time from its ``init_afd_connector()`` call
to its first step served is printed (``[rejoin] ...``); see docs/internals.md, "Restarting one role".
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import connector_scenarios as cs  # noqa: E402

from afd_ext.tools.testing import find_free_port  # noqa: E402

pytestmark = pytest.mark.timeout(240)

STEPS = ({0: [3, 2]}, {0: [1, 4], 1: [2, 0]}, {0: [2, 3]}, {0: [0, 5], 1: [1, 1]})


def _sc(A: int, F: int) -> cs.Scenario:
    steps = tuple({s: c[:A] for s, c in st.items()} for st in STEPS)
    return cs.Scenario(A=A, F=F, steps=steps, step_timeout_s=10.0, extra=(("init_timeout_s", 20.0),))  # waits log every 2 s


def _named(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e).splitlines()[0][:300]


def _expected(sc: cs.Scenario, i: int, a: int) -> int:
    return sc.layers * sum(cs.expected_rows(sc, c, a) for c in sc.steps[i].values())


# ------------------------------------------------------------------ workers (one process each)

def _entry(name, fn, args, q):
    emit = lambda what, value=None: q.put((name, "event", (what, value)))  # noqa: E731
    try:
        q.put((name, "result", fn(emit, *args)))
    except BaseException:  # noqa: BLE001
        q.put((name, "error", traceback.format_exc()))


def _kill_on_second_call(conn, method: str) -> None:
    orig, calls = getattr(conn, method), [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == 2:  # the step's second exchange: the first went through
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*a, **kw)

    setattr(conn, method, wrapped)


def attention_proc(emit, sc, wr, port, steps, kill_at=None, overrides=(), extra=()):
    """Run ``steps`` (indices into ``sc.steps``); on a failed step: close, re-init, go on with the next one.
    ``kill_at``: SIGKILL this process at the second exchange of that step. Returns rows checked per step, errors, timings."""
    with cs.hang_diagnostics(wr, "attention_proc"):
        conn = cs.make_connector(dataclasses.replace(sc, extra=sc.extra + tuple(extra)), wr, port, **dict(overrides))
        out = {"pid": os.getpid(), "checked": {}, "errors": []}
        t0 = time.monotonic()
        try:
            conn.init_afd_connector()
        except Exception as e:  # noqa: BLE001 - a refused process reports its error
            out["init_error"] = _named(e)
            conn.close()
            return out
        out["init_s"] = time.monotonic() - t0
        emit("ready")
        try:
            for i in steps:
                if i == kill_at:
                    _kill_on_second_call(conn, "send_attn_output")
                try:
                    out["checked"][i] = cs.attention_step(conn, sc, i, sc.steps[i])
                except Exception as e:  # noqa: BLE001 - the failed step: named, then re-initialise
                    out["errors"].append((i, *_named(e)))
                    conn.close()
                    t1 = time.monotonic()
                    conn.init_afd_connector()
                    out["reinit_s"] = time.monotonic() - t1
                    continue
                out.setdefault("first_step_s", time.monotonic() - t0)
            return out
        finally:
            conn.close()  # the goodbye


def ffn_proc(emit, sc, wr, port, generations, kill_at=None):
    """Serve steps; on an error (a peer's failure or its goodbye) ``close(); init_afd_connector()`` on the same
    connector and serve on, ``generations`` times in all. ``kill_at``: SIGKILL at the second exchange of that step served.
    Returns rows per step served per generation, the errors, timings and the WARNING lines of the waits."""
    from afd_ext.errors import AFDError

    with cs.hang_diagnostics(wr, "ffn_proc"):
        lines: list[tuple[float, str]] = []

        class Keep(logging.Handler):
            def emit(self, r):
                if r.levelno >= logging.WARNING and "still waits for" in r.getMessage():
                    lines.append((time.monotonic(), r.getMessage()))

        logging.getLogger("afd_ext.rendezvous").addHandler(Keep())
        conn = cs.make_connector(sc, wr, port)
        weights = id(conn)  # the "weights": this process's objects, kept across generations
        out = {"pid": os.getpid(), "weights": weights, "rows": [[]], "errors": [], "waits": []}
        t0 = time.monotonic()
        conn.init_afd_connector()
        emit("ready")
        served = 0
        try:
            while True:
                if served == kill_at:
                    _kill_on_second_call(conn, "send_ffn_output")
                try:
                    out["rows"][-1].append(cs.ffn_step(conn, sc)[0])
                    served += 1
                    out.setdefault("first_step_s", time.monotonic() - t0)
                except AFDError as e:
                    out["errors"].append(_named(e))
                    if len(out["rows"]) == generations:
                        out["links"] = conn.links_id
                        return out
                    conn.close()
                    emit("waiting")
                    t1, before = time.monotonic(), len(lines)
                    conn.init_afd_connector()  # the same connector object: the adapter's sequence
                    out["waits"].append((time.monotonic() - t1, [m for _, m in lines[before:]]))
                    out["rows"].append([])
        finally:
            conn.close()


class Run:
    """Processes started and restarted by the test; each reports events and one result through one queue."""

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.q = self.ctx.Queue()
        self.procs: dict[str, mp.Process] = {}
        self.results: dict[str, object] = {}
        self.events: list[tuple[str, str, object, float]] = []

    def start(self, name, fn, *args):
        p = self.ctx.Process(target=_entry, args=(name, fn, args, self.q), daemon=True)
        p.start()
        self.procs[name] = p

    def _take(self, timeout):
        name, kind, value = self.q.get(timeout=timeout)
        if kind == "error":
            raise AssertionError(f"{name} failed:\n{value}")
        if kind == "result":
            self.results[name] = value
        else:
            self.events.append((name, *value, time.monotonic()))

    def wait(self, cond, what, timeout=90.0):
        deadline = time.monotonic() + timeout
        while not cond():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}; events {self.events}, results {self.results}")
            try:
                self._take(min(left, 0.5))
            except queue_mod.Empty:
                pass

    def event(self, name, what, timeout=90.0):
        self.wait(lambda: any(e[0] == name and e[1] == what for e in self.events), f"{name}: {what}", timeout)

    def exited(self, name, timeout=90.0):
        p = self.procs[name]
        self.wait(lambda: not p.is_alive(), f"{name} to exit", timeout)
        return p.exitcode

    def finish(self, names, timeout=120.0):
        self.wait(lambda: all(n in self.results for n in names), f"results of {names}", timeout)
        return [self.results[n] for n in names]

    def close(self):
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)


@pytest.fixture
def run():
    r = Run()
    yield r
    r.close()


def _check_attention(sc, res, a, steps):
    for i in steps:
        assert res["checked"].get(i) == _expected(sc, i, a), (i, res)


def _report(what, res, bound_s=5.0):
    """Print the restarted process's time from its init call to its first step served, and hold it to
    ``bound_s`` (issue 45's 5 s; measured 0.05-0.5 s with a load of 9-14 on 2 CPUs)."""
    assert res["first_step_s"] < bound_s, (what, res)
    print(f"\n[rejoin] {what}: restarted process init -> first step served {res['first_step_s']:.2f} s "
          f"(load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


# ------------------------------------------------------------------ 2A1F: one attention rank restarted
def test_one_attention_rank_killed_mid_step_is_restarted_and_served(run):
    sc, port = _sc(2, 1), find_free_port("127.0.0.1")
    run.start("f0", ffn_proc, sc, 0, port, 2)
    run.start("a0", attention_proc, sc, 1, port, [0, 1, 2, 3])
    run.start("a1", attention_proc, sc, 2, port, [0, 1], 1)
    assert run.exited("a1") == -signal.SIGKILL
    run.start("a1'", attention_proc, sc, 2, port, [2, 3])
    f0, a0, a1 = run.finish(["f0", "a0", "a1'"])
    # the survivor: a named error for the failed step, naming the killed rank, then steps 2 and 3 exactly
    assert [e[0] for e in a0["errors"]] == [1], a0
    assert a0["errors"][0][1] in ("StepAbortedError", "AFDPeerError", "AFDTimeoutError"), a0
    assert "attention rank 1" in a0["errors"][0][2], a0
    _check_attention(sc, a0, 0, [0, 2, 3])
    _check_attention(sc, a1, 1, [2, 3])
    # the FFN rank: the failed step's error, one re-init, both steps of the new generation served
    assert len(f0["errors"]) == 2 and f0["errors"][0][0] != "ControlChannelClosed", f0
    assert f0["rows"][0][0] == _expected(sc, 0, 0) + _expected(sc, 0, 1), f0
    assert f0["rows"][1] == [sum(_expected(sc, i, a) for a in range(2)) for i in (2, 3)], f0
    _report("2A1F, attention rank 1 killed", a1)


# ------------------------------------------------------------------ 2A1F: every attention rank restarted
def test_all_attention_ranks_restarted_in_order_are_served_by_the_same_ffn_process(run):
    sc, port = _sc(2, 1), find_free_port("127.0.0.1")
    run.start("f0", ffn_proc, sc, 0, port, 2)
    run.start("a0", attention_proc, sc, 1, port, [0, 1])
    run.start("a1", attention_proc, sc, 2, port, [0, 1])
    assert run.exited("a0") == 0 and run.exited("a1") == 0
    run.event("f0", "waiting")
    time.sleep(4.5)  # the FFN waits, logging a WARNING line every 2 s (a tenth of init_timeout_s)
    run.start("a0'", attention_proc, sc, 1, port, [2, 3])
    run.start("a1'", attention_proc, sc, 2, port, [2, 3])
    f0, a0, a1 = run.finish(["f0", "a0'", "a1'"])
    old = run.results["a0"], run.results["a1"]
    for a, r in enumerate(old):
        _check_attention(sc, r, a, [0, 1])
    _check_attention(sc, a0, 0, [2, 3])
    _check_attention(sc, a1, 1, [2, 3])
    assert [e[0] for e in f0["errors"]] == ["ControlChannelClosed"] * 2, f0  # the goodbyes
    assert f0["links"] == 2, f0  # one re-init of the same connector: its graphs would be dropped
    assert f0["rows"] == [[sum(_expected(sc, i, a) for a in range(2)) for i in g] for g in ([0, 1], [2, 3])], f0
    waited, lines = f0["waits"][0]
    assert lines and all("attention rank" in m and "the AFD handshake" in m for m in lines), f0["waits"]
    print(f"\n[rejoin] 2A1F, every attention rank restarted: the FFN waited {waited:.2f} s, "
          f"{len(lines)} WARNING line(s), e.g. {lines[0]!r}")
    _report("2A1F, attention rank 0 restarted", a0)
    _report("2A1F, attention rank 1 restarted", a1)


# ------------------------------------------------------------------ 1A2F: FFN rank 1, FFN rank 0 restarted
@pytest.mark.parametrize("victim", [1, 0], ids=["ffn-rank-1", "ffn-rank-0-store-host"])
def test_an_ffn_rank_killed_mid_step_is_restarted_and_the_attention_rank_carries_on(run, victim):
    sc, port = _sc(1, 2), find_free_port("127.0.0.1")
    other = 1 - victim
    run.start(f"f{other}", ffn_proc, sc, other, port, 2)
    run.start(f"f{victim}", ffn_proc, sc, victim, port, 1, 1)
    run.start("a0", attention_proc, sc, 2, port, [0, 1, 2, 3])
    assert run.exited(f"f{victim}") == -signal.SIGKILL
    run.start(f"f{victim}'", ffn_proc, sc, victim, port, 1)
    fo, fv, a0 = run.finish([f"f{other}", f"f{victim}'", "a0"])
    assert [e[0] for e in a0["errors"]] == [1], a0
    assert a0["errors"][0][1] in ("StepAbortedError", "AFDPeerError", "AFDTimeoutError", "StoreUnavailableError"), a0
    _check_attention(sc, a0, 0, [0, 2, 3])
    assert len(fo["errors"]) == 2 and len(fo["rows"]) == 2, fo
    total = lambda i: _expected(sc, i, 0)  # noqa: E731 - both FFN ranks together serve every row once
    assert [fo["rows"][1][k] + fv["rows"][0][k] for k in range(2)] == [total(2), total(3)], (fo, fv)
    assert fv["errors"][0][0] == "ControlChannelClosed", fv  # the attention rank's goodbye
    # FFN rank 0 takes the store along (no abort can be posted): the surviving FFN rank, blocked on the attention
    # rank, fails at once when that rank's close() releases its gloo links (docs/internals.md), not at step_timeout_s
    _report(f"1A2F, FFN rank {victim} killed", fv)


# ------------------------------------------------------------------ waiting for a rejoin: bounded and named
def waiter_proc(emit, sc, port):
    """FFN rank 0 after its attention rank's goodbye: a named timeout, a close() that ends the wait at once,
    a mismatched peer refused, a peer of another job refused (this wait goes on), then the right peer served."""
    from afd_ext.errors import AFDError

    with cs.hang_diagnostics(0, "waiter_proc"):
        conn = cs.make_connector(sc, 0, port)
        out: dict = {"rows": []}
        conn.init_afd_connector()
        out["rows"].append(cs.ffn_step(conn, sc)[0])
        try:
            cs.ffn_step(conn, sc)
        except AFDError as e:
            out["goodbye"] = _named(e)
        conn.close()
        conn.extra = dataclasses.replace(conn.extra, init_timeout_s=2.0)
        t0 = time.monotonic()
        try:
            conn.init_afd_connector()
        except AFDError as e:
            out["timeout"] = (*_named(e), getattr(e, "missing", None), time.monotonic() - t0)
        conn.extra = dataclasses.replace(conn.extra, init_timeout_s=60.0)
        box: dict = {}

        def init():
            try:
                conn.init_afd_connector()
            except AFDError as e:
                box["error"], box["at"] = _named(e), time.monotonic()

        th = threading.Thread(target=init)
        th.start()
        time.sleep(1.0)
        t1 = time.monotonic()
        conn.close()
        th.join(10)
        out["closed"] = (box.get("error"), box.get("at", t1 + 99) - t1, th.is_alive())
        for what in ("mismatch", "serve"):
            emit(f"waiting for {what}")
            try:
                conn.init_afd_connector()
            except AFDError as e:
                out[what] = _named(e)
                conn.close()
                continue
            out["rows"].append(cs.ffn_step(conn, sc)[0])
        conn.close()
        return out


def test_waiting_for_a_rejoin_is_bounded_ends_on_close_refuses_mismatches_and_then_serves(run):
    sc, port = _sc(1, 1), find_free_port("127.0.0.1")
    run.start("f0", waiter_proc, sc, port)
    run.start("a0", attention_proc, sc, 1, port, [0])
    run.event("f0", "waiting for mismatch")
    run.start("bad-shape", attention_proc, sc, 1, port, [1], None, (("hidden_size", 16),))
    run.event("f0", "waiting for serve", 120)
    run.start("other-job", attention_proc, sc, 1, port, [1], None, (), (("job_id", "another-job"),))
    bad_job = run.finish(["other-job"])[0]
    run.start("a0'", attention_proc, sc, 1, port, [2])
    f0, a0, bad_shape = run.finish(["f0", "a0'", "bad-shape"])
    assert f0["goodbye"][0] == "ControlChannelClosed", f0
    name, msg, missing, took = f0["timeout"]
    assert name == "RendezvousTimeoutError" and missing == (1,) and "attention rank 0 (world rank 1)" in msg, f0
    assert took < 2.0 + 2.0, f0
    err, after, alive = f0["closed"]
    assert err is not None and err[0] == "AFDClosedError" and not alive and after < 1.0, f0
    assert f0["mismatch"][0] == "HandshakeMismatchError" and "hidden_size" in f0["mismatch"][1], f0
    assert bad_shape["init_error"][0] == "HandshakeMismatchError", bad_shape
    assert bad_job["init_error"][0] == "JobMismatchError", bad_job
    assert "serve" not in f0, f0  # the other job's process did not disturb this wait
    _check_attention(sc, run.results["a0"], 0, [0])
    _check_attention(sc, a0, 0, [2])
    assert f0["rows"] == [_expected(sc, 0, 0), _expected(sc, 2, 0)], f0
    print(f"\n[rejoin] waiting FFN rank: named timeout after {took:.2f} s (init_timeout_s 2), close() ended a "
          f"wait after {after:.3f} s")
    _report("1A1F, attention rank 0 restarted after refusals", a0)
