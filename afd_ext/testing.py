"""The harness's public import path (``run_workers``, ``find_free_port``, ...): :mod:`afd_ext.tools.testing`."""
from afd_ext.tools.testing import *  # noqa: F401,F403
