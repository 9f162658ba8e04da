"""How AFD processes meet (docs/internals.md, "rendezvous/"): :mod:`.store` is the store client, the abort signal
and the waits; :mod:`.join` is :func:`connect` and who may join. The names below are the public import path."""

from ..errors import (AFDConfigError, DuplicateRankError, HandshakeMismatchError, JobMismatchError,  # noqa: F401
                      PeerClosedError, RendezvousError, RendezvousTimeoutError, StepAbortedError, StoreTimeoutError,
                      StoreUnavailableError)
from ..topology import rank_label  # noqa: F401
from .join import connect  # noqa: F401
from .store import (ABORT_READ_WAIT_S, DEFAULT_RENDEZVOUS_TIMEOUT_S, POST_ABORT_WAIT_S, AbortSignal,  # noqa: F401
                    AFDStore, WaitReport, barrier, check_abort, error_text, exchange_unique_id, forget_cached_stores,
                    handshake, host_identity, post_abort, process_group_error, raise_if_aborted, wait_for_keys,
                    wait_log_interval_s)
