"""Deadlines, progress lines and crash/hang forensics for multi-process benchmarks.

A hung NCCL call cannot be interrupted from Python (our ops hold the GIL
while NCCL blocks on the host, e.g. in the first connection set-up), so the
benchmarks rely on process isolation instead:

* worker side, :class:`WorkerGuard`: ``faulthandler`` is enabled at start (a
  segfault prints every thread's stack), and every *phase* (set-up step,
  warm-up of one variant, capture, timed block, barrier) re-arms
  ``faulthandler.dump_traceback_later(deadline, exit=True)``: a phase that
  overruns its deadline prints every thread's stack and ends the process
  (exit code 1) from faulthandler's C thread, which runs even when the GIL is
  held. Before the phase starts, its description (case, variant, mode,
  direction, op) is written atomically to ``<parts>/rank<R>.phase.json``;
  finished units of work are appended to ``<parts>/rank<R>.parts.jsonl``.
  Progress lines go to stdout, flushed.
* parent side, :func:`diagnose`: after a failed run it reads those files and
  names the failure, e.g. ``variant bare, case h7168-t128+x, mode eager,
  round_trip hung in warm-up (attn_round) on ffn rank 0 (world rank 0)``.
  The runner then restarts fresh processes (fresh communicators) without the
  failed variant, so one bad variant costs one deadline, not the sweep.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from typing import Any, Sequence

from afd_ext.errors import AFDConfigError

__all__ = ["WorkerGuard", "read_phases", "read_parts", "diagnose", "HARD_GRACE_S"]

#: Seconds the hard (faulthandler) deadline of a phase lies beyond its soft
#: deadline, so in-process timeouts (which name the op) fire first when they can.
HARD_GRACE_S = 15.0


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class WorkerGuard:
    """One worker's phase tracker: progress lines, phase file, faulthandler deadline.

    Args:
        rank: world rank of this process.
        label: how lines name this process, e.g. ``"attention0"``.
        parts_dir: directory for the phase and parts files (``""``: no files).
        timeout_s: soft deadline of one phase in seconds (> 0); the hard
            faulthandler deadline is ``timeout_s + HARD_GRACE_S``.
        verbose: print progress lines (:meth:`say`, and one when a phase
            starts and ends); otherwise the guard is silent but still records
            phases and arms deadlines.
        t0: ``time.monotonic()`` origin of the printed elapsed times.
        grace_s: seconds between a phase's soft and hard deadline
            (default :data:`HARD_GRACE_S`).

    Raises:
        AFDConfigError: ``timeout_s`` is not positive.
    """

    def __init__(self, rank: int, label: str, parts_dir: str, timeout_s: float, *, verbose: bool = True,
                 t0: float | None = None, grace_s: float = HARD_GRACE_S):
        if not timeout_s > 0:
            raise AFDConfigError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.rank = rank
        self.label = label
        self.parts_dir = parts_dir
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.verbose = verbose
        self.t0 = time.monotonic() if t0 is None else t0
        self.phase: dict[str, Any] = {}
        self._phase_t = self.t0
        faulthandler.enable(file=sys.stderr, all_threads=True)
        if parts_dir:
            os.makedirs(parts_dir, exist_ok=True)

    # -- output ------------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since ``t0``."""
        return time.monotonic() - self.t0

    def say(self, msg: str) -> None:
        """One progress line on stdout, flushed: ``[bench +12.3s attention0] msg`` (only when ``verbose``)."""
        if not self.verbose:
            return
        # One write per line: with PYTHONUNBUFFERED, print() writes the text and the
        # newline separately and two workers' lines ran together.
        sys.stdout.write(f"[bench +{self.elapsed():7.1f}s {self.label}] {msg}\n")
        sys.stdout.flush()

    # -- phases ------------------------------------------------------------------

    @staticmethod
    def describe(phase: dict[str, Any]) -> str:
        """Human words for a phase dict (what, case, variant, mode, direction, op)."""
        parts = [phase.get("what", "?")]
        if phase.get("variant"):
            parts.append(f"variant {phase['variant']}" + (f"/{phase['direction']}" if phase.get("direction") else ""))
        if phase.get("case"):
            parts.append(f"case {phase['case']}")
        if phase.get("mode"):
            parts.append(f"mode {phase['mode']}")
        if phase.get("op"):
            parts.append(f"[{phase['op']}]")
        return " ".join(parts)

    def enter(self, what: str, *, timeout_s: float | None = None, quiet: bool = False, **fields: Any) -> None:
        """Start a phase: record it, print it (unless ``quiet``), arm its deadline.

        Args:
            what: the phase, e.g. ``"warm-up"``, ``"capture"``, ``"timed block"``.
            timeout_s: this phase's soft deadline (default: the guard's).
            quiet: no "start" line (the phase is still recorded and guarded).
            **fields: ``case``, ``variant``, ``mode``, ``direction``, ``op`` (str).
        """
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        now = time.monotonic()
        self.phase = {"what": what, "rank": self.rank, "label": self.label, "pid": os.getpid(),
                      "started_s": round(now - self.t0, 3), "timeout_s": t, "hard_timeout_s": t + self.grace_s,
                      "wall_start": time.time(), **{k: v for k, v in fields.items() if v is not None}}
        self._phase_t = now
        if self.parts_dir:
            _write_atomic(os.path.join(self.parts_dir, f"rank{self.rank}.phase.json"), json.dumps(self.phase))
        faulthandler.dump_traceback_later(t + self.grace_s, repeat=False, file=sys.stderr, exit=True)
        if self.verbose and not quiet:
            self.say(f"start {self.describe(self.phase)}")

    def on_peers(self) -> None:
        """From here the current phase waits on peers (its exchanges start): its hard deadline moves one grace later.

        A rank blocked on a peer stuck before its exchanges would otherwise
        overrun the same deadline as the stuck rank and might be ended first
        (under load, by a phase entered a moment earlier): then the stuck rank's
        stack is never dumped and the waiter is named. Recorded in the phase
        file, so :func:`diagnose` blames the stuck peer even when the waiter
        ended first (an in-process soft timeout).
        """
        if not self.phase:
            return
        self.phase["on_peers"] = True
        self.phase["hard_timeout_s"] += self.grace_s
        elapsed = time.monotonic() - self._phase_t
        faulthandler.dump_traceback_later(max(0.0, self.phase["hard_timeout_s"] - elapsed), repeat=False,
                                          file=sys.stderr, exit=True)
        if self.parts_dir:
            _write_atomic(os.path.join(self.parts_dir, f"rank{self.rank}.phase.json"), json.dumps(self.phase))

    def leave(self, *, quiet: bool = False, note: str = "") -> float:
        """End the current phase; prints "done ... in X s" unless ``quiet``. Returns its seconds."""
        dt = time.monotonic() - self._phase_t
        if self.verbose and not quiet and self.phase:
            p = self.phase
            short = p.get("what", "?") + (f" {p['variant']}/{p.get('direction', '')}" if p.get("variant") else "")
            self.say(f"done  {short} in {dt:.2f} s{note}")
        return dt

    def disarm(self) -> None:
        """Cancel the faulthandler deadline (end of the worker) and mark the phase file finished."""
        faulthandler.cancel_dump_traceback_later()
        self.phase = {"what": "finished", "rank": self.rank, "label": self.label}
        if self.parts_dir:
            _write_atomic(os.path.join(self.parts_dir, f"rank{self.rank}.phase.json"), json.dumps(self.phase))

    # -- results -----------------------------------------------------------------

    def save_part(self, part: dict[str, Any]) -> None:
        """Append one finished unit of work (a JSON-able dict) to this rank's parts file."""
        if not self.parts_dir:
            return
        with open(os.path.join(self.parts_dir, f"rank{self.rank}.parts.jsonl"), "a") as f:
            f.write(json.dumps(part) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_phases(parts_dir: str, nprocs: int) -> list[dict | None]:
    """Each rank's last phase (None where the file is missing or unreadable)."""
    out: list[dict | None] = []
    for r in range(nprocs):
        try:
            with open(os.path.join(parts_dir, f"rank{r}.phase.json")) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            out.append(None)
    return out


def read_parts(parts_dir: str, nprocs: int) -> list[list[dict]]:
    """Each rank's saved parts, in order (a torn last line is dropped)."""
    out: list[list[dict]] = []
    for r in range(nprocs):
        parts: list[dict] = []
        try:
            with open(os.path.join(parts_dir, f"rank{r}.parts.jsonl")) as f:
                for line in f:
                    try:
                        parts.append(json.loads(line))
                    except ValueError:
                        break
        except OSError:
            pass
        out.append(parts)
    return out


def _exit_code(exc: BaseException) -> int | None:
    msg = str(exc)
    marker = "exit code "
    if marker in msg:
        tail = msg.split(marker, 1)[1].split()[0]
        try:
            return int(tail)
        except ValueError:
            return None
    return None


def diagnose(exc: BaseException, phases: Sequence[dict | None], now_wall: float | None = None) -> dict:
    """Name a failed multi-process run from its exception and the ranks' last phases.

    Args:
        exc: what :func:`afd_ext.testing.run_workers` raised (``WorkerError``,
            ``TimeoutError`` or ``RuntimeError`` for a silent death).
        phases: :func:`read_phases` output.
        now_wall: ``time.time()`` now (tests pass a fixed value).

    Returns:
        ``{"kind": "hung"|"crashed"|"failed"|"timeout", "rank", "label", "phase",
        "variant", "case", "mode", "direction", "message"}``: ``rank``/``phase``
        are the culprit's (the rank that raised or died, unless it was waiting
        on a peer that never reached the phase's exchanges (:meth:`WorkerGuard.on_peers`):
        then that peer, ``hung`` once past its hard deadline; else the rank
        whose phase overran its deadline the most, else the oldest phase).
    """
    from afd_ext.testing import WorkerError

    now = time.time() if now_wall is None else now_wall
    live = [p for p in phases if p and p.get("what") != "finished"]
    culprit: dict | None = None
    kind = "failed"
    detail = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    if isinstance(exc, WorkerError):
        culprit = next((p for p in live if p.get("rank") == exc.rank), None)
        kind = "hung" if "TimeoutError" in exc.traceback or "timed out" in exc.traceback.lower() else "failed"
        detail = exc.traceback.strip().splitlines()[-1] if exc.traceback.strip() else detail
    else:
        code = _exit_code(exc)
        m = str(exc)
        if code is not None and "worker rank " in m:
            try:
                r = int(m.split("worker rank ", 1)[1].split()[0])
            except ValueError:
                r = -1
            culprit = next((p for p in live if p.get("rank") == r), None)
            if code < 0:
                import signal

                try:
                    sig = signal.Signals(-code).name
                except ValueError:
                    sig = f"signal {-code}"
                kind, detail = "crashed", f"died with {sig}"
            elif culprit and now - culprit.get("wall_start", now) >= culprit.get("hard_timeout_s", 1e18) - 1.0:
                kind, detail = "hung", (f"overran its {culprit.get('timeout_s', 0):.0f} s deadline "
                                        "(faulthandler dumped the stacks above and ended it)")
            else:
                kind, detail = "crashed", f"exited with code {code} without reporting"
        elif isinstance(exc, TimeoutError):
            kind = "timeout"
    if culprit is not None and culprit.get("on_peers"):
        # The culprit was waiting on its peers: a peer in the same phase that never reached its
        # exchanges is the cause (the waiter's timeout or lost connection is the consequence).
        same = ("what", "case", "variant", "mode", "direction")
        stuck = [p for p in live if p is not culprit and not p.get("on_peers")
                 and all(p.get(k) == culprit.get(k) for k in same)]
        if stuck:
            waiter, culprit = culprit, stuck[0]
            if now - culprit.get("wall_start", now) >= culprit.get("hard_timeout_s", 1e18) - 1.0:
                kind = "hung"
            detail = (f"never reached its exchanges; {waiter.get('label')}, waiting on it, ended with: {detail}")
    if culprit is None and live:
        # The rank stuck longest relative to its deadline.
        culprit = max(live, key=lambda p: (now - p.get("wall_start", now)) / max(1.0, p.get("timeout_s", 1.0)))
        if kind in ("timeout", "failed") and now - culprit.get("wall_start", now) > culprit.get("timeout_s", 1e18):
            kind = "hung"
    out = {"kind": kind, "rank": None, "label": None, "phase": None, "variant": None, "case": None,
           "mode": None, "direction": None, "op": None}
    if culprit:
        out.update({"rank": culprit.get("rank"), "label": culprit.get("label"), "phase": culprit.get("what"),
                    "variant": culprit.get("variant"), "case": culprit.get("case"), "mode": culprit.get("mode"),
                    "direction": culprit.get("direction"), "op": culprit.get("op")})
        where = WorkerGuard.describe(culprit)
        out["message"] = (f"{kind}: {where} on {culprit.get('label')} (world rank {culprit.get('rank')}): {detail}")
    else:
        out["message"] = f"{kind}: no phase recorded (failed before the first phase): {detail}"
    others = [f"{p.get('label')}: {WorkerGuard.describe(p)}" for p in live if p is not culprit]
    if others:
        out["message"] += "; other ranks were at: " + "; ".join(others)
    return out
