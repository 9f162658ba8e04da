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


_FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for .venv/bin/python: logs each call; an editable pip install "builds" a fake core.
echo "$*" >> "$FAKE_LOG"
if [ "$1" = -m ] && [ "$2" = pip ]; then
  case " $* " in *" -e "*) echo BUILD >> "$FAKE_LOG"; mkdir -p afd_ext; : > afd_ext/_C.fake.so;; esac
  exit 0
fi
if [ "$1" = -c ]; then
  case "$2" in *build_key*) printf '%s\\n' "$FAKE_KEY";; esac
fi
exit 0
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_setup_rebuilds_only_when_a_build_input_changed(tmp_path):
    """The README's `make demo`/`make test` compile once, then only after a source or torch-build change."""
    import os

    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for name in ("setup.py", "pyproject.toml", "csrc/ops.cpp", "csrc/sources.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("fake\n")
    py = tmp_path / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(_FAKE_PYTHON)
    py.chmod(0o755)
    log = tmp_path / "calls.log"
    # No MAKEFLAGS from an enclosing `make test` (its variable overrides would reach this make).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    env.update(FAKE_LOG=str(log), FAKE_KEY="torch 2.14.1+cu130")

    def setup() -> tuple[int, int]:
        proc = subprocess.run(["make", "-C", str(tmp_path), "setup", "VENV=.venv", "PYTHON=false"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        calls = log.read_text().splitlines()
        return calls.count("BUILD"), sum('install "torch>=2.11"' in c or "install torch>=2.11" in c for c in calls)

    assert setup() == (1, 1)  # fresh tree: tools once, one build
    assert setup() == (1, 1)  # nothing changed: no build, no pip
    (tmp_path / "csrc" / "ops.cpp").write_text("changed\n")
    assert setup() == (2, 1)  # a source changed
    env["FAKE_KEY"] = "torch 2.15.0+cu130"
    assert setup() == (3, 1)  # the torch build changed
    assert setup() == (3, 1)
    (tmp_path / "afd_ext" / "_C.fake.so").unlink()
    assert setup() == (4, 1)  # the compiled core is gone (e.g. `make clean`)
    (tmp_path / "pyproject.toml").write_text("changed\n")
    assert setup() == (5, 1)


def test_build_key_names_the_torch_build_and_the_build_settings(monkeypatch):
    mod = _setup_module()
    import torch

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    key = mod.build_key()
    assert f"'{torch.__version__}'" in key and f"'{torch.version.git_version}'" in key
    assert "TORCH_CUDA_ARCH_LIST: 9.0" in key
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0 10.0")
    assert mod.build_key() != key  # a different arch list is a different build
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert mod.build_key() == key  # and the same settings give the same key (no rebuild)


@pytest.mark.parametrize("cuda_built,gpus", [(True, 0), (True, 2), (False, 0), (False, 1)])
def test_info_says_what_was_built_and_what_is_visible(monkeypatch, capsys, cuda_built, gpus):
    """`afd-ext info` on a CUDA build without a GPU must not read as "CUDA works here"."""
    import json

    import torch

    from afd_ext import ops
    from afd_ext.tools import cli

    monkeypatch.setattr(ops, "is_cuda_built", lambda: cuda_built)
    monkeypatch.setattr(ops._ops, "nccl_version", lambda: 22809 if cuda_built else 0)
    monkeypatch.setattr(ops._C, "NCCL_VERSION_CODE", 22809 if cuda_built else 0, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU-{i}")
    assert cli.main(["info"]) == 0
    import re

    lines = dict(re.fullmatch(r"(\S+(?: \S+)?)\s{2,}(.*)", ln).groups() for ln in capsys.readouterr().out.splitlines())
    assert lines["built with"].startswith("CUDA kernels and NCCL ops" if cuda_built else "CPU only")
    if cuda_built:
        assert "NCCL 2.28.9 compiled, 2.28.9 loaded" in lines["built with"]
    assert lines["GPUs visible"].split()[0] == str(gpus)
    runs = cuda_built and gpus > 0
    assert lines["transports"].startswith("nccl, peer, gloo" if runs else "gloo; not nccl: "), lines["transports"]
    if cuda_built and not gpus:
        assert "not peer: no GPU is visible" in lines["transports"]
    if not cuda_built:
        assert "not peer: afd_ext was built without CUDA" in lines["transports"]
    # the connector's own rule: NCCL, peer memory behind it until a two-GPU timing shows it ahead (#35)
    assert lines["default"].startswith("nccl" if runs else "gloo")
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cuda_built"] is cuda_built and info["gpus_visible"] == gpus
    assert info["transports"] == (["nccl", "peer", "gloo"] if runs else ["gloo"])
    assert info["default_transport"] == ("nccl" if runs else "gloo")
    assert info["gpu_names"] == [f"GPU-{i}" for i in range(gpus)]
