"""Refuse to load the compiled core under a torch it cannot run with.

``afd_ext._C`` is built on torch's stable ABI (``STABLE_ABI`` in the record: it
loads under that torch and every later one) and needs, when it has CUDA kernels,
a torch of the same CUDA major (``libcudart``). A build without that record (an
older, non-stable build) used torch's C++ ABI, which torch does not keep between
releases: loaded under another torch it ends in a raw ``ImportError`` (an
undefined symbol) or worse, so it must meet the very torch it was built against.
``setup.py`` records the build's torch in the
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
        ``{"torch": "2.14.1+cu130", "torch_cuda": "13.0" or None}``, plus for a stable-ABI build
        ``"stable_abi": "2.11"`` (the oldest torch it loads under) and ``"core_cuda"`` ("13.0", or
        None for a core without CUDA kernels).
    """
    try:
        rec = importlib.import_module(f"{_PKG}._built_with")
    except ImportError:
        return None
    out = {"torch": rec.TORCH_VERSION, "torch_cuda": rec.TORCH_CUDA}
    if getattr(rec, "STABLE_ABI", None):
        out.update(stable_abi=rec.STABLE_ABI, core_cuda=rec.CORE_CUDA)
    return out


def rebuild_command() -> str:
    """The command that rebuilds the compiled core against the torch installed now."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "setup.py")):  # a source checkout (editable install)
        return f"pip install --no-build-isolation -e {root}"
    return "pip install --no-build-isolation --force-reinstall --no-deps <afd_ext source tree or sdist>"


def check_torch() -> None:
    """Raise unless the compiled core can run under the torch imported now.

    A stable-ABI build: that torch is at least ``STABLE_ABI`` and, for a core with
    CUDA kernels, a CUDA build of the same CUDA major. Any other build: that torch
    is the one it was built against (``torch.__version__`` and ``torch.version.cuda``).
    Without a record (an older build) there is nothing to compare.

    Raises:
        afd_ext.errors.TorchMismatchError: (an ``ImportError``) naming both torch
            versions and the rebuild command.
    """
    rec = built_with()
    if rec is None:
        return
    import torch

    now = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    from .errors import TorchMismatchError

    def show(d: dict) -> str:
        return d["torch"] + (f" (CUDA {d['torch_cuda']})" if d["torch_cuda"] else " (CPU build)")

    if "stable_abi" in rec:
        cuda = rec["core_cuda"]
        if torch.torch_version.TorchVersion(torch.__version__) < rec["stable_abi"]:
            why = f"needs torch >= {rec['stable_abi']}"
        elif cuda and (now["torch_cuda"] or "").split(".")[0] != cuda.split(".")[0]:
            why = f"has CUDA {cuda} kernels and needs a torch built for CUDA {cuda.split('.')[0]}.x"
        else:
            return
        raise TorchMismatchError(
            f"afd_ext's compiled core (torch's stable ABI, built against torch {show(rec)}) {why}, but torch "
            f"{show(now)} is installed; install such a torch, or rebuild afd_ext: {rebuild_command()}",
            built=rec["torch"], installed=now["torch"])
    if now == {"torch": rec["torch"], "torch_cuda": rec["torch_cuda"]}:
        return

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
