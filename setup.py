"""Build of afd_ext._C, the compiled core, against the installed torch.

Install with ``pip install --no-build-isolation -e .`` so the torch already in
the environment is the one compiled against.

CUDA sources are compiled when torch is a CUDA build (``torch.version.cuda``)
and a CUDA toolkit is found (``CUDA_HOME``/``CUDA_PATH``, else
``/usr/local/cuda``); whether a GPU is visible plays no part. Environment:

* ``AFD_USE_CUDA=0|1``: force a CPU-only build, or require a CUDA build (error if impossible).
* ``TORCH_CUDA_ARCH_LIST``: GPU architectures, default ``9.0`` (H100/H200).
* ``MAX_JOBS``: parallel compile jobs for ninja (torch's default is every core).

NCCL headers and ``libnccl.so.2`` come from the ``nvidia-nccl-cu*`` wheel that
torch itself loads, linked with an rpath to that wheel's ``lib/``.

The source list is ``csrc/sources.txt``, shared with ``CMakeLists.txt``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCH_LIST = "9.0"
# TORCH_TARGET_VERSION of the stable ABI: torch 2.11 (major << 56 | minor << 48).
STABLE_TARGET = "0x020b000000000000"


def read_sources(path: Path = ROOT / "csrc" / "sources.txt") -> dict[str, list[str]]:
    """Parse ``csrc/sources.txt`` into ``{section: [paths relative to the repo root]}``."""
    sections: dict[str, list[str]] = {}
    current = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
        elif current is None:
            raise SystemExit(f"{path}:{lineno}: source {line!r} before any [section]")
        else:
            sections[current].append(line)
    for name in ("cpu", "cuda", "no_cuda"):
        sections.setdefault(name, [])
    return sections


def find_cuda_home() -> str | None:
    """The CUDA toolkit root: CUDA_HOME/CUDA_PATH, else /usr/local/cuda; None if absent.

    `nvcc` on PATH is deliberately not consulted: a wrapper script there would
    send torch.utils.cpp_extension to the wrong root.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if not Path(home, "bin", "nvcc").exists():
                raise SystemExit(f"{var}={home} has no bin/nvcc; point it at a CUDA toolkit")
            return home
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    return None


def find_nccl() -> tuple[str, str]:
    """(include dir, lib dir) of the nvidia-nccl-cu* wheel (the NCCL torch loads)."""
    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "afd_ext: CUDA build needs the nvidia-nccl-cu* wheel that torch uses "
            "(module nvidia.nccl not found); `pip install nvidia-nccl-cu13` (or -cu12, matching "
            "torch.version.cuda), or build CPU-only with AFD_USE_CUDA=0"
        )
    for root in spec.submodule_search_locations:
        inc, lib = Path(root, "include"), Path(root, "lib")
        if (inc / "nccl.h").exists() and (lib / "libnccl.so.2").exists():
            return str(inc), str(lib)
    raise SystemExit(
        f"afd_ext: nvidia.nccl at {list(spec.submodule_search_locations)} lacks include/nccl.h "
        "or lib/libnccl.so.2; reinstall the nvidia-nccl-cu* wheel"
    )


def shared_libstdcxx_args() -> list[str]:
    """Link arguments that make ``_C.so`` use the shared C++ runtime.

    On the H200 machine (Ubuntu 24.04, g++ 13.3, torch 2.11) the built
    ``_C.so`` held its own copy of libstdc++ code (``std::ostream::_M_insert``
    and codecvt internals) beside the shared ``libstdc++.so.6`` that torch
    loads. That copy's locale was never initialised, so the first error
    message an op formatted (``TORCH_CHECK`` builds it with an
    ``std::ostringstream``) dereferenced a null facet: SIGSEGV instead of a
    ``RuntimeError``, in every op. Naming ``libstdc++.so.6`` right after our
    objects resolves every C++ runtime symbol to the shared library before
    the compiler's own ``-lstdc++`` could pull in the static archive.
    Returns ``[]`` off Linux or when the compiler cannot find that file.
    """
    if not sys.platform.startswith("linux"):
        return []
    cxx = os.environ.get("CXX", "c++")
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if not os.path.isabs(found) or not Path(found).exists():
        return []
    print(f"afd_ext: linking the shared C++ runtime {os.path.realpath(found)}", file=sys.stderr)
    return ["-l:libstdc++.so.6"]


def decide_cuda(torch_cuda: str | None, cuda_home: str | None) -> bool:
    """CUDA build or not, from the torch build, the toolkit and AFD_USE_CUDA."""
    force = os.environ.get("AFD_USE_CUDA", "").strip()
    if force not in ("", "0", "1"):
        raise SystemExit(f"AFD_USE_CUDA must be 0 or 1, got {force!r}")
    if force == "0":
        return False
    possible = torch_cuda is not None and cuda_home is not None
    if force == "1" and not possible:
        why = "torch is not a CUDA build" if torch_cuda is None else "no CUDA toolkit found"
        raise SystemExit(f"AFD_USE_CUDA=1 but {why} (set CUDA_HOME to the toolkit root)")
    return possible


def build_key() -> str:
    """What the compiled core depends on besides its sources, one ``name: value`` line each.

    ``make setup`` rebuilds only when this text or a file under ``csrc/``
    (or ``setup.py``, ``pyproject.toml``) changed: the interpreter's ABI, the
    torch build (its ``torch/version.py``: version, CUDA, git commit, and
    where it is installed), the NCCL wheel, the CUDA toolkit this build would
    use and the build settings from the environment. Reads files only (no
    ``import torch``), so an up-to-date check takes well under a second.
    """
    import importlib.metadata as md
    import sysconfig

    lines = [f"python: {sys.version.split()[0]} {sysconfig.get_config_var('EXT_SUFFIX')}"]
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        lines.append("torch: not installed")
    else:
        root = Path(list(spec.submodule_search_locations)[0])
        try:
            facts = [ln.strip() for ln in (root / "version.py").read_text().splitlines()
                     if ln.startswith(("__version__", "cuda", "git_version", "hip", "rocm"))]
        except OSError as e:
            facts = [f"unreadable version.py ({e})"]
        lines.append(f"torch: {root}; " + "; ".join(facts))
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            lines.append(f"{dist}: {md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    try:
        cuda_home = find_cuda_home()
    except SystemExit as e:  # the build itself will stop with this message
        cuda_home = f"invalid ({e})"
    lines.append(f"cuda toolkit: {cuda_home}")
    for var in ("AFD_USE_CUDA", "TORCH_CUDA_ARCH_LIST", "CXX", "CC"):
        default = DEFAULT_ARCH_LIST if var == "TORCH_CUDA_ARCH_LIST" else ""
        lines.append(f"{var}: {os.environ.get(var, default)}")
    return "\n".join(lines)


def write_torch_record(torch_version: str, torch_cuda: str | None, core_cuda: bool = False,
                       path: Path = ROOT / "afd_ext" / "_built_with.py") -> None:
    """Record the torch this build compiles against, read by ``afd_ext._compat.check_torch`` before ``_C`` loads.

    ``STABLE_ABI``: the oldest torch the core loads under (torch's stable ABI, ``STABLE_TARGET``);
    ``CORE_CUDA``: the CUDA of the core's kernels (``torch_cuda`` when ``core_cuda``), else None.
    """
    major, minor = int(STABLE_TARGET[2:4], 16), int(STABLE_TARGET[4:6], 16)
    text = ("# Generated by setup.py at build time: the torch the compiled core (_C) was built against.\n"
            f"TORCH_VERSION = {torch_version!r}\nTORCH_CUDA = {torch_cuda!r}\n"
            f"STABLE_ABI = '{major}.{minor}'\nCORE_CUDA = {torch_cuda if core_cuda else None!r}\n")
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def extensions():
    import torch

    cuda_home = find_cuda_home()
    use_cuda = decide_cuda(torch.version.cuda, cuda_home)
    write_torch_record(torch.__version__, torch.version.cuda, use_cuda)
    if use_cuda:
        # Must be set before cpp_extension is imported: it resolves CUDA_HOME at import.
        os.environ["CUDA_HOME"] = cuda_home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    arch_list = os.environ["TORCH_CUDA_ARCH_LIST"] if use_cuda else ""
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    src = read_sources()
    sources = src["cpu"] + (src["cuda"] if use_cuda else src["no_cuda"])
    # Quoted for the compiler command line; spaces would split the argument.
    # torch's stable ABI, as of 2.11 (the floor): the core then loads under every later torch, and an
    # unstable torch header is a compile error. Python's limited API: bindings.cpp.
    macros = [("AFD_ARCH_LIST", '"' + arch_list.replace(" ", ";") + '"'),
              ("TORCH_TARGET_VERSION", STABLE_TARGET)]
    cxx = ["-O3"]
    kwargs: dict = {}
    if use_cuda:
        nccl_inc, nccl_lib = find_nccl()
        macros += [("AFD_WITH_CUDA", "1"), ("USE_CUDA", "1")]  # USE_CUDA: the shim's CUDA stream functions
        kwargs = dict(
            include_dirs=[nccl_inc],
            library_dirs=[nccl_lib],
            # torch loads libnccl.so.2 first (libtorch_cuda needs it); the rpath is for a lone dlopen: the
            # nvidia-nccl wheel beside an installed wheel, else the one this build used.
            extra_link_args=shared_libstdcxx_args() + ["-l:libnccl.so.2", "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib",
                                                       f"-Wl,-rpath,{nccl_lib}"],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math"]},
        )
        print(f"afd_ext: CUDA build (torch CUDA {torch.version.cuda}, toolkit {cuda_home}, "
              f"arch {arch_list}, NCCL {nccl_lib})", file=sys.stderr)
        ext_cls = CUDAExtension
    else:
        kwargs = dict(extra_compile_args={"cxx": cxx}, extra_link_args=shared_libstdcxx_args())
        print("afd_ext: CPU-only build (NCCL ops will raise 'built without CUDA')", file=sys.stderr)
        ext_cls = CppExtension
    return [ext_cls(name="afd_ext._C", sources=sources, define_macros=macros, py_limited_api=True, **kwargs)]


def main():
    ext_modules = extensions()  # first: it fixes CUDA_HOME before cpp_extension is imported
    from torch.utils.cpp_extension import BuildExtension

    setup(
        ext_modules=ext_modules,
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": "cp311"}},  # one wheel for CPython 3.11+
    )


if __name__ == "__main__":
    main()
