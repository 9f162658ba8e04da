"""Every exception the control plane lets out is an AFDError, found by running it (tests/test_errors.py reads
the ``raise`` statements, which cannot see an AttributeError or a ValueError from a race).

Two sources of the unnamed ones: a local ``close()`` that lands between any two lines of a call on another
thread (swept here line by line: every line the call runs is, in turn, the one it is held at while another
thread closes), and bytes from the wire (a fuzz of control messages through both channel kinds). The data
calls' fuzzer (tests/test_fuzz_data_calls.py) fails a case on any exception that is not an AFDError.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from interleave import interleave  # noqa: E402
from test_control_plane import PAIRS, _pair, _payload  # noqa: E402

import afd_ext.control as cp  # noqa: E402
from afd_ext.control import channel as cchannel  # noqa: E402
from afd_ext.errors import AFDError  # noqa: E402
from afd_ext.topology import Topology  # noqa: E402

pytestmark = pytest.mark.timeout(300)
CONTROL = str(Path(cp.__file__).parent)


def _plane(kind: str, role: str, **opts):
    """(a plane of ``role`` over a fresh pair of ``kind``, the pair's ends to close after)."""
    rx, tx = PAIRS[kind](heartbeat_timeout_s=60.0, **opts)  # only the close can end a wait in time
    ch = tx if role == "attention" else rx
    return cp.AFDControlPlane(lambda p: None, Topology(1, 1), role, 0, {0: ch}), (rx, tx)


def _recv(kind):
    plane, ends = _plane(kind, "ffn", idle_s=0.0)
    return plane.recv_dp_metadata_list, plane.close, ends


def _send(kind):
    plane, ends = _plane(kind, "attention")
    return lambda: plane.send_dp_metadata_list(_payload(0, 1)), plane.close, ends


def _send_full(kind):  # the ring is full: the send waits for room
    plane, (rx, tx) = _plane(kind, "attention", slot_bytes=64, nslots=2)
    tx.send(b"a")
    tx.send(b"b")
    return lambda: plane.send_dp_metadata_list(_payload(0, 1)), plane.close, (rx, tx)


def _recv_mid_message(kind):  # the first fragment of a message is in, the rest never comes
    plane, (rx, tx) = _plane(kind, "ffn", idle_s=0.0, slot_bytes=64, nslots=4)
    tx._C.ctrl_shm_put(tx._mm, 1, b"a" * 64, 100)
    return plane.recv_dp_metadata_list, plane.close, (rx, tx)


SCENARIOS = [("recv", "shm", _recv), ("recv", "tcp", _recv), ("send", "shm", _send), ("send", "tcp", _send),
             ("send a full ring", "shm", _send_full), ("recv mid-message", "shm", _recv_mid_message)]


def _lines_run_before_the_close(make, kind) -> list[tuple]:
    """The (code, line) of afd_ext/control that the call runs on its thread before the close, in order."""
    victim, close, ends = make(kind)
    seen: dict = {}
    closing = threading.Event()

    def trace(frame, event, arg):
        if closing.is_set() or not frame.f_code.co_filename.startswith(CONTROL):
            return None
        if event == "line":
            seen.setdefault((frame.f_code, frame.f_lineno), None)
        return trace

    def run():
        sys.settrace(trace)
        try:
            victim()
        except Exception:  # noqa: BLE001 - the sweep looks at every line's outcome
            pass
        finally:
            sys.settrace(None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.3)
    closing.set()
    close()
    t.join(5)
    for end in ends:
        end.close()
    assert not t.is_alive() and seen
    return list(seen)


@pytest.mark.parametrize("name,kind,make", SCENARIOS, ids=[f"{n}-{k}" for n, k, _ in SCENARIOS])
def test_a_close_from_another_thread_at_any_line_of_a_call_ends_it_promptly_with_an_afd_error(
        name, kind, make, monkeypatch):
    monkeypatch.setattr(cchannel, "_SLICE_S", 0.005)  # the loops' later lines come within milliseconds
    lines = _lines_run_before_the_close(make, kind)
    bad = []
    for code, line in lines:
        victim, close, ends = make(kind)
        try:
            got, closed = interleave(victim, (code, line), close, timeout_s=10)
        finally:
            for end in ends:
                end.close()
        where = f"{code.co_name}:{line}"
        if got.error is not None and not isinstance(got.error, AFDError):
            bad.append(f"{where}: {type(got.error).__name__}: {got.error}")
        elif closed.error is not None:
            bad.append(f"{where}: close() raised {type(closed.error).__name__}: {closed.error}")
        elif got.ended_at - got.released_at > 2.0:
            bad.append(f"{where}: the call ended {got.ended_at - got.released_at:.1f} s after the close")
    assert not bad, f"{name} over {kind}, {len(lines)} lines held: " + "; ".join(bad)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_fuzzed_control_messages_give_a_payload_or_an_afd_error(kind):
    """Valid payloads cut, flipped, stretched and the stage count rewritten, sent through a real channel (the
    shm ring in one slot or several): the receiver returns a payload or raises an AFDError, never another."""
    rng = random.Random(41)
    good = [cp.codec.encode_control_binary(_payload(s, rng.randrange(1, 9), rng.randrange(1, 4))) for s in range(8)]
    errors = 0
    with _pair(kind, slot_bytes=64, nslots=8, max_message_bytes=4096) as (rx, tx):
        for i in range(400):
            b = bytearray(rng.choice(good))
            for _ in range(rng.randrange(1, 4)):
                op = rng.randrange(4)
                if op == 0:
                    b[rng.randrange(len(b))] = rng.randrange(256)
                elif op == 1:
                    del b[rng.randrange(len(b)):rng.randrange(len(b) + 1)]
                elif op == 2:
                    b[rng.randrange(len(b) + 1):rng.randrange(len(b) + 1)] = rng.randbytes(rng.randrange(80))
                elif len(b) >= 8:
                    b[6:8] = rng.randbytes(2)
            tx.send(bytes(b))
            try:
                rx.recv(5.0, max_payload=rng.choice([64, 4096]))
            except AFDError:
                errors += 1
            except Exception as e:  # noqa: BLE001 - the failure this test exists for
                pytest.fail(f"case {i}: {type(e).__name__} (not an AFDError) for {bytes(b)!r}: {e}")
    assert errors > 100
