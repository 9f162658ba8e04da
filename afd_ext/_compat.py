"""Refuse to load the compiled core under a torch other than the one it was built against.

``afd_ext._C`` links against the libraries of the torch it was compiled with
(``libc10.so``, ``libc10_cuda.so``, ``libtorch*.so``) and uses their C++ ABI,
which torch does not keep between releases: loaded under another torch it
ends in a raw ``ImportError`` (``libc10_cuda.so: cannot open shared object
file``, an undefined symbol) or worse. ``setup.py`` records that torch in the
generated module ``afd_ext/_built_with.py``; :func:`check_torch` compares it
with the torch imported now, and the import hook installed by
``afd_ext/__init__.py`` runs it before the library is loaded, whichever module
imports ``afd_ext._C``. Torch-free until the check runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys

_PKG = __package__ or "afd_ext"
_CORE = f"{_PKG}._C"


def built_with() -> dict | None:
    """The torch the compiled core was built against, or None (a build older than the record).

    Returns:
        ``{"torch": "2.14.1+cu130", "torch_cuda": "13.0" or None}``.
    """
    try:
        rec = importlib.import_module(f"{_PKG}._built_with")
    except ImportError:
        return None
    return {"torch": rec.TORCH_VERSION, "torch_cuda": rec.TORCH_CUDA}


def rebuild_command() -> str:
    """The command that rebuilds the compiled core against the torch installed now."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "setup.py")):  # a source checkout (editable install)
        return f"pip install --no-build-isolation -e {root}"
    return "pip install --no-build-isolation --force-reinstall --no-deps <afd_ext source tree or sdist>"


def check_torch() -> None:
    """Raise unless the torch imported now is the one the compiled core was built against.

    Compares ``torch.__version__`` and ``torch.version.cuda`` with the build's
    record; without a record (an older build) there is nothing to compare.

    Raises:
        afd_ext.errors.TorchMismatchError: (an ``ImportError``) naming both torch
            versions and the rebuild command.
    """
    rec = built_with()
    if rec is None:
        return
    import torch

    now = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if now == rec:
        return
    from .errors import TorchMismatchError

    def show(d: dict) -> str:
        return d["torch"] + (f" (CUDA {d['torch_cuda']})" if d["torch_cuda"] else " (CPU build)")

    raise TorchMismatchError(
        f"afd_ext's compiled core was built against torch {show(rec)} but torch {show(now)} is installed; "
        f"its C++ ABI is tied to the torch it was built with. Rebuild afd_ext against this torch: "
        f"{rebuild_command()} (or install torch=={rec['torch']})", built=rec["torch"], installed=now["torch"])


class _CoreImportCheck(importlib.abc.MetaPathFinder):
    """Runs :func:`check_torch` when ``afd_ext._C`` is about to be found, then lets the normal finders load it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == _CORE:
            check_torch()
        return None


def install_import_check() -> None:
    """Put the check in front of every import of the compiled core (idempotent)."""
    if not any(isinstance(f, _CoreImportCheck) for f in sys.meta_path):
        sys.meta_path.insert(0, _CoreImportCheck())
