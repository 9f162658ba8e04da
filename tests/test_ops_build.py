"""One build description: setup.py and CMakeLists.txt compile the same source list."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_module():
    spec = importlib.util.spec_from_file_location("afd_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # setup() runs only under __main__
    return mod


def test_source_list_names_existing_files_once():
    src = _setup_module().read_sources()
    assert set(src) == {"cpu", "cuda", "no_cuda"}
    every = src["cpu"] + src["cuda"] + src["no_cuda"]
    assert len(every) == len(set(every))
    for path in every:
        assert (ROOT / path).is_file(), path
    # Every C++/CUDA source under csrc/ is listed (nothing compiled by one build only).
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".cu")}
    assert on_disk == set(every)


@pytest.mark.parametrize("use_cuda", [False, True])
def test_cmake_resolves_the_same_sources_as_setup_py(tmp_path, use_cuda):
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed: cannot compare the CMake source list")
    src = _setup_module().read_sources()
    expected = src["cpu"] + (src["cuda"] if use_cuda else src["no_cuda"])
    out = tmp_path / "sources.txt"
    # Only the list is compared here (AFD_LIST_ONLY stops the configure right
    # after resolving it); `make cmake-check` compiles the CPU part with CMake.
    cmd = [
        "cmake", "-S", str(ROOT), "-B", str(tmp_path / "b"),
        f"-DPython_EXECUTABLE={sys.executable}", f"-DAFD_SOURCES_OUT={out}",
        f"-DAFD_USE_CUDA={'ON' if use_cuda else 'OFF'}", "-DAFD_LIST_ONLY=ON",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and out.exists(), proc.stdout + proc.stderr
    assert out.read_text().split() == expected
