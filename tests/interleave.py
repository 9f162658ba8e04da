"""Forced interleavings for race tests: hold one thread at a chosen source line while another acts.

A close race (a ``close()`` on one thread while another is between two lines of a call) is found by
reading and lost by timing. This helper makes it deterministic: a line trace stops the victim thread
just before it runs the chosen line, the test acts (``close()``, a send, a peer's exit), then the
victim is released and its outcome checked. Every wait is bounded, so a regression fails the test
instead of hanging it.

The line is named by the function it is in and a piece of its text (found once in the function's
source, so the test survives edits above it)::

    from interleave import interleave

    victim, closer = interleave(lambda: plane.recv_dp_metadata_list(),
                                (AFDControlPlane.recv_dp_metadata_list, "self._require_open("),
                                plane.close)
    assert isinstance(victim.error, AFDError), victim.error

:func:`interleave` runs the victim and the action on threads of their own, so an action that waits
for the held thread (a close that waits for in-flight callers) is not a deadlock: after ``settle_s``
the victim is released anyway. :class:`LineHold` is the lower-level piece, for a victim thread the
test does not start itself (any thread started inside its ``with`` block is traced; the first to
reach the line is held).
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass
from types import CodeType
from typing import Any, Callable


def _resolve(func: Any, text: str | int) -> tuple[CodeType, int]:
    """The code object of ``func`` and the number of its one line containing ``text`` (or numbered ``text``)."""
    func = inspect.unwrap(func)
    code = func if isinstance(func, CodeType) else getattr(func, "__code__", None)
    if code is None:
        raise TypeError(f"interleave: {func!r} has no code object (pass a Python function or method)")
    lines, first = inspect.getsourcelines(code)
    if isinstance(text, int):
        hits = [text] if first <= text < first + len(lines) else []
    else:
        hits = [first + i for i, s in enumerate(lines) if text in s]
    if len(hits) != 1:
        raise ValueError(f"interleave: {text!r} is on {len(hits)} lines of {code.co_name} "
                         f"({code.co_filename}:{first}); name exactly one")
    return code, hits[0]


class LineHold:
    """Hold the first traced thread that is about to run one line, until :meth:`release`.

    Use as a context manager: threads started inside the ``with`` block are traced (``threading.settrace``;
    the thread that entered is not). The held thread waits at most ``timeout_s`` seconds, then goes on
    and :attr:`timed_out` is set (so a test whose release never comes fails, not hangs). Leaving the
    block releases it.

    Args:
        func: the function (or method, code object) that holds the line.
        text: a piece of the line's source text, found on exactly one line of ``func``; or its line number.
        timeout_s: bound on every wait here, in seconds.

    Raises:
        ValueError: ``text`` is on no line, or several, of ``func``.
    """

    def __init__(self, func: Any, text: str | int, *, timeout_s: float = 5.0):
        self.code, self.lineno = _resolve(func, text)
        self.where = f"{self.code.co_name} line {self.lineno} ({text!r})"
        self.timeout_s = timeout_s
        self.timed_out = False
        self.thread: threading.Thread | None = None  # the held thread, once reached
        self._reached = threading.Event()
        self._go = threading.Event()
        self._claim = threading.Lock()

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == self.lineno and not self._reached.is_set() \
                and self._claim.acquire(blocking=False):
            self.thread = threading.current_thread()
            self._reached.set()
            if not self._go.wait(self.timeout_s):
                self.timed_out = True
            return None  # held once: this frame runs untraced from here
        return self._local

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        return self._local if frame.f_code is self.code and not self._reached.is_set() else None

    def __enter__(self) -> "LineHold":
        threading.settrace(self._trace)
        return self

    def __exit__(self, *exc: Any) -> None:
        threading.settrace(None)  # type: ignore[arg-type]
        self.release()

    def wait_reached(self, timeout_s: float | None = None) -> None:
        """Wait until a thread is held at the line.

        Raises:
            AssertionError: no traced thread reached it within ``timeout_s`` (default: the hold's).
        """
        if not self._reached.wait(self.timeout_s if timeout_s is None else timeout_s):
            raise AssertionError(f"no thread reached {self.where} within {self.timeout_s:g} s")

    def release(self) -> None:
        """Let the held thread (or the one that comes) run on."""
        self._go.set()


@dataclass
class Outcome:
    """How one thread's call ended: ``value`` returned or ``error`` raised, and when (monotonic s)."""

    value: Any = None
    error: BaseException | None = None
    ended_at: float | None = None  # None: still running when the helper gave up on it
    released_at: float | None = None  # the victim's: when :func:`interleave` released it


def _run(fn: Callable[[], Any], out: Outcome) -> None:
    try:
        out.value = fn()
    except BaseException as e:  # noqa: BLE001 - the test looks at it
        out.error = e
    out.ended_at = time.monotonic()


def interleave(victim: Callable[[], Any], at: tuple[Any, str], action: Callable[[], Any], *,
               timeout_s: float = 5.0, settle_s: float = 0.3) -> tuple[Outcome, Outcome]:
    """Run ``victim`` on a thread, hold it just before the line ``at``, run ``action`` on another thread,
    then release the victim and wait for both.

    The victim is released when the action returns, or after ``settle_s`` seconds if it has not (an action
    that waits for the held thread). Both threads are daemons: one still running after ``timeout_s``
    fails the test and is left behind rather than hanging it.

    Args:
        victim: the call whose interleaving is forced (no arguments; use a lambda).
        at: ``(function, text)``: the line, as for :class:`LineHold`.
        action: what another thread does meanwhile (e.g. ``channel.close``).
        timeout_s: bound, in seconds, on reaching the line and on each thread's end.
        settle_s: how long the action may run, in seconds, before the victim is released anyway.

    Returns:
        ``(victim's Outcome, action's Outcome)``; the victim's ``released_at`` is when it was let go
        (its ``ended_at`` minus that: how promptly it ended).

    Raises:
        AssertionError: the victim never reached the line, its hold timed out, or a thread was
            still running ``timeout_s`` after the release.
    """
    vout, aout = Outcome(), Outcome()
    with LineHold(*at, timeout_s=timeout_s) as hold:
        vt = threading.Thread(target=_run, args=(victim, vout), name="interleave-victim", daemon=True)
        vt.start()
        try:
            hold.wait_reached()
        except AssertionError:
            vt.join(timeout_s)
            raise AssertionError(f"{hold.where} was never reached; the victim ended with {vout!r}") from None
        act = threading.Thread(target=_run, args=(action, aout), name="interleave-action", daemon=True)
        act.start()  # traced too, but the hold is spent: it runs through
        act.join(settle_s)
        vout.released_at = time.monotonic()
        hold.release()
    for t, who in ((vt, "victim"), (act, "action")):
        t.join(max(0.0, vout.released_at + timeout_s - time.monotonic()))
        if t.is_alive():
            raise AssertionError(f"the {who} was still running {timeout_s:g} s after the release at {hold.where}")
    if hold.timed_out:
        raise AssertionError(f"the hold at {hold.where} timed out before the release")
    return vout, aout


__all__ = ["LineHold", "Outcome", "interleave"]
