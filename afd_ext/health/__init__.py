"""Failure handling in one home (docs/internals.md, "health/"): :mod:`.abort` the step-abort signal,
:mod:`.watchdog` the deadlines (the rank's health thread, bounded host waits, call threads), :mod:`.stall`
which peer stalled, :mod:`.links` what a raw link error means. Transports expose polls of their own state."""

from .abort import (ABORT_READ_WAIT_S, POST_ABORT_WAIT_S, AbortSignal, check_abort, post_abort,  # noqa: F401
                    raise_if_aborted)
from .links import error_text, link_error  # noqa: F401
from .stall import StallReports  # noqa: F401
from .watchdog import CallThread, TrackedOp, Watchdog, host_wait, join_all, leave, spawn, still_running  # noqa: F401
