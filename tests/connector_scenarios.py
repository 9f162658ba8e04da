"""Multi-process connector scenarios, parametrised by transport (gloo on CPU; NCCL, peer memory or auto on GPUs).

Used by ``tests/test_connector_gloo.py`` (CPU tier) and
``tests/gpu/test_connector_nccl.py`` (GPU tier). Every worker is a
module-level function ``fn(rank, nprocs, ...)`` for
:func:`afd_ext.tools.testing.run_workers`: ranks ``0..F-1`` are the FFN ranks and
``F..F+A-1`` the attention ranks (the AFD world order).

The FFN "model" is :func:`ffn_fn`, a fixed elementwise function of the hidden
states, router logits and token ids; each attention rank computes it on its own
rows and checks that the reply equals it exactly (elementwise ops give the same
bits whatever the batch composition).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

# A step: {stage: per-DP (or per-attention-rank) token counts}.
Step = dict


@dataclass(frozen=True)
class Scenario:
    """One multi-process connector run.

    Attributes:
        A, F, tp_size: topology.
        steps: the steps, each ``{stage: counts}``.
        hidden, layers, dtype: model facts (dtype by name).
        logits_width, logits_dtype, send_ids: optional wire tensors.
        strict: strict-mode headers.
        transport: ``"gloo"``, ``"nccl"``, ``"peer"`` or ``"auto"`` (``auto`` on a GPU: NCCL, peer memory where NCCL cannot serve).
        overlap: attention sends every stage of a layer before receiving (DBO
            style); else send/receive per stage.
        step_timeout_s: the data-plane deadline.
        extra: more ``connector_extra_config`` items.
    """

    A: int
    F: int
    steps: tuple = ()
    tp_size: int = 1
    hidden: int = 8
    layers: int = 2
    dtype: str = "float32"
    logits_width: int | None = None
    logits_dtype: str = "float32"
    send_ids: bool = False
    strict: bool = True
    transport: str = "gloo"
    overlap: bool = True
    step_timeout_s: float = 20.0
    extra: tuple = ()

    @property
    def nprocs(self) -> int:
        return self.A + self.F


def _dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def device_for(sc: Scenario) -> torch.device:
    """CPU for gloo (and auto without a GPU); ``cuda:0`` otherwise (each process sees its GPU through ``CUDA_VISIBLE_DEVICES``)."""
    cpu = sc.transport == "gloo" or (sc.transport == "auto" and not torch.cuda.is_available())
    return torch.device("cpu") if cpu else torch.device("cuda", 0)


def make_connector(sc: Scenario, rank: int, port: int, **overrides: Any):
    """Build the connector of AFD world rank ``rank`` for scenario ``sc``."""
    from afd_ext.config import AFDConfig
    from afd_ext.connector import AFDConnector

    role = "ffn" if rank < sc.F else "attention"
    role_rank = rank if role == "ffn" else rank - sc.F
    extra = {
        "transport": sc.transport,
        "strict": sc.strict,
        "step_timeout_s": sc.step_timeout_s,
        "init_timeout_s": 60.0,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 10.0,
    }
    extra.update(dict(sc.extra))
    cfg = AFDConfig(role=role, host="127.0.0.1", port=port, num_attention_ranks=sc.A, num_ffn_ranks=sc.F,
                    connector_extra_config=extra)
    kw = dict(hidden_size=sc.hidden, num_layers=sc.layers, dtype=_dt(sc.dtype),
              router_logits_width=sc.logits_width, router_logits_dtype=_dt(sc.logits_dtype),
              send_token_ids=sc.send_ids, tp_size=sc.tp_size, device=device_for(sc))
    kw.update(overrides)
    return AFDConnector(rank, 0, cfg, role_rank, **kw)


def expected_rows(sc: Scenario, counts: Sequence[int], a: int) -> int:
    """Attention rank ``a``'s rows from a count vector, computed independently of afd_ext (DP x TP)."""
    counts = list(counts)
    if len(counts) == sc.A:
        n = counts[a]
    else:
        n = counts[a // (sc.A // len(counts))]
    clamp = dict(sc.extra).get("clamp_idle_to_one", False)
    return max(1, n) if clamp else n


def make_inputs(sc: Scenario, step: int, layer: int, stage: int, a: int, n: int):
    """Deterministic wire tensors of attention rank ``a`` (small exact values, any dtype)."""
    dev = device_for(sc)
    base = torch.arange(n * sc.hidden, dtype=torch.float32, device=dev).reshape(n, sc.hidden)
    h = ((base * (a + 1) + 7 * step + 3 * layer + stage) % 17 - 8) / 4
    hidden = h.to(_dt(sc.dtype))
    logits = None
    if sc.logits_width is not None:
        lb = torch.arange(n * sc.logits_width, dtype=torch.float32, device=dev).reshape(n, sc.logits_width)
        logits = (((lb + a * 5 + layer) % 11) - 5).to(_dt(sc.logits_dtype))
    ids = None
    if sc.send_ids:
        ids = torch.arange(n, dtype=torch.int32, device=dev) + 1000 * a + 10 * step + layer
    return hidden, logits, ids


def ffn_fn(hidden: torch.Tensor, logits: torch.Tensor | None, ids: torch.Tensor | None, layer: int) -> torch.Tensor:
    """The FFN side's "model": elementwise in hidden, the first logit column and the token id."""
    out = hidden * 2 + (layer + 1)
    if logits is not None:
        out = out + logits[:, :1].to(hidden.dtype)
    if ids is not None:
        out = out + (ids % 5).to(hidden.dtype)[:, None]
    return out


def _payload(step: dict):
    from afd_ext.metadata import AFDControlPayload

    return AFDControlPayload({int(s): list(c) for s, c in step.items()})


def _ctx(layer: int, stage: int, n: int):
    from afd_ext.metadata import AFDTransferContext, AFDTransferMetadata

    return AFDTransferContext(AFDTransferMetadata.create_attention_metadata(layer_idx=layer, stage_idx=stage,
                                                                             seq_len=n))


def attention_step(conn, sc: Scenario, step_i: int, step: dict, *, bad: Callable | None = None) -> int:
    """Run one step on an attention rank; check every reply. Returns the rows checked.

    ``bad(layer, stage, tensors) -> tensors`` may corrupt the inputs of one exchange.
    """
    a = conn.role_rank
    payload = _payload(step)
    conn.control_plane.update_state_from_dp_metadata(payload)
    conn.control_plane.send_dp_metadata_list(payload)
    stages = sorted(step)
    checked = 0
    for layer in range(sc.layers):
        outstanding = []
        for s in stages:
            n = expected_rows(sc, step[s], a)
            h, lg, ids = make_inputs(sc, step_i, layer, s, a, n)
            want = ffn_fn(h, lg, ids, layer)
            if bad is not None:
                h, lg, ids = bad(layer, s, (h, lg, ids))
            conn.send_attn_output(h, _ctx(layer, s, n), router_logits=lg, input_ids=ids)
            outstanding.append((s, h, want))
            if not sc.overlap:
                checked += _check_reply(conn, sc, step_i, layer, *outstanding.pop())
        for item in outstanding:
            checked += _check_reply(conn, sc, step_i, layer, *item)
    return checked


def _check_reply(conn, sc, step_i, layer, s, h, want) -> int:
    out = conn.recv_ffn_output(h, ubatch_idx=s)
    if out is not h:
        raise AssertionError("recv_ffn_output must return ref_tensor itself")
    if device_for(sc).type == "cuda":
        conn.synchronize()  # bounded: a stall becomes the watchdog's named error
    if not torch.equal(out, want):
        bad = (out != want).nonzero()[:5].tolist()
        raise AssertionError(
            f"{conn.peer_map.me} step {step_i} layer {layer} stage {s}: reply differs from ffn_fn of its own rows "
            f"at {bad}: got {out.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}")
    return int(h.shape[0])


def ffn_step(conn, sc: Scenario) -> tuple[int, list]:
    """Run one step on an FFN rank (payload from the control plane). Returns (rows, seq_lens seen)."""
    payload = conn.control_plane.recv_dp_metadata_list()
    conn.control_plane.update_state_from_dp_metadata(payload)
    rows = 0
    seen = []
    spec = None
    if sc.logits_width is not None:
        from afd_ext.metadata import AFDExpertRoutingSpec

        spec = AFDExpertRoutingSpec(sc.logits_width, _dt(sc.logits_dtype))
    for layer in range(sc.layers):
        for s in sorted(payload.dp_metadata_list):
            p = conn.recv_attn_output(ubatch_idx=s, routing_spec=spec, recv_input_ids=sc.send_ids)
            md = p.context.metadata
            if sum(md.seq_lens) != p.hidden_states.shape[0]:
                raise AssertionError(f"seq_lens {md.seq_lens} do not add up to {p.hidden_states.shape[0]} rows")
            if (p.router_logits is None) != (sc.logits_width is None) or (p.input_ids is None) != (not sc.send_ids):
                raise AssertionError("optional tensors missing or unexpected in the FFN payload")
            out = ffn_fn(p.hidden_states, p.router_logits, p.input_ids, layer)
            conn.send_ffn_output(out, p.context)
            rows += int(p.hidden_states.shape[0])
            seen.append((layer, s, list(md.seq_lens)))
    if device_for(sc).type == "cuda":
        conn.synchronize()  # as the reference FFN loop syncs after every step; bounded here
    return rows, seen


def _setup_device(sc: Scenario) -> None:
    if device_for(sc).type == "cuda":
        torch.cuda.set_device(0)


# ---------------------------------------------------------------------------
# Hang diagnostics (phase log + stack dumps), armed in every worker
# ---------------------------------------------------------------------------

#: Seconds after which a worker still inside its scenario dumps every thread's
#: stack to stderr (and again every as many seconds); ``AFD_TEST_STACK_DUMP_S``.
DEFAULT_STACK_DUMP_S = 90.0
_T0 = [time.monotonic()]


def phase(rank: int, what: str) -> None:
    """One timestamped line on stderr: ``[afd-test 12:00:01.234 +3.21s world rank 2 pid 77] what``."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    print(f"[afd-test {stamp} +{time.monotonic() - _T0[0]:.2f}s world rank {rank} pid {os.getpid()}] {what}",
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def hang_diagnostics(rank: int, name: str):
    """Arm stack dumps for the body: every ``AFD_TEST_STACK_DUMP_S`` seconds (default
    :data:`DEFAULT_STACK_DUMP_S`) and when the harness terminates the worker (SIGTERM), all
    threads' stacks go to stderr, so a stuck rank shows where it is (the NCCL helper
    threads are named after the communicator they release or create). Also sets the log
    level of ``afd_ext`` from ``AFD_TEST_LOG_LEVEL`` (default WARNING)."""
    _T0[0] = time.monotonic()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("afd_ext").setLevel(os.environ.get("AFD_TEST_LOG_LEVEL", "WARNING").upper())
    after = float(os.environ.get("AFD_TEST_STACK_DUMP_S", DEFAULT_STACK_DUMP_S))
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.dump_traceback_later(after, repeat=True, file=sys.stderr, exit=False)
    sigterm = hasattr(faulthandler, "register")
    if sigterm:
        faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
    phase(rank, f"{name}: start (stack dump every {after:g} s while running, and on SIGTERM)")
    try:
        yield
    except BaseException as e:
        phase(rank, f"{name}: raised {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        raise
    else:
        phase(rank, f"{name}: done")
    finally:
        faulthandler.cancel_dump_traceback_later()
        if sigterm:
            faulthandler.unregister(signal.SIGTERM)


def diagnosed(fn: Callable) -> Callable:
    """Decorator for a worker ``fn(rank, nprocs, ...)``: runs it under :func:`hang_diagnostics`."""
    import functools

    @functools.wraps(fn)
    def wrapper(rank: int, nprocs: int, *args: Any) -> Any:
        with hang_diagnostics(rank, fn.__name__):
            return fn(rank, nprocs, *args)

    return wrapper


def logged_init(conn) -> None:
    """``conn.init_afd_connector()`` between two phase lines (with the generation it got)."""
    phase(conn.world_rank, "init start")
    t0 = time.monotonic()
    conn.init_afd_connector()
    gen = getattr(getattr(conn, "_store", None), "generation", "?")
    phase(conn.world_rank, f"init end ({time.monotonic() - t0:.2f} s, generation {gen})")


def logged_close(conn) -> None:
    """``conn.close()`` between two phase lines."""
    phase(conn.world_rank, "close start")
    t0 = time.monotonic()
    conn.close()
    phase(conn.world_rank, f"close end ({time.monotonic() - t0:.2f} s)")


def scenario_worker(rank: int, nprocs: int, sc: Scenario | tuple, port: int) -> dict | list:
    """Run every step of ``sc``; return what this rank checked.

    ``sc`` may be a tuple of scenarios with the same ``A``/``F``: they run one
    after the other in the same processes (a fresh connector each, i.e. a new
    rendezvous generation on the same store), which saves process start-ups.
    """
    if isinstance(sc, tuple):
        with hang_diagnostics(rank, f"scenario_worker x{len(sc)}"):
            return [_scenario_one(rank, one, port) for one in sc]
    with hang_diagnostics(rank, "scenario_worker"):
        return _scenario_one(rank, sc, port)


def _scenario_one(rank: int, sc: Scenario, port: int) -> dict:
    _setup_device(sc)
    conn = make_connector(sc, rank, port)
    try:
        logged_init(conn)
        conn.init_afd_connector()  # idempotent
        assert conn.is_initialized
        if conn.role == "attention":
            checked = [attention_step(conn, sc, i, step) for i, step in enumerate(sc.steps)]
            return {"role": "attention", "rank": conn.role_rank, "checked": checked,
                    "transport": conn.transport_kind}
        rows, seen = [], []
        for _ in sc.steps:
            r, s = ffn_step(conn, sc)
            rows.append(r)
            seen.append(s)
        return {"role": "ffn", "rank": conn.role_rank, "rows": rows, "seen": seen, "transport": conn.transport_kind}
    finally:
        logged_close(conn)
        conn.close()  # idempotent
        assert not conn.is_initialized


def check_scenario_results(sc: Scenario, results: list[dict]) -> None:
    """Cross-check the workers' results against the scenario (independent of afd_ext's topology code)."""
    attn = [r for r in results if r["role"] == "attention"]
    ffn = [r for r in results if r["role"] == "ffn"]
    assert len(attn) == sc.A and len(ffn) == sc.F
    for i, step in enumerate(sc.steps):
        total = sum(expected_rows(sc, step[s], a) for s in step for a in range(sc.A))
        got_attn = sum(r["checked"][i] for r in attn)
        assert got_attn == total * sc.layers, (i, got_attn, total)
        got_ffn = sum(r["rows"][i] for r in ffn)
        assert got_ffn == total * sc.layers, (i, got_ffn, total)


# ---------------------------------------------------------------------------
# Handshake mismatch
# ---------------------------------------------------------------------------


@diagnosed
def handshake_mismatch_worker(rank: int, nprocs: int, sc: Scenario, port: int, field: str = "hidden_size") -> dict:
    """The FFN ranks and the attention ranks differ in ``field``: init must fail, naming the field.

    ``field`` is ``"hidden_size"`` (FFN ``hidden``, attention ``2 * hidden``) or
    ``"graph_cache_size"`` (FFN 8, attention 16).
    """
    from afd_ext.rendezvous import HandshakeMismatchError

    _setup_device(sc)
    attention = rank >= sc.F
    if field == "hidden_size":
        conn = make_connector(sc, rank, port, hidden_size=sc.hidden * 2 if attention else sc.hidden)
    elif field == "graph_cache_size":
        conn = make_connector(replace(sc, extra=sc.extra + (("graph_cache_size", 16 if attention else 8),)),
                              rank, port)
    else:
        raise ValueError(f"handshake_mismatch_worker: unknown field {field!r}")
    try:
        logged_init(conn)
    except HandshakeMismatchError as e:
        return {"field": e.field, "message": str(e), "initialized": conn.is_initialized}
    finally:
        conn.close()
    raise AssertionError(f"init_afd_connector succeeded despite a {field} mismatch")


# ---------------------------------------------------------------------------
# Bad input at the first exchange of a step: rejected, step drained, next step fine
# ---------------------------------------------------------------------------


@diagnosed
def bad_first_input_worker(rank: int, nprocs: int, sc: Scenario, port: int, bad_rank: int, bad_step: int,
                           retry: bool) -> dict:
    """Attention rank ``bad_rank`` passes a wrong-dtype tensor at the first exchange of step ``bad_step``.

    The call must raise AFDConfigError (a ValueError). With ``retry`` the rank retries with the
    right tensors and finishes the step; otherwise it moves on to the next
    step (the connector drains the abandoned one). Every other rank runs every
    step normally and checks its replies.
    """
    _setup_device(sc)
    conn = make_connector(sc, rank, port)
    out: dict = {"rank": rank, "rejections": []}
    try:
        conn.init_afd_connector()
        if conn.role == "ffn":
            out["rows"] = [ffn_step(conn, sc)[0] for _ in sc.steps]
            return out
        checked = []
        for i, step in enumerate(sc.steps):
            if conn.role_rank == bad_rank and i == bad_step:
                first = {"done": False}

                def bad(layer, stage, t):
                    if first["done"]:
                        return t
                    first["done"] = True
                    h, lg, ids = t
                    return h.to(torch.float64), lg, ids

                try:
                    attention_step(conn, sc, i, step, bad=bad)
                except ValueError as e:
                    out["rejections"].append(str(e))
                else:
                    raise AssertionError("a float64 hidden_states was not rejected")
                if retry:
                    checked.append(_finish_step(conn, sc, i, step))
                else:
                    checked.append(0)
                continue
            checked.append(attention_step(conn, sc, i, step))
        out["checked"] = checked
        return out
    finally:
        conn.close()


def _finish_step(conn, sc: Scenario, step_i: int, step: dict) -> int:
    """Re-run a step's layer loop without re-applying the payload (retry after a rejection)."""
    a = conn.role_rank
    checked = 0
    for layer in range(sc.layers):
        outstanding = []
        for s in sorted(step):
            n = expected_rows(sc, step[s], a)
            h, lg, ids = make_inputs(sc, step_i, layer, s, a, n)
            want = ffn_fn(h, lg, ids, layer)
            conn.send_attn_output(h, _ctx(layer, s, n), router_logits=lg, input_ids=ids)
            outstanding.append((s, h, want))
        for item in outstanding:
            checked += _check_reply(conn, sc, step_i, layer, *item)
    return checked


# ---------------------------------------------------------------------------
# The decode pattern of the control-plane margin probe (issue #33)
# ---------------------------------------------------------------------------


@diagnosed
def decode_pattern_worker(rank: int, nprocs: int, sc: Scenario, port: int) -> dict:
    """The margin probe's decode pattern, one stage per step (``sc.steps``: ``{0: counts}`` each).

    Attention: apply and send the payload, send layer 0 and wait until it has left (a CUDA event polled
    on a GPU), then per layer receive the reply before sending the next layer; one ``synchronize`` at
    the end of the step, then every reply is checked against ``ffn_fn`` of its own rows. FFN: receive
    and reply per layer, one ``synchronize`` per step. In the first step the attention rank first tries
    the probe's original order (layer 1 before layer 0's reply: over peer memory it overran the plane's
    one slot per stage) and the FFN rank tries to take layer 1 before replying to layer 0: both must be
    refused with AFDStateError before anything moves, and the step then completes on every rank.

    Returns:
        ``{"role", "refused": [messages], "checked": rows checked per step (attention) / received (FFN),
        "transport"}``.
    """
    from afd_ext.errors import AFDStateError

    _setup_device(sc)
    dev = device_for(sc)
    conn = make_connector(sc, rank, port)
    out: dict = {"role": None, "refused": [], "checked": []}
    try:
        conn.init_afd_connector()
        out["role"], out["transport"] = conn.role, conn.transport_kind
        for i, step in enumerate(sc.steps):
            if conn.role == "attention":
                a = conn.role_rank
                payload = _payload(step)
                conn.control_plane.update_state_from_dp_metadata(payload)
                conn.control_plane.send_dp_metadata_list(payload)
                n = expected_rows(sc, step[0], a)
                replies = []
                for layer in range(sc.layers):
                    h = make_inputs(sc, i, layer, 0, a, n)[0]
                    want = ffn_fn(h, None, None, layer)
                    conn.send_attn_output(h, _ctx(layer, 0, n))
                    if layer == 0 and dev.type == "cuda":
                        ev = torch.cuda.Event()
                        ev.record()
                        while not ev.query():
                            pass
                    if layer == 0 and i == 0 and sc.layers > 1:
                        try:
                            conn.send_attn_output(make_inputs(sc, i, 1, 0, a, n)[0], _ctx(1, 0, n))
                        except AFDStateError as e:
                            out["refused"].append(str(e))
                    replies.append((conn.recv_ffn_output(h, ubatch_idx=0), want))
                if dev.type == "cuda":
                    conn.synchronize()
                for layer, (got, want) in enumerate(replies):
                    if not torch.equal(got, want):
                        raise AssertionError(f"{conn.peer_map.me} step {i} layer {layer}: reply differs from "
                                             f"ffn_fn of its own rows: {got.flatten()[:6].tolist()} vs "
                                             f"{want.flatten()[:6].tolist()}")
                out["checked"].append(n * sc.layers)
            else:
                p = conn.control_plane.recv_dp_metadata_list()
                conn.control_plane.update_state_from_dp_metadata(p)
                rows = 0
                for layer in range(sc.layers):
                    got = conn.recv_attn_output(ubatch_idx=0)
                    if layer == 0 and i == 0 and sc.layers > 1:
                        try:
                            conn.recv_attn_output(ubatch_idx=0)
                        except AFDStateError as e:
                            out["refused"].append(str(e))
                    conn.send_ffn_output(ffn_fn(got.hidden_states, None, None, layer), got.context)
                    rows += int(got.hidden_states.shape[0])
                if dev.type == "cuda":
                    conn.synchronize()
                out["checked"].append(rows)
        return out
    finally:
        conn.close()


def check_decode_pattern(sc: Scenario, results: list[dict]) -> None:
    """Both refusals named the rule and the call to make first; every step's rows arrived and were checked."""
    for r in results:
        assert len(r["refused"]) == 1, r["refused"]
        msg = r["refused"][0]
        assert "One exchange per stage may be in flight" in msg, msg
        if r["role"] == "attention":
            assert "layer 1, stage 0, but the reply of layer 0, stage 0 was not received yet" in msg, msg
            assert "call recv_ffn_output(ubatch_idx=0) first" in msg, msg
            assert r["checked"] == [expected_rows(sc, st[0], 0) * sc.layers for st in sc.steps]
        else:
            assert "layer 1, but the reply of layer 0, stage 0 was not sent yet" in msg, msg
            assert r["checked"] == [sum(expected_rows(sc, st[0], a) for a in range(sc.A)) * sc.layers
                                    for st in sc.steps]


# ---------------------------------------------------------------------------
# Failure mid-step: aborted everywhere, then re-initialised
# ---------------------------------------------------------------------------


@diagnosed
def mid_step_failure_worker(rank: int, nprocs: int, sc: Scenario, port: int, bad_rank: int) -> dict:
    """Attention rank ``bad_rank`` passes a bad tensor at layer 1 of step 1 (layer 0 already sent), then
    gives the step up: it applies the next step's payload instead of repeating the call.

    The bad call is an AFDConfigError on that rank only (nothing is aborted by it);
    giving the half-done step up aborts it on every rank: the others raise,
    within the deadline, an abort naming the bad rank and its rejected call.
    Then all close, re-initialise and run one more step successfully.
    """
    _setup_device(sc)
    conn = make_connector(sc, rank, port)
    out: dict = {"rank": rank}
    t0 = time.monotonic()
    try:
        logged_init(conn)
        if conn.role == "ffn":
            ffn_step(conn, sc)
            try:
                ffn_step(conn, sc)
            except Exception as e:  # noqa: BLE001 - reported to the test
                out["error"] = (type(e).__name__, str(e))
                phase(rank, f"step 1 failed as expected: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        else:
            attention_step(conn, sc, 0, sc.steps[0])

            def bad(layer, stage, t):
                if conn.role_rank == bad_rank and layer == 1:
                    h, lg, ids = t
                    return h[:, :-1].contiguous(), lg, ids
                return t

            try:
                attention_step(conn, sc, 1, sc.steps[1], bad=bad)
            except Exception as e:  # noqa: BLE001
                out["error"] = (type(e).__name__, str(e))
                phase(rank, f"step 1 failed as expected: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            if conn.role_rank == bad_rank:
                out["rejection"] = out.pop("error")
                try:  # give the half-done step up: every rank's step is aborted
                    conn.control_plane.update_state_from_dp_metadata(_payload(sc.steps[2]))
                except Exception as e:  # noqa: BLE001
                    out["error"] = (type(e).__name__, str(e))
        out["elapsed"] = time.monotonic() - t0
        out["usable_after"] = _call_fails(conn)
        logged_close(conn)
        logged_init(conn)
        if conn.role == "ffn":
            out["after"] = ffn_step(conn, sc)[0]
        else:
            out["after"] = attention_step(conn, sc, 2, sc.steps[2])
        phase(rank, f"step 2 after re-init done ({out['after']} rows)")
        return out
    finally:
        logged_close(conn)


def _call_fails(conn) -> bool:
    """True when the connector refuses work after an abort (it must until re-initialised)."""
    try:
        if conn.role == "ffn":
            conn.recv_attn_output(0)
        else:
            conn.recv_ffn_output(torch.empty(0, conn.hidden_size, dtype=conn.dtype, device=conn.device), 0)
    except Exception:  # noqa: BLE001
        return True
    return False


# ---------------------------------------------------------------------------
# A peer killed or stalled mid-step
# ---------------------------------------------------------------------------


@diagnosed
def peer_loss_worker(rank: int, nprocs: int, sc: Scenario, port: int, victim: int, mode: str) -> dict:
    """World rank ``victim`` (an attention rank) dies (``mode="kill"``: SIGKILL) or stalls
    (``mode="stall"``: sleeps past the deadline) after layer 0 of step 1.

    The survivors must raise within the deadline an error naming the victim,
    the layer and the stage, close, and return normally.
    """
    _setup_device(sc)
    conn = make_connector(sc, rank, port)
    out: dict = {"rank": rank}
    try:
        conn.init_afd_connector()
        if conn.role == "ffn":
            ffn_step(conn, sc)
            t0 = time.monotonic()
            try:
                ffn_step(conn, sc)
            except Exception as e:  # noqa: BLE001
                out["error"] = (type(e).__name__, str(e))
            out["elapsed"] = time.monotonic() - t0
            return out
        attention_step(conn, sc, 0, sc.steps[0])
        t0 = time.monotonic()

        def hook(layer, stage, t):
            if rank == victim and layer == 1:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(sc.step_timeout_s * 2.5)
            return t

        try:
            attention_step(conn, sc, 1, sc.steps[1], bad=hook)
        except Exception as e:  # noqa: BLE001
            out["error"] = (type(e).__name__, str(e))
        out["elapsed"] = time.monotonic() - t0
        return out
    finally:
        conn.close()


def _entry(fn, rank, nprocs, args, env, q):
    os.environ.update(env or {})
    try:
        q.put((rank, True, fn(rank, nprocs, *args)))
    except BaseException:  # noqa: BLE001
        q.put((rank, False, traceback.format_exc()))


def run_tolerating_death(fn: Callable, nprocs: int, args: Sequence[Any], *, timeout_s: float,
                         may_die: Sequence[int] = (), per_rank_env: Sequence[dict] | None = None) -> dict:
    """Like ``run_workers`` but ranks in ``may_die`` may exit without reporting.

    Returns:
        ``{rank: result}`` for the ranks that reported, plus ``"exitcodes"``
        (rank -> exit code) and ``"elapsed"`` (seconds until every process ended).

    Raises:
        RuntimeError: a worker raised (its traceback) or a rank not in
            ``may_die`` died without reporting.
        TimeoutError: processes still running at the deadline (all are killed).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    results: dict[int, Any] = {}
    t0 = time.monotonic()
    try:
        for r in range(nprocs):
            env = dict(per_rank_env[r]) if per_rank_env else {}
            p = ctx.Process(target=_entry, args=(fn, r, nprocs, tuple(args), env, q), daemon=True)
            p.start()
            procs.append(p)
        deadline = t0 + timeout_s
        while True:
            try:
                rank, ok, payload = q.get(timeout=0.2)
                if not ok:
                    raise RuntimeError(f"worker rank {rank} failed:\n{payload}")
                results[rank] = payload
            except queue_mod.Empty:
                pass
            if all(not p.is_alive() for p in procs):
                while True:
                    try:
                        rank, ok, payload = q.get(timeout=0.5)
                    except queue_mod.Empty:
                        break
                    if not ok:
                        raise RuntimeError(f"worker rank {rank} failed:\n{payload}")
                    results[rank] = payload
                break
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                raise TimeoutError(f"workers {alive} still running after {timeout_s:.0f} s")
        for r in range(nprocs):
            if r not in results and r not in may_die:
                raise RuntimeError(f"worker rank {r} exited with code {procs[r].exitcode} without reporting")
        out: dict = dict(results)
        out["exitcodes"] = {r: p.exitcode for r, p in enumerate(procs)}
        out["elapsed"] = time.monotonic() - t0
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        q.close()


# ---------------------------------------------------------------------------
# Transport-level strict header check
# ---------------------------------------------------------------------------


@diagnosed
def strict_mismatch_worker(rank: int, nprocs: int, port: int) -> dict:
    """Two gloo transports (FFN rank 0, attention rank 0): the sender claims layer 1, the receiver
    expects layer 0 -> the receiver raises AFDProtocolError naming both sides."""
    from afd_ext import rendezvous as rdzv
    from afd_ext.transport.base import AFDProtocolError, AFDTransportError, MessageTag, PeerMap
    from afd_ext.transport.gloo import GlooTransport
    from afd_ext.transport.strict import StrictTransport

    store = rdzv.connect("127.0.0.1", port, rank, 2, timeout_s=30, num_ffn_ranks=1)
    role = "ffn" if rank == 0 else "attention"
    tr = StrictTransport(GlooTransport(store.store, PeerMap(role, 0, 1, 1), timeout_s=10, init_timeout_s=30))
    try:
        h = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        if role == "attention":
            pending = tr.split_back([h], [0], [3], tag=MessageTag("send_attn_output", "a2f", 1, 1, 0))
            try:
                pending.wait()  # the receiver rejects the header and never takes the data
            except AFDTransportError as e:
                return {"sent": False, "error": type(e).__name__}
            return {"sent": True}
        buf = torch.empty(3, 4)
        try:
            tr.fan_in([buf], [0], [3], tag=MessageTag("recv_attn_output", "a2f", 1, 0, 0))
        except AFDProtocolError as e:
            return {"error": str(e), "field_layer": "'layer'" in str(e)}
        return {"error": None}
    finally:
        tr.close()


def default_steps(A: int, two_stages: bool = True) -> tuple:
    """Uneven counts, zero-token ranks and (optionally) a two-stage step, over consecutive steps."""
    steps = [
        {0: [3 + 2 * a for a in range(A)]},
        {0: [0 if a % 2 else 5 - a % 5 for a in range(A)]},
    ]
    if two_stages:
        steps.append({0: [1 + a % 3 for a in range(A)], 1: [0 if a == 0 else 2 for a in range(A)]})
    steps.append({0: [0] * A})
    return tuple(steps)


__all__ = [
    "Scenario", "make_connector", "make_inputs", "ffn_fn", "scenario_worker", "check_scenario_results",
    "decode_pattern_worker", "check_decode_pattern", "handshake_mismatch_worker", "bad_first_input_worker", "mid_step_failure_worker", "peer_loss_worker",
    "run_tolerating_death", "strict_mismatch_worker", "default_steps", "replace", "field",
]
