"""Whether a process still runs, told apart from a later process that reuses its pid."""

from __future__ import annotations


def start_time(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot, ``/proc/<pid>/stat``); None when it runs no more.

    A killed process its parent has not reaped yet (state Z or X) runs no more: a supervisor that
    restarts a rank before reaping the old process must not find the rank held by the corpse.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return None if rest[0] in (b"Z", b"X", b"x") else int(rest[19])
    except (OSError, IndexError, ValueError):
        return None
