"""Failure handling in one place (docs/internals.md, "Errors and resynchronisation"): :mod:`.abort` is the
step-abort signal, :mod:`.watchdog` the deadlines (the per-rank health thread, bounded host waits, call
threads), :mod:`.stall` which peer stalled. Transports expose polls of their own state to the watchdog."""

from .abort import (ABORT_READ_WAIT_S, POST_ABORT_WAIT_S, AbortSignal, check_abort, post_abort,  # noqa: F401
                    raise_if_aborted)
from .stall import StallReports  # noqa: F401
from .watchdog import CallThread, TrackedOp, Watchdog, host_wait  # noqa: F401
