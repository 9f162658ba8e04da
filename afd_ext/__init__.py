"""afd_ext: the transport for Attention-FFN Disaggregation (AFD) of LLM inference.

The compiled core (``afd_ext.ops``, torch ops in the ``afd_ext`` namespace)
moves row ranges of tensors between attention ranks and FFN ranks over NCCL;
the Python layer (connector, control plane, topology, factory) drives it once
per step and per (layer, stage). Importing this package loads nothing heavy:
import the submodule you need.
"""

__version__ = "0.1.0"

from ._compat import install_import_check as _install_import_check

# Before any module loads the compiled core: a torch other than the build's is a clear error.
_install_import_check()

from .errors import *  # noqa: E402,F401,F403  (torch-free: ``except afd_ext.AFDError`` works after ``import afd_ext``)
from .errors import __all__ as __all__  # noqa: E402
