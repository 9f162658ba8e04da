"""The forced-interleaving helper (tests/interleave.py) holds, releases and bounds as it says."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from interleave import LineHold, interleave  # noqa: E402


def _two_steps(log: list) -> str:
    log.append("first")
    log.append("second")
    return "done"


def test_the_victim_waits_at_the_line_while_the_action_runs_then_goes_on():
    log: list = []
    victim, action = interleave(lambda: _two_steps(log), (_two_steps, '"second"'), lambda: log.append("action"))
    assert log == ["first", "action", "second"]
    assert victim.value == "done" and victim.error is None and action.error is None
    assert victim.ended_at >= victim.released_at


def test_an_action_that_waits_for_the_held_thread_is_not_a_deadlock():
    log: list = []
    t0 = time.monotonic()
    victim, action = interleave(lambda: _two_steps(log), (_two_steps, '"second"'),
                                lambda: time.sleep(0.1) or log.count("second"), settle_s=0.05)
    assert victim.value == "done" and time.monotonic() - t0 < 2


def test_a_line_never_reached_fails_fast_and_a_bad_location_is_refused():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="never reached"):
        interleave(lambda: None, (_two_steps, '"second"'), lambda: None, timeout_s=0.3)
    assert time.monotonic() - t0 < 2
    with pytest.raises(ValueError, match="on 2 lines"):
        LineHold(_two_steps, "log.append")
