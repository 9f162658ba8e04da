"""Import path kept for callers: the control plane lives in :mod:`afd_ext.control`."""

from __future__ import annotations

from typing import Any

from afd_ext.control import *  # noqa: F401,F403
from afd_ext.control import __all__  # noqa: F401


def __getattr__(name: str) -> Any:
    # The measurement moved to the bench (afd_ext.bench.control); the old name still resolves.
    if name == "measure_control_plane":
        from afd_ext.bench.control import measure_control_plane

        return measure_control_plane
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
