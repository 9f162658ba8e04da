"""Helpers of the fault tests: a rendezvous store host that can be frozen, a bounded call.

``StoreHost`` runs FFN rank 0's side of :func:`afd_ext.rendezvous.connect`
(the ``TCPStore`` server) in a child process, so a test can stop it with
SIGSTOP (a frozen host: the socket stays open, nothing answers) and resume or
kill it. ``timed`` runs a call on a thread and gives up after a bound, so a
regression (an unbounded wait) fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

_HOST_CODE = """
import sys, time
from afd_ext import rendezvous as rdzv
rdzv.connect(sys.argv[1], int(sys.argv[2]), 0, int(sys.argv[3]), 60.0, num_ffn_ranks=1)
print("ready", flush=True)
time.sleep(3600)
"""


class StoreHost:
    """FFN rank 0's rendezvous store in a child process (world size ``world_size``, F = 1)."""

    def __init__(self, port: int, world_size: int = 2, host: str = "127.0.0.1", env: dict | None = None):
        e = dict(os.environ)
        e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
        e.update(env or {})
        self.port = port
        self.proc = subprocess.Popen([sys.executable, "-c", _HOST_CODE, host, str(port), str(world_size)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=e)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"store host did not start (exit code {self.proc.poll()})")

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


def timed(fn: Callable[[], Any], limit_s: float) -> tuple[float, Any, BaseException | None]:
    """Run ``fn`` on a thread; return (seconds taken, result, exception). Fails past ``limit_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
        box["took"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still blocked after {limit_s:g} s (an unbounded wait)"
    return box["took"], box.get("result"), box.get("error")
