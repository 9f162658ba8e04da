"""How AFD processes meet (docs/internals.md, "rendezvous/"): :mod:`.store` is the store client, the abort signal
and the waits; :mod:`.join` is :func:`connect` and who may join. The names below are the public import path."""

from ..errors import (AFDConfigError, DuplicateRankError, HandshakeMismatchError, JobMismatchError,  # noqa: F401
                      PeerClosedError, RendezvousError, RendezvousTimeoutError, StepAbortedError, StoreTimeoutError,
                      StoreUnavailableError)
from ..topology import rank_label  # noqa: F401
from .join import connect  # noqa: F401
from ..health.abort import (ABORT_READ_WAIT_S, POST_ABORT_WAIT_S, AbortSignal, check_abort, post_abort,  # noqa: F401
                            raise_if_aborted)
from .store import (DEFAULT_RENDEZVOUS_TIMEOUT_S, AFDStore, WaitReport, barrier, error_text,  # noqa: F401
                    exchange_unique_id, forget_cached_stores, handshake, host_identity, process_group_error,
                    wait_for_keys, wait_log_interval_s)
